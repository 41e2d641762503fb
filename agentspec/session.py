"""Sessions: a scope and lookup sources shared by the calls of one agent task.

Inside ``with spec.session("task-42", scope="sql-agent") as s:`` every call of that
Speculator uses the session's scope (unless a call names its own), drafts from the session's
earlier completions and added tool outputs, and adds its statistics to ``s.stats``. The current
session lives in a ``ContextVar``, so threads and asyncio tasks each see their own.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, TypeVar

from agentspec.types import Generation, GenerationStats

_CURRENT: ContextVar[Session | None] = ContextVar("agentspec_session", default=None)
# Lists that collect every Generation observed in this context (see ``observed_calls``).
_SINKS: ContextVar[tuple[list[Generation], ...]] = ContextVar("agentspec_sinks", default=())

F = TypeVar("F", bound=Callable[..., Any])


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
        for sink in _SINKS.get():
            sink.append(generation)

    def __enter__(self) -> Session:
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._token)


def current_session(speculator: Any) -> Session | None:
    """The session active in this context for ``speculator``, if any."""
    sess = _CURRENT.get()
    return sess if sess is not None and sess.speculator is speculator else None


def tool_loop(spec: Any, *, scope: str = "default", name: str | None = None) -> Callable[[F], F]:
    """Run each call of the decorated (sync or async) function in a fresh session of ``spec``.

    Inside the function, :func:`current_session` returns that session (for ``add_source`` and
    ``stats``). A call made while a session of ``spec`` is already active joins it instead of
    opening a nested one, so decorated helpers compose.

    Args:
        spec: the Speculator whose calls are grouped.
        scope: the memory scope of the session's calls.
        name: the session's name; default the function's ``__qualname__``.

    Raises:
        ValueError: an empty ``scope`` or ``name``.
    """
    if not isinstance(scope, str) or not scope:
        raise ValueError(f"tool_loop scope must be a non-empty str, got {scope!r}")
    if name is not None and not name:
        raise ValueError(f"tool_loop name must be non-empty or None, got {name!r}")

    def decorate(fn: F) -> F:
        label = name or fn.__qualname__

        def open_session() -> AbstractContextManager[Session]:
            active = current_session(spec)
            # Re-entering an active Session would overwrite its context token: join it as is.
            return nullcontext(active) if active is not None else Session(spec, label, scope=scope)

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                # Each asyncio task runs in its own copy of the context: isolation is free.
                with open_session():
                    return await fn(*args, **kwargs)
            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with open_session():
                return fn(*args, **kwargs)
        return wrapper  # type: ignore[return-value]

    return decorate


@contextmanager
def observed_calls(speculator: Any) -> Iterator[list[Generation]]:
    """Collect the Generations of the calls on ``speculator`` made in this context.

    Superseded for streams: ``Speculator.stream`` returns a :class:`~agentspec.stream.Stream`
    whose ``generation`` attribute is the finished Generation; use that. Kept for callers
    that still collect Generations this way. Outside any session the calls run
    in a throwaway one-call session with scope ``"default"``, which drafts and scopes exactly
    as no session does; inside a session, that session is used and sees the calls as usual.

    Yields:
        A list that receives each Generation as its call finishes.
    """
    out: list[Generation] = []
    token = _SINKS.set((*_SINKS.get(), out))
    active = current_session(speculator)
    scope_cm = Session(speculator, "call") if active is None else nullcontext(active)
    try:
        with scope_cm:
            yield out
    finally:
        try:
            _SINKS.reset(token)
        except ValueError:  # closed from another context (an abandoned generator): harmless
            pass


def record(memory: Any, *, scope: str = "default", speculator: Any = None,
           tokenizer: Any = None, model: str | None = None) -> Callable[[F], F]:
    """Decorate a ``(prompt or messages) -> str`` function to record its calls into ``memory``.

    Logs of a past agent (an API model, say) warm a completion memory this way: each call's
    conversation and completion become a record that a Speculator on the same model drafts
    from. Works on sync and async functions; the function's result is returned unchanged.

    Args:
        memory: a completion memory exposing ``record(*, scope, model, request_text, key_text,
            completion_text, completion_ids) -> int``.
        scope: the memory scope the records go to.
        speculator: the Speculator that will draft from the records: its tokenizer makes the
            completion ids and ``speculator.target.fingerprint`` names the model.
        tokenizer: instead of ``speculator``: a tokenizer for the completion ids; then
            ``model`` (the fingerprint of the drafting Speculator's target) is required.
        model: overrides the model name taken from ``speculator``.

    Raises:
        ValueError: neither or both of ``speculator``/``tokenizer``, no model name, or an
            empty scope.
    """
    if (speculator is None) == (tokenizer is None):
        raise ValueError(f"pass exactly one of speculator= or tokenizer=, got speculator="
                         f"{speculator!r} and tokenizer={type(tokenizer).__name__}")
    if not scope:
        raise ValueError(f"record scope must be non-empty, got {scope!r}")
    tok = tokenizer if tokenizer is not None else speculator.tokenizer
    name = model or (speculator.target.fingerprint if speculator is not None else None)
    if not name:
        raise ValueError(f"record needs model= (the target fingerprint) with tokenizer=, got {model!r}")

    def save(prompt: Any, completion: Any) -> None:
        if not isinstance(completion, str):
            raise TypeError(f"recorded function must return a str, got {type(completion).__name__}")
        _record_call(memory, tok, prompt, completion, scope=scope, model=name)

    def decorate(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def awrapper(prompt: Any, *args: Any, **kwargs: Any) -> Any:
                out = await fn(prompt, *args, **kwargs)
                save(prompt, out)
                return out
            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(prompt: Any, *args: Any, **kwargs: Any) -> Any:
            out = fn(prompt, *args, **kwargs)
            save(prompt, out)
            return out
        return wrapper  # type: ignore[return-value]

    return decorate


def _record_call(memory: Any, tokenizer: Any, prompt: Any, completion: str, *, scope: str,
                 model: str) -> int:
    """One memory row for one call: keyed by the whole conversation, ids by ``tokenizer``."""
    from agentspec.text import conversation_key, render_chat, validate_prompt

    validate_prompt(prompt)
    request_text = prompt if isinstance(prompt, str) else render_chat(tokenizer, prompt)
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"] if completion else []
    return int(memory.record(scope=scope, model=model, request_text=request_text,
                             key_text=conversation_key(prompt), completion_text=completion,
                             completion_ids=[int(i) for i in ids]))
