"""How the completion memory outlives a failing database: answer without it, say so once, queue.

The memory is an accelerator: drafts are verified exactly, so a generation that cannot read
the memory is only slower (it drafts from the prompt), never wrong. When the SQL store fails
(server stopped, file or folder removed, a lock held too long, a read-only database, a full
disk) :class:`~agentspec.memory.completion.CompletionMemory` asks a ``StoreGuard`` what to do:

- **a breaker per direction** (read, write): after a failure the store is left alone for
  ``retry_interval_s``, since a server that is down may take a connect timeout to say so;
  a read-only database fails writes only, and its reads go on;
- **one warning per outage** (:class:`~agentspec.errors.MemoryFaultWarning`) naming the
  database, the error and what fixes it; said again only after the store was healthy again;
- **a bounded queue** of completions recorded while writes fail, written in order in one
  transaction once writes succeed; beyond ``max_pending`` the oldest are dropped, and counted.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Literal

from agentspec.errors import MemoryFaultWarning, StoreError
from agentspec.types import Record

Direction = Literal["read", "write"]
log = logging.getLogger("agentspec.memory.completion")

# (substrings of the driver's message, lower case) -> what fixes it; first match wins.
_FIXES = (
    (("disk is full", "no space left", "could not extend file", "disk full"),
     "free space on the disk that holds the database"),
    (("readonly", "read-only"),
     "make the database writable (file permissions; a primary server, not a read-only "
     "replica; default_transaction_read_only off)"),
    (("database is locked", "lock timeout", "deadlock"),
     "another process holds the database's write lock too long: find and stop it"),
    (("unable to open", "was removed", "no such file"),
     "the database file or its folder is gone: restore it, or point --db / AGENTSPEC_DB "
     "elsewhere"),
    (("no such table", "does not exist"),
     "the database lost its tables (replaced by an empty file?): restore it, or restart to "
     "create them"),
    (("malformed", "not a database", "corrupt"),
     "the database file is damaged: restore it from a backup (agentspec cache export/import)"),
)
_UNREACHABLE = ("start the database server, or check that --db / AGENTSPEC_DB reaches it "
                "(host, port, credentials)")


def fix_for(message: str) -> str:
    """What fixes the failure a driver's ``message`` describes (unreachable by default)."""
    low = message.lower()
    for needles, fix in _FIXES:
        if any(n in low for n in needles):
            return fix
    return _UNREACHABLE


@dataclass
class _Breaker:
    retry_at: float = float("-inf")  # time.monotonic() before which the store is left alone
    error: str | None = None  # the last failure, None once the direction works again


class StoreGuard:
    """The memory's fault state: two breakers, the warn-once flag, the queue and its counters.

    Not thread-safe by itself: the memory calls it under its lock.

    Args:
        max_pending: completions kept while writes fail (0: none, every one is dropped).
        retry_interval_s: least time between two attempts on a failing direction.
    """

    def __init__(self, *, max_pending: int, retry_interval_s: float) -> None:
        if max_pending < 0:
            raise ValueError(f"max_pending must be >= 0, got {max_pending}")
        if not retry_interval_s >= 0:
            raise ValueError(f"retry_interval_s must be >= 0, got {retry_interval_s}")
        self.max_pending = max_pending
        self.retry_interval_s = retry_interval_s
        self.pending: deque[Record] = deque()
        self.counts: Counter[str] = Counter()
        self._breakers: dict[Direction, _Breaker] = {"read": _Breaker(), "write": _Breaker()}
        self._warned = False

    def due(self, direction: Direction) -> bool:
        """Whether to try the store in ``direction`` now (its breaker is closed or may retry)."""
        return time.monotonic() >= self._breakers[direction].retry_at

    @property
    def healthy(self) -> bool:
        return not self.pending and all(b.error is None for b in self._breakers.values())

    def failed(self, direction: Direction, error: StoreError) -> None:
        """Note a failure: open the breaker; warn when the memory was healthy until now."""
        breaker = self._breakers[direction]
        breaker.error = str(error)
        breaker.retry_at = time.monotonic() + self.retry_interval_s
        self.counts[f"{direction}_failures"] += 1
        if not self._warned:
            self._warned = True
            warnings.warn(self._message(error), MemoryFaultWarning, stacklevel=4)

    def succeeded(self, direction: Direction) -> None:
        """Note a success: close the breaker; once all is well, the next outage warns again."""
        breaker = self._breakers[direction]
        if breaker.error is not None:
            log.info("completion memory: %s works again", direction)
        breaker.error, breaker.retry_at = None, float("-inf")
        if self._warned and self.healthy:
            self._warned = False

    def queue(self, record: Record) -> None:
        """Keep ``record`` for later; beyond ``max_pending`` drop the oldest (counted)."""
        if self.max_pending == 0:
            self.counts["records_dropped"] += 1
            return
        if len(self.pending) >= self.max_pending:
            self.pending.popleft()
            self.counts["records_dropped"] += 1
        self.pending.append(record)

    def stats(self) -> dict[str, Any]:
        """The counters, the queue's length and bound, and the last error of each direction."""
        return {"ok": self.healthy, "records_pending": len(self.pending),
                "max_pending": self.max_pending,
                **{k: self.counts[k] for k in ("records_dropped", "records_flushed",
                                               "lookups_skipped", "credits_dropped",
                                               "read_failures", "write_failures")},
                "read_error": self._breakers["read"].error,
                "write_error": self._breakers["write"].error}

    def _message(self, error: StoreError) -> str:
        queue = (f"completions recorded meanwhile are queued (up to {self.max_pending}, the "
                 f"oldest dropped beyond that) and written when it is back"
                 if self.max_pending else "completions recorded meanwhile are dropped "
                                          "(max_pending=0)")
        return (f"completion memory unavailable: {error}. Generation goes on without it "
                f"(drafts from the prompt only; outputs are unchanged); {queue}; counts in "
                f"CompletionMemory.stats()['faults']. To fix: {fix_for(str(error))}.")
