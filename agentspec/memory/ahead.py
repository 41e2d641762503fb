"""Lookups started ahead of their call (``CompletionMemory.prefetch``), kept until it comes.

A caller that knows its key before it has other work to do starts the whole lookup on the
memory's worker thread; the lookup with the same arguments then takes the answer. A record of
the scope written meanwhile discards the answers of that scope, which may be missing it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from agentspec.types import Record

# Lookups started ahead and kept until their lookup (one a concurrent call; a few spare).
AHEAD = 64

# A lookup's arguments: key text, scope, model, k, min_similarity.
LookupArgs = tuple[str, str, str, int, float | None]
Found = list[tuple[Record, float]]


class LookupsAhead:
    """The futures of lookups started ahead, by their arguments, oldest first (at most
    :data:`AHEAD`: the oldest are forgotten)."""

    def __init__(self) -> None:
        self._started: OrderedDict[LookupArgs, Future[Found]] = OrderedDict()
        self._lock = threading.Lock()

    def start(self, args: LookupArgs, submit: Callable[[], Future[Found]]) -> None:
        """Keep ``submit()``'s future for ``args``, unless a lookup of them is kept already."""
        with self._lock:
            if args in self._started:
                return
            self._started[args] = submit()
            while len(self._started) > AHEAD:
                self._started.popitem(last=False)

    def take(self, args: LookupArgs) -> Future[Found] | None:
        """The lookup started ahead with ``args`` (no longer kept), or None."""
        with self._lock:
            return self._started.pop(args, None)

    def discard(self, scope: str) -> None:
        """Drop the lookups started ahead in ``scope``."""
        with self._lock:
            for args in [a for a in self._started if a[1] == scope]:
                del self._started[args]
