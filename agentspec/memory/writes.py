"""The completion memory's writes to its store, which ride out a failing database.

A completion is written as one row (with its embedding); then the scope's index catches up
and the caps are kept (:meth:`~agentspec.memory.scopes.ScopeIndexes.upkeep`). While writes
fail (:class:`~agentspec.memory.guard.StoreGuard` says when to try again) completions wait in
the guard's bounded queue, and are written in order, in one transaction, once writes succeed;
a credit (a draft's accepted tokens) is dropped and counted. Nothing here raises StoreError.
"""

from __future__ import annotations

from agentspec.errors import StoreError
from agentspec.memory.guard import StoreGuard
from agentspec.memory.scopes import ScopeIndexes
from agentspec.protocols import MemoryStore
from agentspec.types import Record


class Writes:
    """What the memory writes to ``store``, through ``guard``; ``scopes`` are kept up to date
    after each write. Called under the memory's lock."""

    def __init__(self, store: MemoryStore, guard: StoreGuard, scopes: ScopeIndexes) -> None:
        self.store = store
        self.guard = guard
        self.scopes = scopes

    def add(self, record: Record) -> int:
        """Write ``record`` after the queue; its id (an exact duplicate: the existing id), or
        ``-1`` when it was queued (the store cannot be written now, or others wait before it)."""
        self.flush()
        if self.guard.pending or not self.guard.due("write"):  # keep the order
            self.guard.queue(record)
            return -1
        try:
            rid, _created = self.store.add(record)
        except StoreError as e:
            self.guard.failed("write", e)
            self.guard.queue(record)
            return -1
        self.guard.succeeded("write")
        self.upkeep({record.scope: len(record.completion_ids)})
        return rid

    def flush(self, *, force: bool = False) -> None:
        """Write the queue, oldest first, in one transaction (when writes are due)."""
        guard = self.guard
        if not guard.pending or not (force or guard.due("write")):
            return
        batch = list(guard.pending)
        try:
            self.store.add_many(batch)  # one transaction: all or none
        except StoreError as e:
            guard.failed("write", e)
            return
        guard.pending.clear()
        guard.counts["records_flushed"] += len(batch)
        guard.succeeded("write")
        tokens: dict[str, int] = {}
        for r in batch:
            tokens[r.scope] = tokens.get(r.scope, 0) + len(r.completion_ids)
        self.upkeep(dict(sorted(tokens.items())))

    def upkeep(self, tokens: dict[str, int]) -> None:
        """After writing ``tokens`` completion tokens per scope: bring the scopes' indexes up to
        date; evict above the caps when a check is due (:meth:`ScopeIndexes.upkeep`)."""
        try:
            self.scopes.upkeep(tokens)
        except StoreError as e:  # the row is stored: the next sync catches up
            self.guard.failed("write", e)

    def credit(self, record_id: int, accepted_tokens: int) -> None:
        """Note that a draft from ``record_id`` had ``accepted_tokens`` accepted (LRU + stats);
        dropped (and counted) while the store cannot be written."""
        if self.guard.due("write"):
            try:
                self.store.touch(record_id, accepted_tokens=accepted_tokens)
            except StoreError as e:
                self.guard.failed("write", e)
            else:
                self.guard.succeeded("write")
                return
        self.guard.counts["credits_dropped"] += 1
