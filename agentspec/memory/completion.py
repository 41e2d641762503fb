"""CompletionMemory: past completions keyed by an embedding of the conversation, replayed as drafts.

The SQL store is the source of truth; each (scope, embedder) has a FaissIndex in this process,
derived from the store's rows and kept in step with it, also when several processes share the
store (:mod:`agentspec.memory.scopes`). A wrong or stale hit only costs speed: drafts are
verified exactly. Lookups may start ahead of their call (:mod:`agentspec.memory.ahead`) and
writes go behind it (:mod:`agentspec.memory.worker`); the writes themselves, and how they
wait out a failing store, are :mod:`agentspec.memory.writes`.

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
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from agentspec.errors import MemoryFaultWarning, StoreError
from agentspec.memory.ahead import LookupsAhead
from agentspec.memory.embedder import MiniLMEmbedder
from agentspec.memory.guard import StoreGuard
from agentspec.memory.index import ScopeIndex
from agentspec.memory.scopes import ScopeIndexes
from agentspec.memory.worker import KeyVectors, Worker
from agentspec.memory.writes import Writes
from agentspec.protocols import Embedder, MemoryStore
from agentspec.stores.faiss_index import FaissIndex
from agentspec.stores.sql import SQLStore
from agentspec.types import Finished, Origins, Record


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
        # The indexes per (scope, embedder), and the caps' checks (read this memory's settings).
        self._scopes = ScopeIndexes(store, self.index_dir, settings=self)
        self._lock = threading.RLock()
        self._owns_store = False
        self._guard = StoreGuard(max_pending=max_pending, retry_interval_s=retry_interval_s)
        self._writes = Writes(store, self._guard, self._scopes)
        # The worker thread (keys embedded ahead of their lookup, writes behind a call) and the
        # latest keys' vectors (a vector is a function of the embedder and the text).
        self.worker = Worker()
        self._vectors = KeyVectors(self.worker)
        self._ahead = LookupsAhead()  # lookups started ahead (:meth:`prefetch`)

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
    def _indexes(self) -> dict[tuple[str, str], ScopeIndex]:
        """The loaded indexes, by ``(scope, embedder name)``."""
        return self._scopes.by_key

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
        self._ahead.start(args, lambda: self.worker.submit(self._lookup, *args))

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
        ahead = self._ahead.take((key_text, scope, model, int(k), min_similarity))
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
            self._writes.flush()
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
        return self._scopes.nearest(query, scope, model, k, min_similarity)

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
            rid = self._writes.add(record)
        if rid != -1:
            self._discard_ahead(scope)
        return rid

    def flush(self) -> int:
        """Try to write the queued completions now (after the writes handed to the worker
        thread); returns how many are still queued."""
        self.worker.settle()
        with self._lock:
            self._writes.flush(force=True)
            return len(self._guard.pending)

    def credit(self, record_id: int, accepted_tokens: int) -> None:
        """Note that a draft from ``record_id`` had ``accepted_tokens`` accepted (LRU + stats);
        dropped (and counted) while the store cannot be written."""
        self.worker.settle()
        with self._lock:
            self._writes.credit(record_id, accepted_tokens)

    def search(self, text: str, k: int = 5, scope: str | None = None) -> list[tuple[Record, float]]:
        """Up to ``k`` records most similar to ``text``, any model, in ``scope`` (None: all)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k == 0:
            return []
        self.worker.settle()
        query = self._vectors.get(self.embedder, text)
        scopes = [scope] if scope is not None else sorted(self.store.stats()["scopes"])
        with self._lock:
            hits = self._scopes.search(query, scopes, k)
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
            out["indexes"] = self._scopes.sizes()
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
            return self._scopes.rebuild(scope)

    def save(self) -> None:
        """Write every loaded index to ``index_dir`` (nothing when it is None)."""
        if self.index_dir is None:
            return
        self.worker.settle()
        with self._lock:
            self._scopes.save()

    def _discard_ahead(self, scope: str) -> None:
        """Drop the lookups started ahead in ``scope``: a record written since may be missing
        from their answers."""
        self._ahead.discard(scope)

    def _store_id(self) -> str:
        return self._scopes.store_id


def _warn_failed_credit(done: Future[Any]) -> None:
    error = done.exception()
    if error is not None:
        warnings.warn(f"a credit written behind a call failed ({type(error).__name__}: {error}); "
                      f"it is dropped", MemoryFaultWarning, stacklevel=2)
