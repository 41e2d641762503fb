"""A request as the scheduler holds it (:class:`Job`), and the scheduler's load as a value.

Kept apart from :mod:`agentspec.scheduler` so that what a caller hands the scheduler and
what it reads back are plain data, separate from the steps that act on them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentspec.decoding.loop import Decoding
from agentspec.engine.plan import Prefill
from agentspec.engine.sequence import Sequence as KVSequence


@dataclass(frozen=True)
class Load:
    """A scheduler's load: requests ``running`` (admitted, not ended), ``waiting`` for room,
    and the most it runs at once (``max_batch``)."""

    running: int
    waiting: int
    max_batch: int


class Done:
    """The event that ends a request's steps."""


DONE = Done()


@dataclass(eq=False)
class Job:
    """One request in the scheduler.

    Args:
        prompt_ids: the prompt's token ids.
        make: builds the request's decode loop on its sequence (at admission).
        on_abandon: called once when the request ends without finishing (cancelled or
            failed), after its drafters' ``end``: the Speculator books its drafts' credits.
    """

    prompt_ids: list[int]
    make: Callable[[KVSequence], Decoding]
    on_abandon: Callable[[], None] | None = None
    seq: KVSequence | None = None
    decoding: Decoding | None = None
    prefill: Prefill | None = None
    events: deque[Any] = field(default_factory=deque)
    cached_tokens: int = 0
    admitted: float = 0.0
    state: str = "new"  # new, waiting, prefill, decode, ended
    cancelled: bool = False
    _abandon_done: bool = False
