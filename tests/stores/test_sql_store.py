"""SQLStore beyond the contract: opening, failures, migration, several processes, kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, select, text

from agentspec.errors import StoreError
from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores import SCHEMA_VERSION, SQLStore, mask_url
from agentspec.stores.sql_schema import records
from tests.stores.conftest import make_record

WRITER = str(Path(__file__).with_name("mp_writer.py"))


def test_default_url_creates_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AGENTSPEC_DB", raising=False)
    with SQLStore() as store:
        assert store.url.endswith("home/memory.db") and len(store) == 0
    assert (tmp_path / "home" / "memory.db").is_file()


def test_sqlite_runs_in_wal_mode(tmp_path):
    store = SQLStore(f"sqlite:///{tmp_path / 'm.db'}")
    with store._engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    store.close()


def test_in_memory_sqlite_url():
    store = SQLStore("sqlite://")
    assert store.add(make_record(1)) == (1, True) and len(store) == 1


@pytest.mark.parametrize("url, shown", [
    ("postgresql+psycopg://u:secret@127.0.0.1:1/x", "postgresql+psycopg://u:***@127.0.0.1:1/x"),
    ("postgresql+psycopg://u@127.0.0.1:1/x", "postgresql+psycopg://u@127.0.0.1:1/x"),
    ("nosuchdialect://a/b", "nosuchdialect://a/b"),
])
def test_unreachable_url_fails_at_construction(url, shown):
    with pytest.raises(StoreError) as info:
        SQLStore(url)
    assert shown in str(info.value) and "secret" not in str(info.value)


def test_uncreatable_sqlite_path_fails_at_construction(tmp_path):
    (tmp_path / "file").write_text("a file, not a folder")
    url = f"sqlite:///{tmp_path / 'file' / 'sub' / 'memory.db'}"
    with pytest.raises(StoreError, match="file/sub/memory.db"):
        SQLStore(url)


def test_mask_url():
    assert mask_url("postgresql+psycopg://bob:pw@h/db") == "postgresql+psycopg://bob:***@h/db"


V0_DDL = """CREATE TABLE agentspec_records (
    id INTEGER PRIMARY KEY AUTOINCREMENT, scope VARCHAR(255) NOT NULL, model VARCHAR(255) NOT NULL,
    embedder VARCHAR(255) NOT NULL, dim INTEGER NOT NULL, content_hash VARCHAR(64) NOT NULL UNIQUE,
    created_at FLOAT NOT NULL, last_used_at FLOAT NOT NULL, hits INTEGER NOT NULL,
    completion_ids BLOB NOT NULL, embedding BLOB, request_text TEXT NOT NULL,
    key_text TEXT NOT NULL, completion_text TEXT NOT NULL)"""


def test_version_0_layout_is_migrated(tmp_path):
    """A pre-meta database (no counters, no indexes, no meta table) opens and is upgraded."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    emb = np.ones(4, "<f4") / 2
    with engine.begin() as conn:
        conn.exec_driver_sql(V0_DDL)
        conn.execute(text(
            "INSERT INTO agentspec_records (scope, model, embedder, dim, content_hash, created_at,"
            " last_used_at, hits, completion_ids, embedding, request_text, key_text,"
            " completion_text) VALUES ('s', 'm', 'e', 4, 'h0', 1.0, 2.0, 3, :ids, :emb, 'req',"
            " 'key', 'out é')"), {"ids": np.asarray([5, 6, 7], "<i4").tobytes(), "emb": emb.tobytes()})
    engine.dispose()
    store = SQLStore(url)
    assert store.schema_version() == SCHEMA_VERSION == 2
    old = store.get(1)
    assert old.completion_ids == (5, 6, 7) and old.hits == 3 and old.accepted_tokens == 0
    assert store.token_total() == 3 and store.stats()["bytes"] == 12 + 16 + len("reqkeyout é".encode())
    assert store.add(make_record(2))[1] and len(store) == 2
    store.close()
    with create_engine(url).connect() as conn:
        index_names = {r[0] for r in conn.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "ix_agentspec_records_last_used" in index_names
    assert SQLStore(url).schema_version() == 2  # reopening is a no-op


def test_newer_schema_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'new.db'}"
    SQLStore(url).close()
    with create_engine(url).begin() as conn:
        conn.exec_driver_sql("UPDATE agentspec_meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match="99"):
        SQLStore(url)


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WRITER, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_processes_write_one_store(db_url):
    """500 records from each of two processes: 1000 rows, and both indexes see all of them."""
    SQLStore(db_url).close()  # create the schema before the race starts
    procs = [_spawn("write", db_url, tag, "500", "1000") for tag in ("a", "b")]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "1000"
    store = SQLStore(db_url)
    assert len(store) == 1000 and store.count(scope="shared") == 1000
    memory = CompletionMemory(store, embedder=HashEmbedder())
    assert memory.lookup("a key 17", scope="shared", model="m", k=1)[0][0].key_text == "a key 17"
    store.close()


def test_kill_9_during_a_write_burst_leaves_no_partial_rows(tmp_path):
    url = f"sqlite:///{tmp_path / 'burst.db'}"
    proc = _spawn("burst", url)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    store = SQLStore(url)
    n = len(store)
    assert n > 20
    with store._engine.connect() as conn:
        rows = conn.execute(select(records.c.id, records.c.num_tokens, records.c.completion_ids,
                                   records.c.embedding, records.c.dim)).all()
    for row in rows:
        assert len(np.frombuffer(row.completion_ids, "<i4")) == row.num_tokens
        assert len(np.frombuffer(row.embedding, "<f4")) == row.dim == 64
    assert all(r.num_tokens == len(r.completion_ids) for r in store.iter())
    memory = CompletionMemory(store, embedder=HashEmbedder())
    hits = memory.lookup("burst key 0 ", scope="burst", model="m", k=5)
    assert hits[0][1] == pytest.approx(1.0, abs=1e-5)
    assert "burst key 0 " in [r.key_text for r, _ in hits]
    assert memory.stats()["indexes"] == {"burst": n}
    assert store.add(make_record(1))[1]  # and the store still takes writes
    store.close()


def test_embedding_queries_the_cli_uses(db_url):
    with SQLStore(db_url) as store:
        store.add_many([make_record(i, scope="ab"[i % 2]) for i in range(5)]
                       + [make_record(9, embedding=None), make_record(10, embedding=None)])
        assert store.embedding_groups() == {("a", "e", 8): 3, ("b", "e", 8): 2}
        assert store.embedding_groups("b") == {("b", "e", 8): 2}
        bare = store.unembedded_ids()
        assert len(bare) == 2 and bare == sorted(bare)
        vec = np.ones(4, np.float32) / 2
        assert store.set_embeddings([(bare[0], vec)], "x") == 1
        assert store.set_embeddings([(bare[0], vec)], "x") == 0  # only rows without one
        assert store.unembedded_ids() == bare[1:]
        assert store.embedding_groups("s") == {("s", "x", 4): 1}
        got = store.get(bare[0])
        assert got.embedder == "x" and np.array_equal(got.embedding, vec)
        with pytest.raises(ValueError, match="at least one value"):
            store.set_embeddings([(bare[1], np.zeros(0, np.float32))], "x")


def test_read_only_sqlite_opens_reads_and_refuses_writes(tmp_path):
    path = tmp_path / "m.db"
    with SQLStore(f"sqlite:///{path}") as store:
        store.add(make_record(1))
    with SQLStore(f"sqlite:///file:{path}?mode=ro&uri=true") as ro:
        assert len(ro) == 1 and ro.get(1).key_text == "key 1"
        with pytest.raises(StoreError, match="cannot write .*readonly"):
            ro.add(make_record(2))


def test_driver_errors_are_store_errors_and_duplicates_still_bump(tmp_path):
    """A DatabaseError that is not an OperationalError (a corrupt page) is a StoreError too;
    the IntegrityError that ``add`` relies on for duplicates is not swallowed by the mapping."""
    from sqlalchemy import event

    store = SQLStore(f"sqlite:///{tmp_path / 'm.db'}")
    assert store.add(make_record(1)) == (1, True)
    assert store.add(make_record(1)) == (1, False) and store.get(1).hits == 1

    def corrupt(conn, cursor, statement, *args):
        import sqlite3

        raise sqlite3.DatabaseError("database disk image is malformed")

    event.listen(store._engine, "before_cursor_execute", corrupt)
    with pytest.raises(StoreError, match="cannot read .* malformed"):
        store.get(1)
    store.close()


def test_a_removed_sqlite_folder_is_noticed_and_its_return_too(tmp_path):
    """A pooled connection would go on writing into the unlinked file: the store refuses
    instead, and uses the file again once it is back."""
    folder = tmp_path / "db"
    store = SQLStore(f"sqlite:///{folder / 'm.db'}")
    store.add(make_record(1))
    folder.rename(tmp_path / "away")
    with pytest.raises(StoreError, match="was removed|unable to open"):
        store.add(make_record(2))
    (tmp_path / "away").rename(folder)
    assert store.add(make_record(3))[1] and len(store) == 2
    store.close()


@pytest.mark.postgres
@pytest.mark.parametrize("follow_holes", [True, False])
def test_a_row_committed_after_a_later_id_is_still_found(pg_url, follow_holes, monkeypatch):
    """PostgreSQL hands out ids before commits: a row whose id is below one already seen can
    commit later. The catching-up memory keeps the missing id as a hole and finds the row."""
    from sqlalchemy import create_engine, insert

    from agentspec.memory.index import ScopeIndex
    from agentspec.stores.sql_schema import records, row_values

    def by_watermark_alone(self, store, scope, embedder, now, check_interval_s):
        rows = store.ids_after(self.watermark, scope=scope, embedder=embedder)
        self.add_rows(rows)  # the watermark jumps past any id not committed yet

    if not follow_holes:  # a deliberately wrong memory: it catches up by the watermark alone
        monkeypatch.setattr(ScopeIndex, "catch_up", by_watermark_alone)
    SQLStore(pg_url).close()
    reader = CompletionMemory.open(pg_url, embedder=HashEmbedder(), sync_interval_s=0.0,
                                   check_interval_s=3600)
    writer = CompletionMemory.open(pg_url, embedder=HashEmbedder(), sync_interval_s=0.0)
    first = writer.record(scope="s", model="m", request_text="r0", key_text="the first key",
                          completion_text="c0", completion_ids=[1, 2])
    reader.lookup("warm up", scope="s", model="m")  # its index holds the first row
    late_key = "a key whose transaction commits late"
    late = make_record(0, scope="s", model="m", key_text=late_key, embedder=HashEmbedder().name,
                       embedding=HashEmbedder().embed([late_key])[0])
    engine = create_engine(pg_url)
    with engine.connect() as slow:
        tx = slow.begin()
        late_id = slow.execute(insert(records).values(**row_values(late, 0.0))
                               .returning(records.c.id)).scalar_one()
        later = writer.record(scope="s", model="m", request_text="r2", key_text="a later key",
                              completion_text="c2", completion_ids=[3])
        assert first < late_id < later
        reader.lookup("a later key", scope="s", model="m")  # sees `later`, not `late_id`
        tx.commit()
    engine.dispose()
    hits = reader.lookup(late_key, scope="s", model="m", k=1)
    assert (hits[0][0].id == late_id) == follow_holes
    reader.close()
    writer.close()
