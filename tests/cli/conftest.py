"""Fixtures of the CLI tests: a HashEmbedder-filled store on SQLite or PostgreSQL, and a runner."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from agentspec.cli import app
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores import SQLStore
from agentspec.types import Record

EMBEDDER = HashEmbedder(64)
NOW = time.time()


def make_records(n: int = 30) -> list[Record]:
    """``n`` records over scopes a/b and models m1/m2, embedded by the hash embedder.

    Record ``i`` was last used ``i`` days ago, has ``i % 4`` hits and ``i + 1`` tokens.
    """
    keys = [f"user: question number {i} about {['weather', 'taxes', 'code'][i % 3]}"
            for i in range(n)]
    vectors = EMBEDDER.embed(keys)
    return [Record(scope="ab"[i % 2], model=f"m{1 + i % 3 // 2}", request_text=f"request {i} é",
                   key_text=keys[i], completion_text=f"answer {i} ✓",
                   completion_ids=tuple(range(100 + i, 101 + 2 * i)), embedding=vectors[i],
                   embedder=EMBEDDER.name, created_at=NOW - 86400 * i - 10,
                   last_used_at=NOW - 86400 * i, hits=i % 4, accepted_tokens=3 * i)
            for i in range(n)]


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private AGENTSPEC_HOME (index files land there); AGENTSPEC_DB unset."""
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AGENTSPEC_DB", raising=False)
    return tmp_path / "home"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database URL (the SQLite file exists)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'db' / 'memory.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    SQLStore(url).close()
    return url


@pytest.fixture
def url(empty_url: str) -> str:
    """A database holding ``make_records()``."""
    with SQLStore(empty_url) as store:
        store.add_many(make_records())
    return empty_url


Invoke = Callable[..., Result]


@pytest.fixture
def cli(url: str) -> Invoke:
    """Run ``agentspec --db URL ARGS...`` in process; stderr is kept apart."""
    return make_invoke(url)


def make_invoke(url: str) -> Invoke:
    def invoke(*args: str, input: str | None = None) -> Result:
        return CliRunner().invoke(app, ["--db", url, *args], input=input)

    return invoke
