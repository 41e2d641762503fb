"""The completion memory's SQL tables, row encoding, the WHERE terms on them, and forward
migrations.

Schema versions live in the ``agentspec_meta`` table (``key = 'schema_version'``). A database
without that table but with ``agentspec_records`` is version 0: the pre-release layout that
lacked ``accepted_tokens``, ``num_tokens``, ``num_bytes`` and the indexes. Opening an older
version runs every migration from it up to ``SCHEMA_VERSION`` in one transaction; opening a
newer one is refused, since an older agentspec cannot know what the newer columns mean.
Version 2 added ``origins``: where each completion token came from (a JSON text, NULL for the
rows written before it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    inspect,
    select,
    update,
)

from agentspec.errors import StoreError
from agentspec.stores.memory_store import content_hash, record_bytes
from agentspec.types import Origins, Record

SCHEMA_VERSION = 2
CHUNK = 500  # ids per IN (...) clause and rows per page of ``SQLStore.iter``

metadata = MetaData()

# Small columns first: SQLite reads a row's leading columns without its overflow pages.
records = Table(
    "agentspec_records",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("scope", String(255), nullable=False),
    Column("model", String(255), nullable=False),
    Column("embedder", String(255), nullable=False),
    Column("dim", Integer, nullable=False),
    Column("content_hash", String(64), nullable=False, unique=True),
    Column("created_at", Float, nullable=False),
    Column("last_used_at", Float, nullable=False),
    Column("hits", Integer, nullable=False),
    Column("accepted_tokens", BigInteger, nullable=False),
    Column("num_tokens", Integer, nullable=False),
    Column("num_bytes", Integer, nullable=False),
    Column("completion_ids", LargeBinary, nullable=False),  # int32 little-endian
    Column("embedding", LargeBinary, nullable=True),  # float32 little-endian [dim]
    Column("request_text", Text, nullable=False),
    Column("key_text", Text, nullable=False),
    Column("completion_text", Text, nullable=False),
    Column("origins", Text, nullable=True),  # Origins.as_json(); NULL: not kept
    # Ids are never reused (SQLite would give a deleted newest row's id to the next insert):
    # a memory catching up by id would take that row for one it already holds.
    sqlite_autoincrement=True,
)
# (scope, model) carries the counters too, so stats and token totals never read the rows.
Index("ix_agentspec_records_scope_model", records.c.scope, records.c.model, records.c.num_tokens,
      records.c.num_bytes, records.c.hits, records.c.accepted_tokens)
Index("ix_agentspec_records_last_used", records.c.last_used_at)
Index("ix_agentspec_records_scope_embedder", records.c.scope, records.c.embedder, records.c.dim)

meta = Table(
    "agentspec_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)


def filters(scope: str | None = None, model: str | None = None,
            embedder: str | None = None, *, unindexed: bool = False) -> list[Any]:
    """WHERE terms on :data:`records`; ``unindexed`` writes each column as an expression
    (``scope || ''``), which no database answers from an index, so that it picks the primary
    key."""
    def col(c: Any) -> Any:
        return c + "" if unindexed else c

    out = []
    if scope is not None:
        out.append(col(records.c.scope) == scope)
    if model is not None:
        out.append(col(records.c.model) == model)
    if embedder is not None:
        out += [col(records.c.embedder) == embedder, records.c.dim > 0]
    return out


def row_values(record: Record, now: float) -> dict[str, Any]:
    """The column values that store ``record`` (its id is left to the database)."""
    ids = np.asarray(record.completion_ids, "<i4")
    emb = None if record.embedding is None else np.asarray(record.embedding, "<f4").reshape(-1)
    created = record.created_at or now
    return {
        "scope": record.scope, "model": record.model,
        "embedder": record.embedder if emb is not None else "",
        "dim": 0 if emb is None else int(emb.size),
        "content_hash": content_hash(record),
        "created_at": created, "last_used_at": record.last_used_at or created,
        "hits": int(record.hits), "accepted_tokens": int(record.accepted_tokens),
        "num_tokens": int(ids.size), "num_bytes": record_bytes(record),
        "completion_ids": ids.tobytes(), "embedding": None if emb is None else emb.tobytes(),
        "request_text": record.request_text, "key_text": record.key_text,
        "completion_text": record.completion_text,
        "origins": None if record.origins is None else record.origins.as_json(),
    }


def to_record(row: Any) -> Record:
    """Decode one ``agentspec_records`` row (origins that do not read back, or do not fit
    its tokens, are left out: they are only ever shown)."""
    emb = None if row.embedding is None else np.frombuffer(row.embedding, "<f4").astype(np.float32)
    ids = tuple(np.frombuffer(row.completion_ids, "<i4").tolist())
    return Record(
        scope=row.scope, model=row.model, request_text=row.request_text, key_text=row.key_text,
        completion_text=row.completion_text,
        completion_ids=ids,
        embedding=emb, embedder=row.embedder, id=int(row.id), created_at=float(row.created_at),
        last_used_at=float(row.last_used_at), hits=int(row.hits),
        accepted_tokens=int(row.accepted_tokens), origins=_origins(row, len(ids)),
    )


def _origins(row: Any, tokens: int) -> Origins | None:
    text = getattr(row, "origins", None)
    if text is None:
        return None
    try:
        origins = Origins.from_json(text)
    except ValueError:
        return None
    return origins if len(origins.sources) == tokens else None


def read_version(conn: Connection) -> int | None:
    """The schema version of the database, 0 for the pre-meta layout, None when empty."""
    tables = set(inspect(conn).get_table_names())
    if meta.name in tables:
        value = conn.execute(select(meta.c.value).where(meta.c.key == "schema_version")).scalar()
        if value is not None:
            return int(value)
    return 0 if records.name in tables else None


def _write_version(conn: Connection, version: int) -> None:
    if conn.execute(update(meta).where(meta.c.key == "schema_version")
                    .values(value=str(version))).rowcount == 0:
        conn.execute(meta.insert().values(key="schema_version", value=str(version)))


def _migrate_0_to_1(conn: Connection) -> None:
    """Add the counters of version 1, fill them from the stored rows, create the indexes."""
    have = {c["name"] for c in inspect(conn).get_columns(records.name)}
    for name, kind in (("accepted_tokens", "BIGINT"), ("num_tokens", "INTEGER"),
                       ("num_bytes", "INTEGER")):
        if name not in have:
            conn.exec_driver_sql(
                f"ALTER TABLE {records.name} ADD COLUMN {name} {kind} NOT NULL DEFAULT 0")
    rows = conn.execute(select(records.c.id, records.c.completion_ids, records.c.embedding,
                               records.c.request_text, records.c.key_text,
                               records.c.completion_text)).all()
    for row in rows:
        texts = (row.request_text, row.key_text, row.completion_text)
        blobs = len(row.completion_ids) + len(row.embedding or b"")
        conn.execute(update(records).where(records.c.id == row.id).values(
            num_tokens=len(row.completion_ids) // 4,
            num_bytes=blobs + sum(len(t.encode("utf-8")) for t in texts)))
    for index in records.indexes:
        index.create(conn, checkfirst=True)


def _migrate_1_to_2(conn: Connection) -> None:
    """Add ``origins``, NULL for the rows there are (their origins were never kept)."""
    have = {c["name"] for c in inspect(conn).get_columns(records.name)}
    if "origins" not in have:
        conn.exec_driver_sql(f"ALTER TABLE {records.name} ADD COLUMN origins TEXT")


MIGRATIONS: dict[int, Callable[[Connection], None]] = {0: _migrate_0_to_1, 1: _migrate_1_to_2}


def prepare(conn: Connection, url: str) -> None:
    """Create the tables of a new database or migrate an older one to ``SCHEMA_VERSION``.

    Runs inside the caller's write transaction, so concurrent openers take turns.
    """
    version = read_version(conn)
    if version is None:
        metadata.create_all(conn)
    elif version > SCHEMA_VERSION:
        raise StoreError(f"{url} has schema version {version}; this agentspec reads up to "
                         f"{SCHEMA_VERSION}: upgrade agentspec")
    else:
        metadata.create_all(conn)  # tables added since (meta), never existing ones
        for v in range(version, SCHEMA_VERSION):
            MIGRATIONS[v](conn)
    if version != SCHEMA_VERSION:
        _write_version(conn, SCHEMA_VERSION)
