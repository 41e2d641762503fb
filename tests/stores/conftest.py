"""Fixtures of the store tests: every RecordStore (PostgreSQL when AGENTSPEC_TEST_PG_URL is set)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agentspec.stores import InMemoryStore, SQLStore
from agentspec.types import Record

PG_HINT = ("PostgreSQL tests need AGENTSPEC_TEST_PG_URL; to run them: "
           "AGENTSPEC_TEST_PG_URL=$(bash .ci/postgres.sh) .venv/bin/pytest tests/stores")


def make_record(i: int, *, scope: str = "s", model: str = "m", n: int = 3, dim: int = 8,
                embedder: str = "e", **kw: object) -> Record:
    """A record whose texts and embedding are derived from ``i`` (deterministic)."""
    rng = np.random.default_rng(i)
    vec = rng.standard_normal(dim).astype(np.float32)
    fields: dict = dict(scope=scope, model=model, request_text=f"request {i} é",
                        key_text=f"key {i}", completion_text=f"completion {i} ✓",
                        completion_ids=tuple(range(i, i + n)),
                        embedding=vec / np.linalg.norm(vec), embedder=embedder)
    fields.update(kw)
    return Record(**fields)


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards."""
    url = os.environ.get("AGENTSPEC_TEST_PG_URL")
    if not url:
        pytest.skip(PG_HINT)
    from sqlalchemy import create_engine

    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in url else "?"
    yield f"{url}{sep}options=-csearch_path%3D{schema}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database URL: a SQLite file, or a PostgreSQL schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'db' / 'memory.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[InMemoryStore | SQLStore]:
    """Every RecordStore, empty."""
    if request.param == "memory":
        yield InMemoryStore()
        return
    url = (f"sqlite:///{tmp_path / 'memory.db'}" if request.param == "sqlite"
           else request.getfixturevalue("pg_url"))
    sql = SQLStore(url)
    yield sql
    sql.close()
