"""The executable reference: an in-process RecordStore and a numpy VectorIndex.

``InMemoryStore`` defines what every store must do (the contract suite runs the SQL store
against the same tests); ``BruteForceIndex`` does the same for vector indexes. Both are exact
and small enough to read in one sitting. The helpers at the top (content hashing, argument
checks, the stats layout) are shared with ``agentspec.stores.sql`` so that both stores agree.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from agentspec.types import Record

SORTS = ("recent", "hits", "size", "accepted")


def content_hash(record: Record, *, model: str | None = None) -> str:
    """sha256 hex of scope, model (``model`` when given), key text and completion text,
    NUL-separated.

    Two records with the same hash are exact duplicates: the store keeps one and bumps its hits.
    """
    h = hashlib.sha256()
    for part in (record.scope, record.model if model is None else model, record.key_text,
                 record.completion_text):
        h.update(part.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def check_relabel(old: str, new: str) -> None:
    """Refuse a relabelling that names no model, or the same one twice."""
    if not old or not new or old == new:
        raise ValueError(f"relabel needs two different model fingerprints, got {old!r} and {new!r}")


def check_record(record: Record) -> None:
    """Raise ValueError when ``record`` cannot be stored (names the offending value)."""
    if not isinstance(record, Record):
        raise TypeError(f"expected a Record, got {type(record).__name__}")
    if not record.scope:
        raise ValueError(f"scope must be a non-empty string, got {record.scope!r}")
    if record.completion_ids:
        try:
            ids = np.asarray(record.completion_ids, np.int64)
        except OverflowError as e:
            raise ValueError(f"completion_ids must fit in int32, got {record.completion_ids!r:.80}") from e
        bad = ids[(ids < -(2**31)) | (ids >= 2**31)]
        if bad.size:
            raise ValueError(f"completion_ids must fit in int32, got {int(bad[0])}")
    if record.embedding is not None and np.asarray(record.embedding).ndim != 1:
        raise ValueError(f"embedding must be 1-D [dim], got shape {np.shape(record.embedding)}")
    for name in ("hits", "accepted_tokens"):
        if getattr(record, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(record, name)}")
    if record.origins is not None and len(record.origins.sources) != len(record.completion_ids):
        raise ValueError(f"origins name {len(record.origins.sources)} tokens for "
                         f"{len(record.completion_ids)} completion ids; give one per token or none")


def check_nonneg(name: str, value: float | None) -> None:
    """ValueError naming ``name`` when ``value`` is negative (``None`` means no limit)."""
    if value is not None and value < 0:
        raise ValueError(f"{name} must be >= 0 or None, got {value}")


def check_sort(sort: str) -> None:
    if sort not in SORTS:
        raise ValueError(f"sort must be one of {SORTS}, got {sort!r}")


def record_bytes(r: Record) -> int:
    """Payload size of one row: UTF-8 bytes of the three texts plus the two blobs."""
    emb = 0 if r.embedding is None else 4 * int(np.asarray(r.embedding).size)
    texts = (r.request_text, r.key_text, r.completion_text)
    return sum(len(t.encode("utf-8")) for t in texts) + 4 * r.num_tokens + emb


def empty_stats() -> dict[str, Any]:
    """The layout of ``stats()``: totals, then the same totals per scope and per model."""
    return {"rows": 0, "tokens": 0, "bytes": 0, "hits": 0, "accepted_tokens": 0,
            "scopes": {}, "models": {}}


def _bump(bucket: dict[str, Any], rows: int, tokens: int, nbytes: int, hits: int, acc: int) -> None:
    for key, v in (("rows", rows), ("tokens", tokens), ("bytes", nbytes), ("hits", hits),
                   ("accepted_tokens", acc)):
        bucket[key] = bucket.get(key, 0) + int(v)


def add_stats_row(stats: dict[str, Any], scope: str, model: str, *values: int) -> None:
    """Fold one row (or one group) of ``rows, tokens, bytes, hits, accepted`` into ``stats``."""
    _bump(stats, *values)
    _bump(stats["scopes"].setdefault(scope, {}), *values)
    _bump(stats["models"].setdefault(model, {}), *values)


def lru_victims(rows: Iterable[tuple[int, int]], excess: int) -> tuple[list[int], int]:
    """Ids to delete, oldest first, until at least ``excess`` tokens are freed.

    Args:
        rows: ``(id, num_tokens)`` ordered least recently used first.
        excess: tokens over the cap.

    Returns:
        The ids, and how many tokens they free.
    """
    victims: list[int] = []
    freed = 0
    for rid, n in rows:
        if freed >= excess:
            break
        victims.append(int(rid))
        freed += int(n)
    return victims, freed


class InMemoryStore:
    """A RecordStore held in a dict: the reference semantics of the SQL store.

    Not shared between processes and lost on exit; meant for tests and throwaway sessions.
    """

    def __init__(self) -> None:
        self._rows: dict[int, Record] = {}
        self._by_hash: dict[str, int] = {}
        self._next_id = 1

    # --- RecordStore -------------------------------------------------------------------------
    def add(self, record: Record) -> tuple[int, bool]:
        """Insert ``record`` (its ``id`` is ignored); an exact duplicate bumps hits instead."""
        check_record(record)
        h = content_hash(record)
        now = time.time()
        if h in self._by_hash:
            rid = self._by_hash[h]
            old = self._rows[rid]
            self._rows[rid] = replace(old, hits=old.hits + 1, last_used_at=now)
            return rid, False
        rid, self._next_id = self._next_id, self._next_id + 1
        emb = None if record.embedding is None else np.asarray(record.embedding, np.float32).copy()
        created = record.created_at or now
        self._rows[rid] = replace(
            record, id=rid, embedding=emb, completion_ids=tuple(int(t) for t in record.completion_ids),
            created_at=created, last_used_at=record.last_used_at or created)
        self._by_hash[h] = rid
        return rid, True

    def add_many(self, records: Iterable[Record]) -> int:
        """Insert many records; duplicates are skipped (hits unchanged). Returns how many were
        inserted. All are checked before any is inserted."""
        batch = list(records)
        for r in batch:
            check_record(r)
        return sum(self.add(r)[1] for r in batch if content_hash(r) not in self._by_hash)

    def get(self, record_id: int) -> Record | None:
        return self._rows.get(int(record_id))

    def get_many(self, ids: Sequence[int]) -> list[Record]:
        """Records for ``ids`` in the order given; unknown ids are skipped."""
        return [self._rows[int(i)] for i in ids if int(i) in self._rows]

    def iter(self, *, scope: str | None = None, model: str | None = None,
             after_id: int = 0) -> Iterator[Record]:
        """Records with ``id > after_id`` in id order, optionally of one scope and/or model."""
        for rid in sorted(self._rows):
            r = self._rows.get(rid)
            if r is None or rid <= after_id:
                continue
            if (scope is None or r.scope == scope) and (model is None or r.model == model):
                yield r

    def delete(self, ids: Iterable[int]) -> int:
        n = 0
        for i in set(int(i) for i in ids):
            r = self._rows.pop(i, None)
            if r is not None:
                del self._by_hash[content_hash(r)]
                n += 1
        return n

    def touch(self, record_id: int, *, accepted_tokens: int = 0) -> None:
        """Bump hits, add ``accepted_tokens``, set last use to now; unknown ids are ignored."""
        check_nonneg("accepted_tokens", accepted_tokens)
        r = self._rows.get(int(record_id))
        if r is not None:
            self._rows[r.id] = replace(r, hits=r.hits + 1, last_used_at=time.time(),  # type: ignore[index]
                                       accepted_tokens=r.accepted_tokens + int(accepted_tokens))

    def max_id(self) -> int:
        return max(self._rows, default=0)

    def __len__(self) -> int:
        return len(self._rows)

    # --- what the memory and the CLI need ---------------------------------------------------
    def _select(self, scope: str | None, model: str | None = None,
                embedder: str | None = None) -> list[Record]:
        return [r for r in self._rows.values()
                if (scope is None or r.scope == scope) and (model is None or r.model == model)
                and (embedder is None or (r.embedder == embedder and r.embedding is not None))]

    def count(self, *, scope: str | None = None, model: str | None = None,
              embedder: str | None = None) -> int:
        """Rows matching; with ``embedder``, only rows embedded by it."""
        return len(self._select(scope, model, embedder))

    def ids(self, *, scope: str | None = None, embedder: str | None = None) -> np.ndarray:
        """Sorted int64 ids matching (with ``embedder``: only rows embedded by it)."""
        return np.array(sorted(r.id for r in self._select(scope, None, embedder)), np.int64)  # type: ignore[type-var]

    def ids_after(self, after_id: int, *, scope: str | None = None, model: str | None = None,
                  embedder: str | None = None,
                  among: Sequence[int] | None = None) -> list[tuple[int, np.ndarray]]:
        """``(id, embedding)`` of embedded rows with ``id > after_id`` (and, given ``among``,
        an id in it), in id order."""
        keep = None if among is None else {int(i) for i in among}
        rows = [r for r in self._select(scope, model, embedder)
                if r.embedding is not None and r.id > after_id  # type: ignore[operator]
                and (keep is None or r.id in keep)]
        return [(r.id, r.embedding) for r in sorted(rows, key=lambda r: r.id or 0)]  # type: ignore[misc]

    def ids_since(self, after_id: int) -> np.ndarray:
        """Every id above ``after_id``, any scope, sorted (int64)."""
        return np.array(sorted(i for i in self._rows if i > after_id), np.int64)

    def token_total(self, scope: str | None = None) -> int:
        return sum(r.num_tokens for r in self._select(scope))

    def stats(self) -> dict[str, Any]:
        out = empty_stats()
        for r in self._rows.values():
            add_stats_row(out, r.scope, r.model, 1, r.num_tokens, record_bytes(r), r.hits,
                          r.accepted_tokens)
        return out

    def list_records(self, scope: str | None = None, model: str | None = None,
                     sort: str = "recent", limit: int = 20) -> list[Record]:
        """Up to ``limit`` records, best first by ``sort`` (ties: newest id first)."""
        check_sort(sort)
        check_nonneg("limit", limit)
        key = {"recent": lambda r: r.last_used_at, "hits": lambda r: r.hits,
               "size": lambda r: r.num_tokens, "accepted": lambda r: r.accepted_tokens}[sort]
        rows = sorted(self._select(scope, model), key=lambda r: (key(r), r.id), reverse=True)
        return rows[: int(limit)]

    def drop_scope(self, scope: str) -> int:
        return self.delete([r.id for r in self._select(scope)])  # type: ignore[misc]

    def relabel_model(self, old: str, new: str) -> tuple[int, int]:
        """Give every record of model ``old`` the model ``new``; see :meth:`SQLStore.relabel_model`."""
        check_relabel(old, new)
        moved = merged = 0
        for r in [r for r in self._rows.values() if r.model == old]:
            h = content_hash(r, model=new)
            twin = self._by_hash.get(h)
            del self._by_hash[content_hash(r)]
            if twin is None:
                self._rows[r.id] = replace(r, model=new)  # type: ignore[index]
                self._by_hash[h] = r.id  # type: ignore[assignment]
                moved += 1
            else:
                t = self._rows[twin]
                self._rows[twin] = replace(t, hits=t.hits + r.hits,
                                           accepted_tokens=t.accepted_tokens + r.accepted_tokens,
                                           last_used_at=max(t.last_used_at, r.last_used_at))
                del self._rows[r.id]  # type: ignore[arg-type]
                merged += 1
        return moved, merged

    def _lru(self, scope: str | None) -> list[tuple[int, int]]:
        rows = sorted(self._select(scope), key=lambda r: (r.last_used_at, r.id))
        return [(r.id, r.num_tokens) for r in rows]  # type: ignore[misc]

    def prune(self, older_than_s: float | None, scope: str | None = None,
              max_tokens: int | None = None, dry_run: bool = False) -> list[int]:
        """Delete rows unused for ``older_than_s`` seconds, then LRU rows above ``max_tokens``.

        Returns the deleted ids (the ids that would be deleted when ``dry_run``).
        """
        check_nonneg("older_than_s", older_than_s)
        check_nonneg("max_tokens", max_tokens)
        cutoff = None if older_than_s is None else time.time() - older_than_s
        lru = self._lru(scope)
        old = [rid for rid, _ in lru if cutoff is not None and self._rows[rid].last_used_at < cutoff]
        victims = list(old)
        if max_tokens is not None:
            gone = set(old)
            rest = [(rid, n) for rid, n in lru if rid not in gone]
            victims += lru_victims(rest, sum(n for _, n in rest) - max_tokens)[0]
        if not dry_run:
            self.delete(victims)
        return victims

    def evict_to_caps(self, max_tokens_per_scope: int | None, max_tokens_total: int | None,
                      *, scope: str | None = None) -> list[int]:
        """Delete least recently used rows until every scope (or only ``scope``) holds at most
        ``max_tokens_per_scope`` tokens and the store at most ``max_tokens_total``."""
        check_nonneg("max_tokens_per_scope", max_tokens_per_scope)
        check_nonneg("max_tokens_total", max_tokens_total)
        victims: list[int] = []
        if max_tokens_per_scope is not None:
            scopes = {r.scope for r in self._rows.values()} if scope is None else {scope}
            for s in sorted(scopes):
                victims += self.prune(None, s, max_tokens_per_scope)
        if max_tokens_total is not None:
            victims += self.prune(None, None, max_tokens_total)
        return victims


class BruteForceIndex:
    """Exact inner-product search in numpy: the VectorIndex reference.

    Adding an id that is already present replaces its vector.
    """

    def __init__(self, dim: int) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be > 0, got {dim}")
        self.dim = int(dim)
        self._ids = np.zeros(0, np.int64)
        self._vectors = np.zeros((0, self.dim), np.float32)  # [num_vectors, dim]

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        ids_arr, vecs = check_vectors(ids, vectors, self.dim)
        self.remove(ids_arr.tolist())
        self._ids = np.concatenate([self._ids, ids_arr])
        self._vectors = np.concatenate([self._vectors, vecs])

    def search(self, vector: np.ndarray, k: int) -> list[tuple[int, float]]:
        """Up to ``k`` ``(id, inner product)`` pairs, best first."""
        q = check_query(vector, k, self.dim)
        if k == 0 or not len(self._ids):
            return []
        scores = self._vectors @ q  # [num_vectors]
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(self._ids[i]), float(scores[i])) for i in top]

    def remove(self, ids: Iterable[int]) -> int:
        drop = np.isin(self._ids, np.fromiter((int(i) for i in ids), np.int64))
        self._ids, self._vectors = self._ids[~drop], self._vectors[~drop]
        return int(drop.sum())

    def ids(self) -> np.ndarray:
        return np.sort(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def check_vectors(ids: Sequence[int], vectors: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate an ``add`` call; returns int64 ids and contiguous float32 ``[n, dim]``."""
    ids_arr = np.asarray(ids, np.int64).reshape(-1)
    vecs = np.ascontiguousarray(vectors, np.float32)
    if vecs.ndim != 2 or vecs.shape[1] != dim:
        raise ValueError(f"vectors must be [n, {dim}], got shape {vecs.shape}")
    if len(ids_arr) != len(vecs):
        raise ValueError(f"{len(ids_arr)} ids for {len(vecs)} vectors")
    if len(np.unique(ids_arr)) != len(ids_arr):
        raise ValueError(f"ids must be distinct, got {ids_arr.tolist()[:10]}...")
    return ids_arr, vecs


def check_query(vector: np.ndarray, k: int, dim: int) -> np.ndarray:
    """Validate a ``search`` call; returns the query as contiguous float32 ``[dim]``."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    q = np.ascontiguousarray(vector, np.float32).reshape(-1)
    if q.shape != (dim,):
        raise ValueError(f"query must have {dim} values, got shape {np.shape(vector)}")
    return q
