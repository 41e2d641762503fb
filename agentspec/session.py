"""Sessions: a scope and lookup sources shared by the calls of one agent task.

Inside ``with spec.session("task-42", scope="sql-agent") as s:`` every call of that
Speculator uses the session's scope (unless a call names its own), drafts from the session's
earlier completions and added tool outputs, and adds its statistics to ``s.stats``. The current
session lives in a ``ContextVar``, so threads and asyncio tasks each see their own.
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from typing import Any

from agentspec.types import Generation, GenerationStats

_CURRENT: ContextVar[Session | None] = ContextVar("agentspec_session", default=None)


class Session:
    """The shared state of one agent task on one Speculator."""

    def __init__(self, speculator: Any, name: str, *, scope: str = "default",
                 max_sources: int = 64) -> None:
        if not name:
            raise ValueError(f"session name must be non-empty, got {name!r}")
        if not scope:
            raise ValueError(f"session scope must be non-empty, got {scope!r}")
        self.speculator = speculator
        self.name = name
        self.scope = scope
        self.max_sources = max_sources
        self.sources: list[list[int]] = []
        self.stats = GenerationStats()
        self.calls = 0
        self._lock = threading.Lock()

    def add_source(self, text: str) -> None:
        """Make ``text`` (a tool output, a document) a prompt-lookup source for later calls."""
        if not isinstance(text, str):
            raise ValueError(f"session source must be a str, got {type(text).__name__}")
        if text:
            ids = self.speculator.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._add_ids(list(ids))

    def _add_ids(self, ids: list[int]) -> None:
        with self._lock:
            self.sources.append(ids)
            del self.sources[: -self.max_sources]

    def observe(self, generation: Generation) -> None:
        """Called by the Speculator after each call made inside the session."""
        self._add_ids(list(generation.token_ids))
        with self._lock:
            self.stats = self.stats + generation.stats
            self.calls += 1

    def __enter__(self) -> Session:
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._token)


def current_session(speculator: Any) -> Session | None:
    """The session active in this context for ``speculator``, if any."""
    sess = _CURRENT.get()
    return sess if sess is not None and sess.speculator is speculator else None
