"""Decorators that put a whole agent loop in one session: ``@spec.tool_loop(scope=...)``.

Every model call the decorated function makes (directly, through the LangChain adapter, from
helper functions) shares one :class:`agentspec.session.Session`: its scope, its lookup sources
(earlier completions, tool outputs added with ``session.add_source``) and its statistics.
The session lives in a ``ContextVar``, so concurrent threads and asyncio tasks running the same
decorated function each get their own. The decorator itself lives in the core
(:func:`agentspec.session.tool_loop`), where ``Speculator.tool_loop`` finds it.
"""

from __future__ import annotations

from typing import Any

from agentspec.session import Session, current_session, tool_loop

__all__ = ["current", "tool_loop"]


def current(spec: Any) -> Session | None:
    """The session of ``spec`` active in this thread or task (inside a ``tool_loop``), if any."""
    return current_session(spec)
