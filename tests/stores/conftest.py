"""Fixtures of the store tests: every RecordStore (PostgreSQL when AGENTSPEC_TEST_PG_URL is set)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agentspec.stores import InMemoryStore, SQLStore
from agentspec.types import Record


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
