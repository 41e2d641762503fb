"""A memory of the user's as a :class:`~agentspec.protocols.Memory`.

A Speculator takes any object with ``lookup``, ``record`` and ``credit`` as its memory (a
memory drafter alone needs only ``lookup``). This wrapper gives it the rest of the protocol
once, at construction, so nothing downstream probes for optional methods: a lookup that takes
no ``min_similarity`` is called without it, a memory without ``completions``, ``prefetch`` or
``warmup`` has none of that work done, and the end of a request is its credits, then its
record (each where the memory has the method).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from agentspec.memory.completion import CompletionMemory
from agentspec.protocols import Memory
from agentspec.types import Finished, Record

# What a Speculator needs of a memory of the user's (checked by its constructor).
REQUIRED = ("lookup", "record", "credit")


class ForeignMemory:
    """The :class:`~agentspec.protocols.Memory` view of ``memory`` (see the module docstring).

    Args:
        memory: an object with a callable ``lookup`` (and, to remember, ``record`` and
            ``credit``).

    Raises:
        TypeError: it has no ``lookup``.
    """

    def __init__(self, memory: Any) -> None:
        if not callable(getattr(memory, "lookup", None)):
            raise TypeError(f"a memory needs a callable lookup; {type(memory).__name__} has none")
        self.memory = memory
        self._filters = _takes(memory.lookup, "min_similarity")
        self._completions = _method(memory, "completions")
        self._prefetch = _method(memory, "prefetch")
        self._warmup = _method(memory, "warmup")
        self._record = _method(memory, "record")
        self._credit = _method(memory, "credit")
        self._record_behind = _method(memory, "record_behind")

    def lookup(self, key_text: str, *, scope: str, model: str, k: int = 8,
               min_similarity: float | None = None) -> list[tuple[Record, float]]:
        extra = {"min_similarity": min_similarity} if self._filters else {}
        return list(self.memory.lookup(key_text, scope=scope, model=model, k=k, **extra))

    def completions(self, *, scope: str, model: str, after_id: int = 0) -> Iterator[Record]:
        if self._completions is None:
            return iter(())
        return iter(self._completions(scope=scope, model=model, after_id=after_id))

    def finish(self, done: Finished, *, behind: bool = False) -> Future[int] | int:
        if self._credit is not None:
            for record_id, accepted in done.credits:
                self._credit(record_id, accepted)
        write = self._record_behind if behind and self._record_behind is not None else self._record
        row = done.record
        if not (done.remember and row.completion_ids) or write is None:
            return -1
        return write(scope=row.scope, model=row.model, request_text=row.request_text,  # type: ignore[no-any-return]
                     key_text=row.key_text, completion_text=row.completion_text,
                     completion_ids=list(row.completion_ids))

    def prefetch(self, key_text: str, *, scope: str | None = None, model: str | None = None,
                 k: int = 8, min_similarity: float | None = None) -> None:
        # A user's prefetch takes the key (what the protocol asked of it before lookups ahead).
        if self._prefetch is not None:
            self._prefetch(key_text)

    def warmup(self) -> None:
        if self._warmup is not None:
            self._warmup()


def as_memory(memory: Any) -> Memory:
    """``memory`` as a :class:`~agentspec.protocols.Memory`: a CompletionMemory (or one
    already wrapped) as it is, anything else through :class:`ForeignMemory`."""
    if isinstance(memory, (CompletionMemory, ForeignMemory)):
        return memory
    return ForeignMemory(memory)


def _method(obj: Any, name: str) -> Any:
    fn = getattr(obj, name, None)
    return fn if callable(fn) else None


def _takes(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name`` (or any keyword)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
