"""CompletionMemory: past completions keyed by an embedding of the conversation, replayed as drafts.

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

The memory is an accelerator, so its database failing must not fail a generation: ``lookup``,
``completions``, ``record`` and ``credit`` never raise StoreError. A failure is warned about
once, lookups answer nothing while it lasts, and recorded completions wait in a bounded queue
until writes succeed again (see :mod:`agentspec.memory.guard`). A corrupt index file is
rebuilt from the store. ``search``, ``rebuild`` and ``records`` raise: they serve the CLI.

Importing this module does not import torch; the default embedder loads it on first use.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from agentspec.errors import MemoryFaultWarning, StoreError
from agentspec.memory.caps import CapsWatch
from agentspec.memory.embedder import MiniLMEmbedder
from agentspec.memory.guard import StoreGuard
from agentspec.memory.index import ScopeIndex, load_index, save_index
from agentspec.memory.worker import KeyVectors, Worker
from agentspec.protocols import Embedder, MemoryStore
from agentspec.stores.faiss_index import FaissIndex
from agentspec.stores.sql import SQLStore
from agentspec.types import Finished, Origins, Record

# Lookups started ahead and kept until their lookup (one a concurrent call; a few spare).
_AHEAD = 64


class CompletionMemory:
    """Past completions by scope and model fingerprint, found by embedding similarity.

    Args:
        store: the source of truth (``SQLStore`` or ``InMemoryStore``).
        embedder: text to vectors; default ``MiniLMEmbedder()``, built on first use.
        index_dir: where to keep index files between runs (``<hash>-<embedder>.faiss``, the
            hash of the database's URL and the scope, plus a watermark ``.json``); ``None``
            keeps indexes in memory only.
        max_tokens_per_scope: cap on completion tokens per scope (``None``: no cap).
        max_tokens_total: cap on completion tokens in the store (``None``: no cap).
        sync_interval_s: least time between two checks for rows written by other processes.
        max_pending: completions kept while the store cannot be written (0: none kept).
        retry_interval_s: least time between two attempts on a store that failed.
        check_interval_s: least time between two checks that read a whole scope: its row
            count (rows deleted by other processes) and its token totals (the caps; checked
            earlier when this memory's own writes could reach a cap).
    """

    def __init__(self, store: MemoryStore, *, embedder: Embedder | None = None,
                 index_dir: Path | None = None, max_tokens_per_scope: int | None = 2_000_000,
                 max_tokens_total: int | None = 20_000_000, sync_interval_s: float = 0.25,
                 max_pending: int = 1000, retry_interval_s: float = 5.0,
                 check_interval_s: float = 30.0) -> None:
        for name, cap in (("max_tokens_per_scope", max_tokens_per_scope),
                          ("max_tokens_total", max_tokens_total)):
            if cap is not None and cap < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {cap}")
        for name, interval in (("sync_interval_s", sync_interval_s),
                               ("check_interval_s", check_interval_s)):
            if not interval >= 0:
                raise ValueError(f"{name} must be >= 0, got {interval}")
        self.store = store
        self._embedder = embedder
        self.index_dir = None if index_dir is None else Path(index_dir)
        self.max_tokens_per_scope = max_tokens_per_scope
        self.max_tokens_total = max_tokens_total
        self.sync_interval_s = sync_interval_s
        self.check_interval_s = check_interval_s
        self._indexes: dict[tuple[str, str], ScopeIndex] = {}
        self._caps = CapsWatch()
        self._lock = threading.RLock()
        self._owns_store = False
        self._guard = StoreGuard(max_pending=max_pending, retry_interval_s=retry_interval_s)
        # The worker thread (keys embedded ahead of their lookup, writes behind a call) and the
        # latest keys' vectors (a vector is a function of the embedder and the text).
        self.worker = Worker()
        self._vectors = KeyVectors(self.worker)
        # Lookups started ahead (:meth:`prefetch`), by their arguments, oldest first.
        self._ahead: OrderedDict[tuple[str, str, str, int, float | None],
                                 Future[list[tuple[Record, float]]]] = OrderedDict()
        self._ahead_lock = threading.Lock()

    @classmethod
    def open(cls, url: str | None = None, **kw: Any) -> CompletionMemory:
        """A memory on ``SQLStore(url)`` (``None``: the default SQLite file); ``kw`` as above.

        Raises:
            StoreError: the database cannot be opened now. Only later failures are outages
                that the memory rides out; one at the start is a setting to fix.
        """
        memory = cls(SQLStore(url), **kw)
        memory._owns_store = True
        return memory

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = MiniLMEmbedder()
        return self._embedder

    def warmup(self) -> None:
        """Do the memory's one-time work now rather than in the first lookup: load the embedder
        and the vector index library (importing faiss is slow, and the first request of a
        fresh process would otherwise pay for it)."""
        warm = getattr(self.embedder, "warmup", None)  # an embedder of the user's may have none
        if callable(warm):
            warm()
        else:
            self.embedder.embed(["warm up"])
        FaissIndex(int(self.embedder.dim))

    def close(self) -> None:
        """Write the queued completions, save the indexes (when ``index_dir`` is set) and close
        a store opened by ``open``; what cannot be written is warned about, not raised. The
        writes handed to the worker thread are done first."""
        self.worker.shutdown()  # runs what was handed over, then stops
        left = self.flush()
        if left:
            warnings.warn(f"{left} queued completion(s) could not be written to "
                          f"{self._store_id()} and are lost", MemoryFaultWarning, stacklevel=2)
        try:
            self.save()
        except (OSError, RuntimeError) as e:  # derived data: rebuilt from the store next time
            warnings.warn(f"memory index files not saved in {self.index_dir} ({e}); they are "
                          f"rebuilt from the store next time", MemoryFaultWarning, stacklevel=2)
        if self._owns_store:
            self.store.close()  # type: ignore[attr-defined]

    def __enter__(self) -> CompletionMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the public operations ---------------------------------------------------------------
    def prefetch(self, key_text: str, *, scope: str | None = None, model: str | None = None,
                 k: int = 8, min_similarity: float | None = None) -> None:
        """Start the work of a lookup that comes soon on the worker thread and return at once.

        With ``scope`` and ``model``: the whole lookup (the key's embedding, the index search,
        the rows' fetch); the next :meth:`lookup` with the same arguments takes its answer,
        waiting for it if it is not ready yet. A record of the scope written meanwhile
        discards it (the lookup then runs anew and finds that record). Without them: only the
        key's embedding, which the lookup and the record of the same text take. A caller that
        knows its key before it has other work to do (the :class:`~agentspec.Speculator`
        while a GPU prefills the prompt) hides the lookup behind that work. A failed prefetch
        costs nothing: the lookup runs again and meets the error itself."""
        if scope is None or model is None:
            self._vectors.prefetch(self.embedder, key_text)
            return
        args = (key_text, scope, model, int(k), min_similarity)
        with self._ahead_lock:
            if args in self._ahead:
                return
            self._ahead[args] = self.worker.submit(self._lookup, *args)
            while len(self._ahead) > _AHEAD:
                self._ahead.popitem(last=False)

    def finish(self, done: Finished, *, behind: bool = False) -> Future[int] | int:
        """The end of a request, in one call: credit the records its drafts came from, then
        record its completion (where ``done.remember`` and it has tokens).

        ``behind``: both on the worker thread (:meth:`credit_behind`, :meth:`record_behind`),
        returning the future of the record id at once; else written now (:meth:`credit`,
        :meth:`record`). This is where a call's writes are put behind it or not.

        Returns:
            The record id (or its future); -1 when nothing was recorded.
        """
        credit = self.credit_behind if behind else self.credit
        for record_id, accepted in done.credits:
            credit(record_id, accepted)
        row = done.record
        if not (done.remember and row.completion_ids):
            return -1
        write = self.record_behind if behind else self.record
        return write(scope=row.scope, model=row.model, request_text=row.request_text,
                     key_text=row.key_text, completion_text=row.completion_text,
                     completion_ids=row.completion_ids, origins=row.origins)

    def record_behind(self, *, scope: str, model: str, request_text: str, key_text: str,
                      completion_text: str, completion_ids: Sequence[int],
                      origins: Origins | None = None) -> Future[int]:
        """:meth:`record` on the memory's worker thread: returns at once, with the future of
        the record id. Every later read of this memory (a lookup, ``completions``, ``search``,
        ``stats``, ``records``) and every later write first waits for the writes handed over
        before it, so a call still drafts from every completion recorded before it; ``flush``
        and ``close`` wait for them too. What ``record`` would raise (never StoreError: an
        outage queues the record) is the future's exception."""
        ids = tuple(int(t) for t in completion_ids)  # the caller may reuse its list
        return self.worker.behind(self.record, scope=scope, model=model, request_text=request_text,
                            key_text=key_text, completion_text=completion_text,
                            completion_ids=ids, origins=origins)

    def credit_behind(self, record_id: int, accepted_tokens: int) -> None:
        """:meth:`credit` on the memory's worker thread, in order with the other writes handed
        over (see :meth:`record_behind`); an error other than the store's (which ``credit``
        counts and drops) is warned about."""
        done = self.worker.behind(self.credit, int(record_id), int(accepted_tokens))
        done.add_done_callback(_warn_failed_credit)

    def lookup(self, key_text: str, *, scope: str, model: str, k: int = 8,
               min_similarity: float | None = None) -> list[tuple[Record, float]]:
        """Up to ``k`` records of exactly ``scope`` and ``model``, most similar first.

        ``min_similarity``: leave out neighbours less similar than this (their rows are not
        even read from the store: a request like no other costs no SQL).

        Returns:
            ``(record, similarity)`` pairs; similarity is the inner product of unit vectors.
            Empty while the store fails (never raises StoreError).
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k == 0:
            return []
        self.worker.settle()
        with self._ahead_lock:
            ahead = self._ahead.pop((key_text, scope, model, int(k), min_similarity), None)
        # On the worker, a prefetch may be queued behind the running task: looked up here.
        found: list[tuple[Record, float]] | None = None
        if ahead is not None and (ahead.done() or not self.worker.on_worker):
            try:
                found = ahead.result()
            except Exception:  # looked up again here, where the error reaches the caller
                pass
        if found is None:
            found = self._lookup(key_text, scope, model, k, min_similarity)
        self._guard.counts.update(lookups=1, lookup_hits=int(bool(found)))  # for stats()
        return found

    def _lookup(self, key_text: str, scope: str, model: str, k: int,
                min_similarity: float | None) -> list[tuple[Record, float]]:
        query = self._vectors.get(self.embedder, key_text)
        with self._lock:
            self._flush()
            if self._guard.due("read"):
                try:
                    out = self._nearest(query, scope, model, k, min_similarity)
                except StoreError as e:
                    self._guard.failed("read", e)
                else:
                    self._guard.succeeded("read")
                    return out
            self._guard.counts["lookups_skipped"] += 1
            return []

    def _nearest(self, query: np.ndarray, scope: str, model: str, k: int,
                 min_similarity: float | None = None) -> list[tuple[Record, float]]:
        state = self._sync(scope)
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

    def completions(self, *, scope: str, model: str, after_id: int = 0) -> Iterator[Record]:
        """Records of ``scope`` and ``model`` with ``id > after_id``, in id order, for drafters:
        when the store fails the iteration ends early (never raises StoreError)."""
        self.worker.settle()
        if not self._guard.due("read"):
            return
        try:
            yield from self.store.iter(scope=scope, model=model, after_id=after_id)
        except StoreError as e:
            with self._lock:
                self._guard.failed("read", e)

    def record(self, *, scope: str, model: str, request_text: str, key_text: str,
               completion_text: str, completion_ids: Sequence[int],
               origins: Origins | None = None) -> int:
        """Remember a completion: the SQL row first (with its embedding), then the index; then
        evict least recently used rows above the caps. Its tokens' ``origins`` are only shown.

        Returns:
            The record id (an exact duplicate returns the existing id and bumps its hits), or
            ``-1`` when ``completion_ids`` is empty (an empty completion drafts nothing, so it
            is not stored) or when the store cannot be written now: the record then waits in
            a bounded queue (never raises StoreError).
        """
        if len(completion_ids) == 0:
            return -1
        self.worker.settle()
        vector = self._vectors.get(self.embedder, key_text)
        record = Record(scope=scope, model=model, request_text=request_text, key_text=key_text,
                        completion_text=completion_text,
                        completion_ids=tuple(int(t) for t in completion_ids), origins=origins,
                        embedding=vector, embedder=self.embedder.name, created_at=time.time())
        with self._lock:
            self._flush()
            if self._guard.pending or not self._guard.due("write"):  # keep the order
                self._guard.queue(record)
                return -1
            try:
                rid, _created = self.store.add(record)
            except StoreError as e:
                self._guard.failed("write", e)
                self._guard.queue(record)
                return -1
            self._guard.succeeded("write")
            self._upkeep({scope: len(record.completion_ids)})
        self._discard_ahead(scope)
        return rid

    def flush(self) -> int:
        """Try to write the queued completions now (after the writes handed to the worker
        thread); returns how many are still queued."""
        self.worker.settle()
        with self._lock:
            self._flush(force=True)
            return len(self._guard.pending)

    def _flush(self, *, force: bool = False) -> None:
        """Write the queue, oldest first, in one transaction (when writes are due)."""
        guard = self._guard
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
        self._upkeep(dict(sorted(tokens.items())))

    def _upkeep(self, tokens: dict[str, int]) -> None:
        """After writing ``tokens`` completion tokens per scope: bring the scopes' indexes up to
        date; evict above the caps when a check is due (see :class:`~agentspec.memory.caps.CapsWatch`)."""
        caps = (self.max_tokens_per_scope, self.max_tokens_total)
        try:
            for scope, n in tokens.items():
                self._sync(scope, force=True)
                if caps == (None, None) or not self._caps.due(scope, n, self.check_interval_s):
                    continue
                totals = self.store.token_total(scope), self.store.token_total(None)
                if any(cap is not None and tokens > cap for cap, tokens in zip(caps, totals, strict=True)):
                    evicted = self.store.evict_to_caps(*caps, scope=scope)
                    for state in self._indexes.values() if evicted else ():
                        state.index.remove(evicted)
                    totals = self.store.token_total(scope), self.store.token_total(None)
                self._caps.checked(scope, *caps, *totals)
        except StoreError as e:  # the row is stored: the next sync catches up
            self._guard.failed("write", e)

    def credit(self, record_id: int, accepted_tokens: int) -> None:
        """Note that a draft from ``record_id`` had ``accepted_tokens`` accepted (LRU + stats);
        dropped (and counted) while the store cannot be written."""
        self.worker.settle()
        with self._lock:
            if self._guard.due("write"):
                try:
                    self.store.touch(record_id, accepted_tokens=accepted_tokens)
                except StoreError as e:
                    self._guard.failed("write", e)
                else:
                    self._guard.succeeded("write")
                    return
            self._guard.counts["credits_dropped"] += 1

    def search(self, text: str, k: int = 5, scope: str | None = None) -> list[tuple[Record, float]]:
        """Up to ``k`` records most similar to ``text``, any model, in ``scope`` (None: all)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k == 0:
            return []
        self.worker.settle()
        query = self._vectors.get(self.embedder, text)
        scopes = [scope] if scope is not None else sorted(self.store.stats()["scopes"])
        hits: list[tuple[int, float]] = []
        with self._lock:
            for s in scopes:
                hits += self._sync(s).index.search(query, k)
        hits = sorted(hits, key=lambda h: -h[1])[:k]
        found = {r.id: r for r in self.store.get_many([i for i, _ in hits])}
        return [(found[i], s) for i, s in hits if i in found]

    def stats(self) -> dict[str, Any]:
        """The store's ``stats()`` plus ``embedder``, ``indexes`` (vectors per loaded scope),
        ``lookups`` (this process's lookups and hits), ``faults`` (:meth:`StoreGuard.stats`:
        queued, dropped and flushed completions, skipped lookups, the last errors) and
        ``store_error`` (None, or why the store's totals are missing: it cannot be read)."""
        self.worker.settle()
        try:
            out = self.store.stats()
            out["store_error"] = None
        except StoreError as e:
            out = {"store_error": str(e)}
        out["embedder"] = self.embedder.name
        with self._lock:
            out["indexes"] = {s: len(st.index) for (s, _), st in self._indexes.items()}
            out["faults"] = self._guard.stats()
            out["lookups"] = {"lookups": self._guard.counts["lookups"], "hits": self._guard.counts["lookup_hits"]}
        return out

    def records(self, scope: str | None = None, model: str | None = None) -> Iterator[Record]:
        """Every record of ``scope`` and ``model`` (None: any), in id order."""
        self.worker.settle()
        return self.store.iter(scope=scope, model=model)

    def rebuild(self, scope: str) -> int:
        """Build the index of ``scope`` afresh from the store's rows (a saved file is ignored,
        and replaced by the next ``save``); returns how many vectors it holds.

        Raises:
            StoreError: the store cannot be read.
        """
        self.worker.settle()
        with self._lock:
            state = ScopeIndex(FaissIndex(int(self.embedder.dim)))
            state.add_rows(self.store.ids_after(0, scope=scope, embedder=self.embedder.name))
            state.synced_at = time.monotonic()
            self._indexes[(scope, self.embedder.name)] = state
            return len(state.index)

    def save(self) -> None:
        """Write every loaded index to ``index_dir`` (nothing when it is None)."""
        if self.index_dir is None:
            return
        self.worker.settle()
        with self._lock:
            for (scope, _), state in self._indexes.items():
                save_index(self.index_dir, scope, self.embedder.name, self._store_id(), state)

    # --- index upkeep ------------------------------------------------------------------------
    def _sync(self, scope: str, *, force: bool = False) -> ScopeIndex:
        """The index of ``scope``, brought up to date with the store when due."""
        key = (scope, self.embedder.name)
        state = self._indexes.get(key)
        if state is None:
            state = self._indexes[key] = load_index(self.index_dir, scope, self.embedder.name,
                                                    int(self.embedder.dim), self._store_id())
            force = True
        now = time.monotonic()
        if not force and now - state.synced_at < self.sync_interval_s:
            return state
        name = self.embedder.name
        state.catch_up(self.store, scope, name, now, self.check_interval_s)
        if now - state.checked_at >= self.check_interval_s:  # reads the scope's every row id
            if self.store.count(scope=scope, embedder=name) != len(state.index):
                state.reconcile(self.store, scope, name)
            state.checked_at = now
        state.synced_at = now
        return state

    def _discard_ahead(self, scope: str) -> None:
        """Drop the lookups started ahead in ``scope``: a record written since may be missing
        from their answers."""
        with self._ahead_lock:
            for args in [a for a in self._ahead if a[1] == scope]:
                del self._ahead[args]

    def _store_id(self) -> str:
        return str(getattr(self.store, "url", type(self.store).__name__))


def _warn_failed_credit(done: Future[Any]) -> None:
    error = done.exception()
    if error is not None:
        warnings.warn(f"a credit written behind a call failed ({type(error).__name__}: {error}); "
                      f"it is dropped", MemoryFaultWarning, stacklevel=2)
