"""CompletionMemory: past completions keyed by an embedding of the conversation, replayed as drafts.

The SQL store is the source of truth; each (scope, embedder) has a FaissIndex in this process,
derived from the store's rows. Several processes may share one store: before a lookup the
index picks up rows that others added (by id watermark, at most every ``sync_interval_s``),
and when the store's row count for the scope disagrees with the index size it reconciles the
two id sets, dropping ids that were deleted (evicted or pruned elsewhere) and adding missed
ones. A wrong or stale hit only costs speed: drafts are verified exactly.

Importing this module does not import torch; the default embedder loads it on first use.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from agentspec.embedder import MiniLMEmbedder, truncate_middle
from agentspec.errors import StoreError
from agentspec.protocols import Embedder, RecordStore
from agentspec.stores.faiss_index import FaissIndex
from agentspec.stores.sql import SQLStore
from agentspec.types import Record


class MemoryStore(RecordStore, Protocol):
    """A RecordStore with the queries the memory needs (SQLStore and InMemoryStore have them)."""

    def count(self, *, scope: str | None = None, model: str | None = None,
              embedder: str | None = None) -> int: ...

    def ids(self, *, scope: str | None = None, embedder: str | None = None) -> np.ndarray: ...

    def ids_after(self, after_id: int, *, scope: str | None = None, model: str | None = None,
                  embedder: str | None = None) -> list[tuple[int, np.ndarray]]: ...

    def evict_to_caps(self, max_tokens_per_scope: int | None, max_tokens_total: int | None,
                      *, scope: str | None = None) -> list[int]: ...

    def stats(self) -> dict[str, Any]: ...


@dataclass
class _ScopeIndex:
    """The in-process index of one (scope, embedder): mutable, owned by the memory."""

    index: FaissIndex
    watermark: int = 0  # every store id <= watermark has been seen
    synced_at: float = float("-inf")  # time.monotonic() of the last sync


class CompletionMemory:
    """Past completions by scope and model fingerprint, found by embedding similarity.

    Args:
        store: the source of truth (``SQLStore`` or ``InMemoryStore``).
        embedder: text to vectors; default ``MiniLMEmbedder()``, built on first use.
        index_dir: where to keep index files between runs (``<scope-hash>-<embedder>.faiss``
            plus a watermark ``.json``); ``None`` keeps indexes in memory only.
        max_tokens_per_scope: cap on completion tokens per scope (``None``: no cap).
        max_tokens_total: cap on completion tokens in the store (``None``: no cap).
        sync_interval_s: least time between two checks for rows written by other processes.
    """

    def __init__(self, store: MemoryStore, *, embedder: Embedder | None = None,
                 index_dir: Path | None = None, max_tokens_per_scope: int | None = 2_000_000,
                 max_tokens_total: int | None = 20_000_000, sync_interval_s: float = 0.25) -> None:
        for name, cap in (("max_tokens_per_scope", max_tokens_per_scope),
                          ("max_tokens_total", max_tokens_total)):
            if cap is not None and cap < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {cap}")
        if sync_interval_s < 0:
            raise ValueError(f"sync_interval_s must be >= 0, got {sync_interval_s}")
        self.store = store
        self._embedder = embedder
        self.index_dir = None if index_dir is None else Path(index_dir)
        self.max_tokens_per_scope = max_tokens_per_scope
        self.max_tokens_total = max_tokens_total
        self.sync_interval_s = sync_interval_s
        self._indexes: dict[tuple[str, str], _ScopeIndex] = {}
        self._lock = threading.RLock()
        self._owns_store = False

    @classmethod
    def open(cls, url: str | None = None, **kw: Any) -> CompletionMemory:
        """A memory on ``SQLStore(url)`` (``None``: the default SQLite file); ``kw`` as above."""
        memory = cls(SQLStore(url), **kw)
        memory._owns_store = True
        return memory

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = MiniLMEmbedder()
        return self._embedder

    def close(self) -> None:
        """Save the indexes (when ``index_dir`` is set) and close a store opened by ``open``."""
        self.save()
        if self._owns_store:
            self.store.close()  # type: ignore[attr-defined]

    def __enter__(self) -> CompletionMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the public operations ---------------------------------------------------------------
    def lookup(self, key_text: str, *, scope: str, model: str, k: int = 8) -> list[tuple[Record, float]]:
        """Up to ``k`` records of exactly ``scope`` and ``model``, most similar first.

        Returns:
            ``(record, similarity)`` pairs; similarity is the inner product of unit vectors.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k == 0:
            return []
        query = self._embed(key_text)
        with self._lock:
            state = self._sync(scope)
            size = len(state.index)
            fetch = min(size, 2 * k)  # over-fetch a little: other models may share the scope
            while True:
                hits = state.index.search(query, fetch)
                found = {r.id: r for r in self.store.get_many([i for i, _ in hits])}
                out = [(found[i], s) for i, s in hits if i in found and found[i].model == model]
                if len(out) >= k or fetch >= size:  # other models crowd the top: look deeper
                    return out[:k]
                fetch = min(size, fetch * 4)

    def record(self, *, scope: str, model: str, request_text: str, key_text: str,
               completion_text: str, completion_ids: Sequence[int]) -> int:
        """Remember a completion: the SQL row first (with its embedding), then the index; then
        evict least recently used rows above the caps.

        Returns:
            The record id (an exact duplicate returns the existing id and bumps its hits), or
            ``-1`` when ``completion_ids`` is empty: an empty completion drafts nothing, so it
            is not stored.
        """
        if len(completion_ids) == 0:
            return -1
        vector = self._embed(key_text)
        record = Record(scope=scope, model=model, request_text=request_text, key_text=key_text,
                        completion_text=completion_text,
                        completion_ids=tuple(int(t) for t in completion_ids),
                        embedding=vector, embedder=self.embedder.name)
        rid, _created = self.store.add(record)
        with self._lock:
            self._sync(scope, force=True)
            evicted = self.store.evict_to_caps(self.max_tokens_per_scope, self.max_tokens_total,
                                               scope=scope)
            if evicted:
                for state in self._indexes.values():
                    state.index.remove(evicted)
        return rid

    def credit(self, record_id: int, accepted_tokens: int) -> None:
        """Note that a draft from ``record_id`` had ``accepted_tokens`` accepted (LRU + stats)."""
        self.store.touch(record_id, accepted_tokens=accepted_tokens)

    def search(self, text: str, k: int = 5, scope: str | None = None) -> list[tuple[Record, float]]:
        """Up to ``k`` records most similar to ``text``, any model, in ``scope`` (None: all)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k == 0:
            return []
        query = self._embed(text)
        scopes = [scope] if scope is not None else sorted(self.store.stats()["scopes"])
        hits: list[tuple[int, float]] = []
        with self._lock:
            for s in scopes:
                hits += self._sync(s).index.search(query, k)
        hits = sorted(hits, key=lambda h: -h[1])[:k]
        found = {r.id: r for r in self.store.get_many([i for i, _ in hits])}
        return [(found[i], s) for i, s in hits if i in found]

    def stats(self) -> dict[str, Any]:
        """The store's ``stats()`` plus ``embedder`` and ``indexes`` (vectors per loaded scope)."""
        out = self.store.stats()
        out["embedder"] = self.embedder.name
        with self._lock:
            out["indexes"] = {s: len(st.index) for (s, _), st in self._indexes.items()}
        return out

    def records(self, scope: str | None = None, model: str | None = None) -> Iterator[Record]:
        """Every record of ``scope`` and ``model`` (None: any), in id order."""
        return self.store.iter(scope=scope, model=model)

    def rebuild(self, scope: str) -> int:
        """Build the index of ``scope`` afresh from the store's rows (a saved file is ignored,
        and replaced by the next ``save``); returns how many vectors it holds.

        Raises:
            StoreError: the store cannot be read.
        """
        with self._lock:
            state = _ScopeIndex(FaissIndex(int(self.embedder.dim)))
            self._add_rows(state, self.store.ids_after(0, scope=scope, embedder=self.embedder.name))
            state.synced_at = time.monotonic()
            self._indexes[(scope, self.embedder.name)] = state
            return len(state.index)

    def save(self) -> None:
        """Write every loaded index to ``index_dir`` (nothing when it is None)."""
        if self.index_dir is None:
            return
        with self._lock:
            for (scope, _), state in self._indexes.items():
                self._save(scope, state)

    # --- index upkeep ------------------------------------------------------------------------
    def _embed(self, text: str) -> np.ndarray:
        vectors = self.embedder.embed([text])  # [1, dim]
        return np.ascontiguousarray(vectors[0], np.float32)

    def _sync(self, scope: str, *, force: bool = False) -> _ScopeIndex:
        """The index of ``scope``, brought up to date with the store when due."""
        key = (scope, self.embedder.name)
        state = self._indexes.get(key)
        if state is None:
            state = self._indexes[key] = self._load(scope)
            force = True
        now = time.monotonic()
        if not force and now - state.synced_at < self.sync_interval_s:
            return state
        name = self.embedder.name
        rows = self.store.ids_after(state.watermark, scope=scope, embedder=name)
        if rows:
            self._add_rows(state, rows)
        if self.store.count(scope=scope, embedder=name) != len(state.index):
            self._reconcile(scope, state)
        state.synced_at = now
        return state

    def _add_rows(self, state: _ScopeIndex, rows: Iterable[tuple[int, np.ndarray]]) -> None:
        dim = state.index.dim
        rows = [(i, v) for i, v in rows if v.shape == (dim,)]
        if rows:
            ids = [i for i, _ in rows]
            state.index.add(ids, np.stack([v for _, v in rows]))  # [n, dim]
            state.watermark = max(state.watermark, max(ids))

    def _reconcile(self, scope: str, state: _ScopeIndex) -> None:
        """Make the index hold exactly the store's embedded ids of ``scope``."""
        in_store = self.store.ids(scope=scope, embedder=self.embedder.name)
        in_index = state.index.ids()
        state.index.remove(np.setdiff1d(in_index, in_store).tolist())
        missing = np.setdiff1d(in_store, in_index).tolist()
        if missing:
            rows = [(r.id, r.embedding) for r in self.store.get_many(missing)
                    if r.embedding is not None]
            self._add_rows(state, rows)  # type: ignore[arg-type]

    def _paths(self, scope: str) -> tuple[Path, Path]:
        assert self.index_dir is not None
        digest = hashlib.sha256(scope.encode("utf-8")).hexdigest()[:16]
        stem = f"{digest}-{re.sub(r'[^A-Za-z0-9._-]', '_', self.embedder.name)}"
        return self.index_dir / f"{stem}.faiss", self.index_dir / f"{stem}.json"

    def _store_id(self) -> str:
        return str(getattr(self.store, "url", type(self.store).__name__))

    def _load(self, scope: str) -> _ScopeIndex:
        """The saved index of ``scope`` when there is a sound one, else an empty index."""
        dim = int(self.embedder.dim)
        if self.index_dir is None:
            return _ScopeIndex(FaissIndex(dim))
        index_path, meta_path = self._paths(scope)
        if not index_path.exists():
            return _ScopeIndex(FaissIndex(dim))
        try:
            meta: Mapping[str, Any] = json.loads(meta_path.read_text())
            index = FaissIndex.load(index_path)
            expected = (scope, self.embedder.name, dim, self._store_id())
            found = (meta["scope"], meta["embedder"], index.dim, meta["store"])
            if found != expected:
                raise StoreError(f"{index_path} was built for {found}, not {expected}")
            return _ScopeIndex(index, watermark=int(meta["watermark"]))
        except (StoreError, OSError, ValueError, KeyError, TypeError) as e:
            warnings.warn(f"memory index {index_path} is unusable ({e}); rebuilding it from "
                          f"the store", RuntimeWarning, stacklevel=4)
            return _ScopeIndex(FaissIndex(dim))

    def _save(self, scope: str, state: _ScopeIndex) -> None:
        assert self.index_dir is not None
        self.index_dir.mkdir(parents=True, exist_ok=True)
        index_path, meta_path = self._paths(scope)
        state.index.save(index_path)
        meta = {"scope": scope, "embedder": self.embedder.name, "store": self._store_id(),
                "watermark": state.watermark}
        tmp = meta_path.with_name(f".{meta_path.name}.tmp")
        tmp.write_text(json.dumps(meta))
        tmp.replace(meta_path)


