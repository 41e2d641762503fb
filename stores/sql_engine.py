"""Engines for SQLStore, and the one place where database errors become StoreError.

SQLite runs in WAL mode with a busy timeout; every write transaction starts with ``BEGIN
IMMEDIATE`` so that writers from several processes queue for the lock instead of failing on a
stale read snapshot. A pooled SQLite connection keeps its file open even after the file (or its
folder) is removed or replaced, and would go on writing into an unlinked file: every checkout
first checks that the path still names the file the connection opened. PostgreSQL is reached
through psycopg 3 with ``pool_pre_ping``, so connections that a restarted server dropped are
replaced on their next use.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.pool import StaticPool

from agentspec.errors import StoreError


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***``."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except SQLAlchemyError:
        return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)


def make_engine(url: str, *, busy_timeout_s: float) -> Engine:
    """An engine for ``url``: SQLite (see the module docstring) or any other SQLAlchemy URL."""
    backend = make_url(url).get_backend_name()
    if backend == "sqlite":
        return _sqlite_engine(url, busy_timeout_s)
    args = {"connect_timeout": 10} if backend == "postgresql" else {}
    return create_engine(url, pool_pre_ping=True, connect_args=args)


def _sqlite_engine(url: str, busy_timeout_s: float) -> Engine:
    database = make_url(url).database
    path: Path | None = None
    if database and database != ":memory:" and not database.startswith("file:"):
        path = Path(database)
        path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url)
    else:
        engine = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, record: Any) -> None:
        dbapi_conn.isolation_level = None  # the "begin" hook below issues BEGIN itself
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL survives a killed process
        cur.close()
        if path is not None:
            record.info["agentspec_file"] = _identity(path)

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        write = conn.get_execution_options().get("agentspec_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    if path is not None:
        @event.listens_for(engine, "checkout")
        def _checkout(_dbapi_conn: Any, record: Any, _proxy: Any) -> None:
            now = _identity(path)
            if now is None:
                raise sqlite3.OperationalError(f"unable to open database file: {path} was removed")
            if now != record.info.get("agentspec_file"):
                raise DisconnectionError(f"{path} was replaced")  # the pool reconnects

    return engine


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of ``path``, None when it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def dialect_insert(dialect: str) -> Any:
    """``insert`` with ``on_conflict_do_nothing`` for SQLite or PostgreSQL."""
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert
    from sqlalchemy.dialects.postgresql import insert as pg_insert

    return pg_insert


@contextmanager
def store_errors(action: str, url: str) -> Iterator[None]:
    """Raise database failures as ``StoreError("cannot {action} the memory database {url}: ...")``.

    Every error the driver reports (connection refused, file gone, locked, read-only, disk
    full, corrupt) and a pool timeout become StoreError; IntegrityError passes through, since
    ``SQLStore.add`` relies on it to spot duplicates.
    """
    try:
        yield
    except IntegrityError:
        raise
    except (DBAPIError, PoolTimeoutError) as e:
        cause = getattr(e, "orig", None) or e
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise StoreError(f"cannot {action} the memory database {url}: {first}") from e
