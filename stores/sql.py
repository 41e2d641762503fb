"""SQLStore: the completion memory's source of truth, on SQLAlchemy 2 (SQLite or PostgreSQL).

SQLite is the default (a file under ``AGENTSPEC_HOME``); PostgreSQL is reached through psycopg 3
(``postgresql+psycopg://user:pass@host/db``); engines and error mapping live in
:mod:`agentspec.stores.sql_engine`, the tables in :mod:`agentspec.stores.sql_schema`, and the
bulk deletes and rewrites (prune, evict to the caps, relabel a model) in
:mod:`agentspec.stores.sql_upkeep`. The unique ``content_hash`` column makes ``add`` race-safe
across processes. Every database failure is raised as ``StoreError``. No torch or transformers
here: the CLI stays fast.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from sqlalchemy import Connection, bindparam, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from agentspec.errors import StoreError
from agentspec.home import default_db_url
from agentspec.stores import sql_upkeep
from agentspec.stores.memory_store import (
    add_stats_row,
    check_nonneg,
    check_record,
    check_relabel,
    check_sort,
    content_hash,
    empty_stats,
)
from agentspec.stores.sql_engine import dialect_insert, make_engine, mask_url, store_errors
from agentspec.stores.sql_schema import (
    CHUNK,
    SCHEMA_VERSION,
    filters,
    prepare,
    read_version,
    records,
    row_values,
    to_record,
)
from agentspec.types import Record

_PG_LOCK = 0x4167_5370  # advisory lock serialising schema setup on PostgreSQL
_SORT_COLUMNS = {"recent": records.c.last_used_at, "hits": records.c.hits,
                 "size": records.c.num_tokens, "accepted": records.c.accepted_tokens}


class SQLStore:
    """A RecordStore on SQLite or PostgreSQL, plus the queries the memory and the CLI need.

    Args:
        url: a SQLAlchemy URL; ``None`` means ``agentspec.home.default_db_url()`` (a SQLite
            file whose folder is created).
        busy_timeout_s: SQLite only: how long a write waits for another process's lock.

    Raises:
        StoreError: the database cannot be opened or reached (names the URL, password masked),
            or its schema is newer than this agentspec. A read-only database opens when its
            schema is current (writes then raise StoreError).
    """

    def __init__(self, url: str | None = None, *, busy_timeout_s: float = 30.0) -> None:
        if not busy_timeout_s >= 0:
            raise ValueError(f"busy_timeout_s must be >= 0, got {busy_timeout_s}")
        self._url = default_db_url() if url is None else url
        self.url = mask_url(self._url)
        try:
            self._engine = make_engine(self._url, busy_timeout_s=busy_timeout_s)
            with self._read("open") as conn:
                current = read_version(conn) == SCHEMA_VERSION
            if not current:  # new or older: set up under the write lock (re-read there)
                with self._write("open") as conn:
                    if self._engine.dialect.name == "postgresql":
                        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK})")
                    prepare(conn, self.url)
        except (SQLAlchemyError, OSError, ImportError, ValueError) as e:
            raise StoreError(f"cannot open the memory database {self.url}: {e}") from e

    def __repr__(self) -> str:
        return f"SQLStore({self.url!r})"

    def close(self) -> None:
        """Release pooled connections."""
        self._engine.dispose()

    def __enter__(self) -> SQLStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _read(self, action: str = "read") -> Iterator[Connection]:
        with store_errors(action, self.url), self._engine.connect() as conn, conn.begin():
            yield conn

    @contextmanager
    def _write(self, action: str = "write") -> Iterator[Connection]:
        with store_errors(action, self.url), self._engine.connect() as conn:
            conn.execution_options(agentspec_write=True)
            with conn.begin():
                yield conn

    def schema_version(self) -> int:
        with self._read() as conn:
            version = read_version(conn)
        return SCHEMA_VERSION if version is None else version

    # --- RecordStore -------------------------------------------------------------------------
    def add(self, record: Record) -> tuple[int, bool]:
        """Insert ``record`` (its ``id`` is ignored); an exact duplicate (same scope, model, key
        and completion) bumps ``hits`` and ``last_used_at`` instead. Returns ``(id, created)``."""
        check_record(record)
        now = time.time()
        values = row_values(record, now)
        for _ in range(5):  # a duplicate may be deleted between our insert and our update
            try:
                with self._write() as conn:
                    stmt = insert(records).values(**values).returning(records.c.id)
                    return int(conn.execute(stmt).scalar_one()), True
            except IntegrityError:
                pass
            with self._write() as conn:
                bump = (update(records).where(records.c.content_hash == values["content_hash"])
                        .values(hits=records.c.hits + 1, last_used_at=now)
                        .returning(records.c.id))
                rid = conn.execute(bump).scalar_one_or_none()
            if rid is not None:
                return int(rid), False
        raise StoreError(f"cannot add record {values['content_hash'][:12]} to {self.url}")

    def add_many(self, records_: Iterable[Record]) -> int:
        """Insert many records in one transaction; duplicates are skipped (hits unchanged).

        Returns:
            How many rows were inserted.
        """
        now = time.time()
        rows, seen = [], set()
        for r in records_:
            check_record(r)
            if content_hash(r) not in seen:
                seen.add(content_hash(r))
                rows.append(row_values(r, now))
        if not rows:
            return 0
        stmt = dialect_insert(self._engine.dialect.name)(records).on_conflict_do_nothing(index_elements=["content_hash"])
        with self._write() as conn:
            before = conn.execute(select(func.count()).select_from(records)).scalar_one()
            conn.execute(stmt, rows)
            return int(conn.execute(select(func.count()).select_from(records)).scalar_one() - before)

    def get(self, record_id: int) -> Record | None:
        with self._read() as conn:
            row = conn.execute(select(records).where(records.c.id == int(record_id))).first()
        return None if row is None else to_record(row)

    def get_many(self, ids: Sequence[int]) -> list[Record]:
        """Records for ``ids`` in the order given; unknown ids are skipped."""
        wanted = [int(i) for i in ids]
        found: dict[int, Record] = {}
        with self._read() as conn:
            for i in range(0, len(wanted), CHUNK):
                stmt = select(records).where(records.c.id.in_(wanted[i : i + CHUNK]))
                found.update((r.id, to_record(r)) for r in conn.execute(stmt))
        return [found[i] for i in wanted if i in found]

    def iter(self, *, scope: str | None = None, model: str | None = None,
             after_id: int = 0) -> Iterator[Record]:
        """Records with ``id > after_id`` in id order, read page by page (no long transaction)."""
        last = int(after_id)
        while True:
            stmt = (select(records).where(records.c.id > last, *filters(scope, model))
                    .order_by(records.c.id).limit(CHUNK))
            with self._read() as conn:
                page = [to_record(r) for r in conn.execute(stmt)]
            yield from page
            if len(page) < CHUNK:
                return
            last = page[-1].id  # type: ignore[assignment]

    def delete(self, ids: Iterable[int]) -> int:
        with self._write() as conn:
            return sql_upkeep.delete_ids(conn, [int(i) for i in ids])

    def touch(self, record_id: int, *, accepted_tokens: int = 0) -> None:
        """Bump hits, add ``accepted_tokens``, set last use to now; unknown ids are ignored."""
        check_nonneg("accepted_tokens", accepted_tokens)
        with self._write() as conn:
            conn.execute(update(records).where(records.c.id == int(record_id)).values(
                hits=records.c.hits + 1, last_used_at=time.time(),
                accepted_tokens=records.c.accepted_tokens + int(accepted_tokens)))

    def max_id(self) -> int:
        with self._read() as conn:
            return int(conn.execute(select(func.coalesce(func.max(records.c.id), 0))).scalar_one())

    def __len__(self) -> int:
        return self.count()

    # --- what the memory and the CLI need ---------------------------------------------------
    def count(self, *, scope: str | None = None, model: str | None = None,
              embedder: str | None = None) -> int:
        """Rows matching; with ``embedder``, only rows embedded by it."""
        stmt = select(func.count()).select_from(records).where(*filters(scope, model, embedder))
        with self._read() as conn:
            return int(conn.execute(stmt).scalar_one())

    def ids(self, *, scope: str | None = None, embedder: str | None = None) -> np.ndarray:
        """Sorted int64 ids matching (with ``embedder``: only rows embedded by it)."""
        stmt = select(records.c.id).where(*filters(scope, None, embedder)).order_by(records.c.id)
        with self._read() as conn:
            return np.fromiter(conn.execute(stmt).scalars(), np.int64)

    def catches_up_by_key(self, after_id: int, among: Sequence[int] | None) -> bool:
        """Whether :meth:`ids_after` finds its rows by the primary key (a memory catching up:
        ``after_id > 0`` or ``among``) rather than through the scope's index; a subclass may
        answer otherwise (the bench's store as it was, ``agentspec.bench.memory_lookup``)."""
        return after_id > 0 or among is not None

    def ids_after(self, after_id: int, *, scope: str | None = None, model: str | None = None,
                  embedder: str | None = None,
                  among: Sequence[int] | None = None) -> list[tuple[int, np.ndarray]]:
        """``(id, float32 embedding)`` of embedded rows with ``id > after_id`` (and, given
        ``among``, an id in it), in id order.

        With ``after_id > 0`` or ``among`` (a memory catching up) the rows are found by the
        primary key, not through the scope's index, which would read every row id of the
        scope: the work grows with the rows written since, not with the store."""
        terms = filters(scope, model, embedder, unindexed=self.catches_up_by_key(after_id, among))
        base = (select(records.c.id, records.c.embedding)
                .where(records.c.id > int(after_id), records.c.embedding.is_not(None), *terms)
                .order_by(records.c.id))
        wanted = None if among is None else sorted({int(i) for i in among})
        stmts = [base] if wanted is None else [
            base.where(records.c.id.in_(wanted[i : i + CHUNK])) for i in range(0, len(wanted), CHUNK)]
        out: list[tuple[int, np.ndarray]] = []
        with self._read() as conn:
            for stmt in stmts:
                out += [(int(i), np.frombuffer(e, "<f4").astype(np.float32))
                        for i, e in conn.execute(stmt)]
        return out

    def ids_since(self, after_id: int) -> np.ndarray:
        """Every id above ``after_id``, any scope, sorted (int64): read by the primary key. An
        id missing below the largest may belong to a transaction that has not committed yet
        (PostgreSQL hands out ids before commits, which can land out of order)."""
        stmt = select(records.c.id).where(records.c.id > int(after_id)).order_by(records.c.id)
        with self._read() as conn:
            return np.fromiter(conn.execute(stmt).scalars(), np.int64)

    def token_total(self, scope: str | None = None) -> int:
        """Completion tokens stored in ``scope`` (all scopes when None)."""
        with self._read() as conn:
            return sql_upkeep.token_total(conn, scope)

    def stats(self) -> dict[str, Any]:
        """Totals of rows, tokens, bytes, hits and accepted tokens, overall and per scope and
        per model: ``{"rows", "tokens", "bytes", "hits", "accepted_tokens", "scopes": {scope:
        {...}}, "models": {model: {...}}}``."""
        c = records.c
        stmt = (select(c.scope, c.model, func.count(), func.sum(c.num_tokens), func.sum(c.num_bytes),
                       func.sum(c.hits), func.sum(c.accepted_tokens))
                .group_by(c.scope, c.model).order_by(c.scope, c.model))
        out = empty_stats()
        with self._read() as conn:
            for scope, model, *values in conn.execute(stmt):
                add_stats_row(out, scope, model, *values)
        return out

    def embedding_groups(self, scope: str | None = None) -> dict[tuple[str, str, int], int]:
        """Embedded rows per ``(scope, embedder, dim)`` (of ``scope`` only, unless None)."""
        c = records.c
        stmt = (select(c.scope, c.embedder, c.dim, func.count()).where(c.dim > 0, *filters(scope))
                .group_by(c.scope, c.embedder, c.dim))
        with self._read() as conn:
            return {(s, e, int(d)): int(n) for s, e, d, n in conn.execute(stmt)}

    def unembedded_ids(self) -> list[int]:
        """Ids of rows stored without an embedding, in id order."""
        stmt = select(records.c.id).where(records.c.dim == 0).order_by(records.c.id)
        with self._read() as conn:
            return [int(i) for i in conn.execute(stmt).scalars()]

    def set_embeddings(self, rows: Sequence[tuple[int, np.ndarray]], embedder: str) -> int:
        """Store each ``(id, float32 [dim] vector)`` as the embedding of a row that has none,
        in one transaction; ids stay the same. Returns how many rows took one."""
        c = records.c
        stmt = (update(records).where(c.id == bindparam("rid"), c.dim == 0)
                .values(embedding=bindparam("emb"), embedder=embedder, dim=bindparam("d"),
                        num_bytes=c.num_bytes + 4 * bindparam("d")))
        params = []
        for rid, vector in rows:
            vec = np.asarray(vector, "<f4").reshape(-1)
            if not vec.size:
                raise ValueError(f"row {rid}: an embedding needs at least one value")
            params.append({"rid": int(rid), "emb": vec.tobytes(), "d": int(vec.size)})
        if not params:
            return 0
        with self._write() as conn:
            return int(conn.execute(stmt, params).rowcount)

    def list_records(self, scope: str | None = None, model: str | None = None,
                     sort: str = "recent", limit: int = 20) -> list[Record]:
        """Up to ``limit`` records, best first by ``sort`` (ties: newest id first); an unknown
        ``sort`` or a negative ``limit`` raises ValueError."""
        check_sort(sort)
        check_nonneg("limit", limit)
        # ids first: the (scope, model, counters) index answers this without reading the rows
        stmt = (select(records.c.id).where(*filters(scope, model))
                .order_by(_SORT_COLUMNS[sort].desc(), records.c.id.desc()).limit(int(limit)))
        with self._read() as conn:
            ids = list(conn.execute(stmt).scalars())
        return self.get_many(ids)

    def drop_scope(self, scope: str) -> int:
        """Delete every record of ``scope``; returns how many."""
        with self._write() as conn:
            return int(conn.execute(delete(records).where(records.c.scope == scope)).rowcount)

    def relabel_model(self, old: str, new: str) -> tuple[int, int]:
        """Give every record of model fingerprint ``old`` the fingerprint ``new``, in one
        transaction: rows recorded before a fingerprint changed (the model is the same) are
        drafted from again. A record that ``new`` already holds (same scope, key and
        completion) is merged into it: hits and accepted tokens added, the later use kept.
        Ids do not change, so the memory's indexes stay valid (a merged id is no longer found).

        Returns:
            ``(moved, merged)`` record counts.
        """
        check_relabel(old, new)
        with self._write() as conn:
            return sql_upkeep.relabel(conn, old, new)

    def prune(self, older_than_s: float | None, scope: str | None = None,
              max_tokens: int | None = None, dry_run: bool = False) -> list[int]:
        """Delete rows unused for ``older_than_s`` seconds, then least recently used rows until
        ``scope`` (all scopes when None) holds at most ``max_tokens`` tokens.

        Returns:
            The deleted ids (those that would be deleted, when ``dry_run``).
        """
        check_nonneg("older_than_s", older_than_s)
        check_nonneg("max_tokens", max_tokens)
        with (self._read() if dry_run else self._write()) as conn:
            return sql_upkeep.prune(conn, older_than_s, scope, max_tokens, dry_run=dry_run)

    def evict_to_caps(self, max_tokens_per_scope: int | None, max_tokens_total: int | None,
                      *, scope: str | None = None) -> list[int]:
        """Delete least recently used rows until every scope (or only ``scope``) holds at most
        ``max_tokens_per_scope`` tokens and the store at most ``max_tokens_total``.

        Returns:
            The deleted ids.
        """
        check_nonneg("max_tokens_per_scope", max_tokens_per_scope)
        check_nonneg("max_tokens_total", max_tokens_total)
        with self._write() as conn:
            return sql_upkeep.evict_to_caps(conn, max_tokens_per_scope, max_tokens_total, scope)
