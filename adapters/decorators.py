"""Decorators that put a whole agent loop in one session: ``@spec.tool_loop(scope=...)``.

Every model call the decorated function makes (directly, through the LangChain adapter, from
helper functions) shares one :class:`agentspec.session.Session`: its scope, its lookup sources
(earlier completions, tool outputs added with ``session.add_source``) and its statistics.
The session lives in a ``ContextVar``, so concurrent threads and asyncio tasks running the same
decorated function each get their own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from agentspec.session import Session, current_session

F = TypeVar("F", bound=Callable[..., Any])


def tool_loop(spec: Any, *, scope: str = "default", name: str | None = None) -> Callable[[F], F]:
    """Run each call of the decorated (sync or async) function in a fresh session of ``spec``.

    Inside the function, :func:`current` returns that session (for ``add_source`` and
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


def current(spec: Any) -> Session | None:
    """The session of ``spec`` active in this thread or task (inside a ``tool_loop``), if any."""
    return current_session(spec)