def _render(message: Mapping[str, Any], i: int) -> str:
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"messages[{i}] must be a dict with a 'role', got {message!r:.80}")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI-style parts: keep the text ones
        content = "\n".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p)
                            for p in content)
    text = f"{message['role']}: {'' if content is None else content}"
    if message.get("tool_calls"):
        text += "\n" + json.dumps(message["tool_calls"], sort_keys=True, default=str)
    return text


def conversation_key(messages_or_prompt: str | Sequence[Mapping[str, Any]], *,
                     max_chars: int = 2000) -> str:
    """The text a request is remembered under: the whole conversation, not its last message.

    Each message becomes ``"role: content"`` (plus its tool calls), one per line, so the system
    prompt with its tool docs and every turn count: "how old is he?" asked after two different
    questions gives two different keys. A str prompt is used as is. Longer than ``max_chars``,
    the middle is cut: the head (system prompt, tool docs) and the tail (latest turns) stay.

    Args:
        messages_or_prompt: ``[{"role": ..., "content": ...}, ...]`` or a prompt string.
        max_chars: longest key returned.
    """
    if isinstance(messages_or_prompt, str):
        text = messages_or_prompt
    elif isinstance(messages_or_prompt, Sequence):
        messages: Sequence[Any] = messages_or_prompt
        text = "\n".join(_render(m, i) for i, m in enumerate(messages))
    else:
        raise TypeError(f"expected messages or a str prompt, got {type(messages_or_prompt).__name__}")
    return truncate_middle(text, max_chars)
