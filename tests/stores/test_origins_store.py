"""A record keeps where its tokens came from: every store round-trips ``Record.origins``, a
version-1 database gains the column on opening (its rows without origins), and origins that do
not read back leave the record readable."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine

from agentspec.errors import StoreError
from agentspec.stores import SQLStore, sql_schema
from agentspec.types import Origins
from tests.stores.conftest import make_record

ORIGINS = Origins(("memory", "memory", "target"), (3,), (7, 11))


def test_every_store_round_trips_origins(store):
    kept = store.add(make_record(1, origins=ORIGINS))[0]
    bare = store.add(make_record(2))[0]
    assert store.get(kept).origins == ORIGINS
    assert store.get(bare).origins is None
    assert [r.origins for r in store.iter()] == [ORIGINS, None]


def _version_1(url: str) -> None:
    """The layout version 1 had: today's without ``origins``, its version written as 1."""
    SQLStore(url).close()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE agentspec_records DROP COLUMN origins")
        conn.exec_driver_sql("UPDATE agentspec_meta SET value = '1' WHERE key = 'schema_version'")
        conn.exec_driver_sql(
            "INSERT INTO agentspec_records (scope, model, embedder, dim, content_hash, created_at,"
            " last_used_at, hits, accepted_tokens, num_tokens, num_bytes, completion_ids,"
            " request_text, key_text, completion_text) VALUES ('s', 'm', '', 0, 'h', 1.0, 1.0, 0,"
            " 0, 1, 4, X'05000000', 'req', 'key', 'out')")
    engine.dispose()


def test_version_1_gains_origins_on_opening(tmp_path):
    url = f"sqlite:///{tmp_path / 'v1.db'}"
    _version_1(url)
    with SQLStore(url) as store:
        assert store.schema_version() == sql_schema.SCHEMA_VERSION == 2
        old = store.get(1)
        assert old is not None and old.completion_ids == (5,) and old.origins is None
        rid = store.add(make_record(3, origins=ORIGINS))[0]
        assert store.get(rid).origins == ORIGINS


def test_without_the_migration_a_version_1_database_cannot_keep_origins(tmp_path, monkeypatch):
    """The control: the same database, the migration left out, fails to record."""
    url = f"sqlite:///{tmp_path / 'v1.db'}"
    _version_1(url)
    monkeypatch.setitem(sql_schema.MIGRATIONS, 1, lambda conn: None)
    with SQLStore(url) as store, pytest.raises(StoreError):
        store.add(make_record(3, origins=ORIGINS))


def test_origins_must_fit_the_tokens(store):
    with pytest.raises(ValueError, match="origins name 3 tokens for 5 completion ids"):
        store.add(make_record(1, n=5, origins=ORIGINS))


def test_origins_that_do_not_read_back_leave_the_record_readable(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    with SQLStore(url) as store:
        torn = store.add(make_record(1, origins=ORIGINS))[0]
        short = store.add(make_record(2, origins=ORIGINS))[0]
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE agentspec_records SET origins = '{{\"runs\": [' "
                             f"WHERE id = {torn}")
        conn.exec_driver_sql(f"UPDATE agentspec_records SET origins = "
                             f"'{Origins(('memory',), (1,)).as_json()}' WHERE id = {short}")
    engine.dispose()
    with SQLStore(url) as store:
        got = store.get(torn)
        assert got is not None and got.origins is None and got.completion_ids == (1, 2, 3)
        assert store.get(short).origins is None  # one origin for three tokens
