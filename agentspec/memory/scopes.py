"""The completion memory's indexes, one per (scope, embedder), kept in step with its store.

The SQL store is the source of truth; each (scope, embedder) has a FaissIndex in this process,
derived from the store's rows. Several processes may share one store: before a lookup the
index picks up rows that others added (by id watermark, at most every ``sync_interval_s``),
and when the store's row count for the scope disagrees with the index size it reconciles the
two id sets, dropping ids that were deleted (evicted or pruned elsewhere) and adding missed
ones. A wrong or stale hit only costs speed: drafts are verified exactly.

A request's own memory work must not grow with the store. Picking up new rows reads only the
rows written since (the primary key from the watermark on). What reads every row of a scope
(the row count above; the token totals behind the caps) runs at most every
``check_interval_s``, and between two checks the caps are kept from this memory's own writes:
it checks early when they could have used up the room the last check left. A deleted row
that lingers in an index until then is skipped at lookup (it is no longer in the store).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import numpy as np

from agentspec.memory.caps import CapsWatch
from agentspec.memory.index import ScopeIndex, load_index, save_index
from agentspec.protocols import Embedder, MemoryStore
from agentspec.stores.faiss_index import FaissIndex
from agentspec.types import Record


class IndexSettings(Protocol):
    """What the indexes read from their memory at each call (its settings may be changed
    after it was built, and its embedder is built on first use)."""

    sync_interval_s: float
    check_interval_s: float
    max_tokens_per_scope: int | None
    max_tokens_total: int | None

    @property
    def embedder(self) -> Embedder: ...


class ScopeIndexes:
    """The in-process indexes of a memory's store, by ``(scope, embedder name)``: derived
    data, loaded from ``index_dir`` or built from the store's rows, brought up to date before
    they answer. Called under the memory's lock; a failing store's StoreError goes through.

    Args:
        store: the memory's store (the truth).
        index_dir: where index files are kept between runs; ``None``: in memory only.
        settings: the memory, read at each call (:class:`IndexSettings`).
    """

    def __init__(self, store: MemoryStore, index_dir: Path | None,
                 settings: IndexSettings) -> None:
        self.store = store
        self.index_dir = index_dir
        self.settings = settings
        self.by_key: dict[tuple[str, str], ScopeIndex] = {}
        self.caps = CapsWatch()

    @property
    def store_id(self) -> str:
        """The store as index files name it: its URL, else its type."""
        return str(getattr(self.store, "url", type(self.store).__name__))

    def sizes(self) -> dict[str, int]:
        """Vectors per loaded scope."""
        return {s: len(st.index) for (s, _), st in self.by_key.items()}

    def sync(self, scope: str, *, force: bool = False) -> ScopeIndex:
        """The index of ``scope``, brought up to date with the store when due."""
        embedder, check_interval_s = self.settings.embedder, self.settings.check_interval_s
        key = (scope, embedder.name)
        state = self.by_key.get(key)
        if state is None:
            state = self.by_key[key] = load_index(self.index_dir, scope, embedder.name,
                                                  int(embedder.dim), self.store_id)
            force = True
        now = time.monotonic()
        if not force and now - state.synced_at < self.settings.sync_interval_s:
            return state
        name = embedder.name
        state.catch_up(self.store, scope, name, now, check_interval_s)
        if now - state.checked_at >= check_interval_s:  # reads the scope's every row id
            if self.store.count(scope=scope, embedder=name) != len(state.index):
                state.reconcile(self.store, scope, name)
            state.checked_at = now
        state.synced_at = now
        return state

    def nearest(self, query: np.ndarray, scope: str, model: str, k: int,
                min_similarity: float | None = None) -> list[tuple[Record, float]]:
        """Up to ``k`` records of ``scope`` and ``model`` nearest to ``query``, most similar
        first, none less similar than ``min_similarity``."""
        state = self.sync(scope)
        size = len(state.index)
        fetch = min(size, 2 * k)  # over-fetch a little: other models may share the scope
        while True:
            hits = state.index.search(query, fetch)
            deepest = fetch >= size
            if min_similarity is not None and hits and hits[-1][1] < min_similarity:
                hits = [(i, s) for i, s in hits if s >= min_similarity]
                deepest = True  # what lies deeper is less similar still
            found = {r.id: r for r in self.store.get_many([i for i, _ in hits])} if hits else {}
            out = [(found[i], s) for i, s in hits if i in found and found[i].model == model]
            if len(out) >= k or deepest:  # other models crowd the top: look deeper
                return out[:k]
            fetch = min(size, fetch * 4)

    def search(self, query: np.ndarray, scopes: list[str], k: int) -> list[tuple[int, float]]:
        """The ``k`` ids nearest to ``query`` over ``scopes``, any model, most similar first."""
        hits: list[tuple[int, float]] = []
        for s in scopes:
            hits += self.sync(s).index.search(query, k)
        return sorted(hits, key=lambda h: -h[1])[:k]

    def upkeep(self, tokens: dict[str, int]) -> None:
        """After writing ``tokens`` completion tokens per scope: bring the scopes' indexes up to
        date; evict above the caps when a check is due (see :class:`~agentspec.memory.caps.CapsWatch`)."""
        caps = (self.settings.max_tokens_per_scope, self.settings.max_tokens_total)
        for scope, n in tokens.items():
            self.sync(scope, force=True)
            if caps == (None, None) or not self.caps.due(scope, n, self.settings.check_interval_s):
                continue
            totals = self.store.token_total(scope), self.store.token_total(None)
            if any(cap is not None and tokens > cap for cap, tokens in zip(caps, totals, strict=True)):
                evicted = self.store.evict_to_caps(*caps, scope=scope)
                for state in self.by_key.values() if evicted else ():
                    state.index.remove(evicted)
                totals = self.store.token_total(scope), self.store.token_total(None)
            self.caps.checked(scope, *caps, *totals)

    def rebuild(self, scope: str) -> int:
        """Build the index of ``scope`` afresh from the store's rows; returns its size."""
        embedder = self.settings.embedder
        state = ScopeIndex(FaissIndex(int(embedder.dim)))
        state.add_rows(self.store.ids_after(0, scope=scope, embedder=embedder.name))
        state.synced_at = time.monotonic()
        self.by_key[(scope, embedder.name)] = state
        return len(state.index)

    def save(self) -> None:
        """Write every loaded index to ``index_dir`` (nothing when it is None)."""
        if self.index_dir is None:
            return
        for (scope, _), state in self.by_key.items():
            save_index(self.index_dir, scope, self.settings.embedder.name, self.store_id, state)
