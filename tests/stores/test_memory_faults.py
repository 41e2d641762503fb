"""Memory faults degrade, never fail: the memory is an accelerator, drafts are verified exactly.

Faults: the database down and back (PostgreSQL stopped and restarted in a private cluster;
SQLite's folder removed and restored), a write lock held, a read-only database, a full disk
(corrupt index files: test_index_faults.py). In each: no call raises, the failure is warned about once (naming the
database and the fix), completions recorded meanwhile wait in a bounded queue and are written
when the store is back; what the bound drops is counted in ``stats()["faults"]``. The real
model's greedy output stays that of plain decoding throughout.

The PostgreSQL outage runs in a throwaway cluster of its own (the shared test cluster is never
stopped): it needs the Debian binaries under /usr/lib/postgresql/*/bin and skips without them.
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import socket
import sqlite3
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import event

from agentspec.errors import StoreError
from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores import SQLStore
from tests.stores.faults import catching, fault_warnings, rec

BOUND = 5  # max_pending in these tests


def keys_in(store: SQLStore) -> list[str]:
    return [r.key_text for r in store.iter()]


# --- outages: the database goes away and comes back -----------------------------------------
@dataclass
class Outage:
    url: str
    down: Callable[[], None]
    up: Callable[[], None]
    fix: str  # a phrase of the fix the warning must name


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: (len(p), p))
    return Path(found[-1]).parent if found else None


def _as_postgres(cmd: str) -> None:
    args = ["su", "postgres", "-c", cmd] if os.geteuid() == 0 else ["sh", "-c", cmd]
    subprocess.run(args, check=True, capture_output=True, timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def private_pg() -> Iterator[Outage]:
    """A throwaway PostgreSQL cluster on a free port that the test may stop and start."""
    bin_dir = _pg_bin()
    if bin_dir is None:
        pytest.skip("no PostgreSQL binaries under /usr/lib/postgresql/*/bin "
                    "(apt-get install postgresql)")
    pytest.importorskip("psycopg", reason="psycopg is not installed: pip install 'agentspec-llm[postgres]'")
    if os.geteuid() == 0 and subprocess.run(["id", "postgres"], capture_output=True).returncode:
        pytest.skip("running as root without a 'postgres' user to run the cluster as")
    data = Path(tempfile.mkdtemp(prefix="agentspec-pg-faults-"))
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
    port = _free_port()
    ctl = f"{bin_dir}/pg_ctl -D {shlex.quote(str(data))}"
    opts = shlex.quote(f"-p {port} -k {data} -c listen_addresses=127.0.0.1")
    start = f"{ctl} -l {shlex.quote(str(data / 'log'))} -o {opts} -w -t 60 start"
    _as_postgres(f"{bin_dir}/initdb -D {shlex.quote(str(data))} -A trust -U postgres")
    _as_postgres(start)
    try:
        yield Outage(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres",
                     down=lambda: _as_postgres(f"{ctl} -m fast -w stop"),
                     up=lambda: _as_postgres(start), fix="start the database server")
    finally:
        subprocess.run(["su", "postgres", "-c", f"{ctl} -m immediate stop"]
                       if os.geteuid() == 0 else ["sh", "-c", f"{ctl} -m immediate stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def sqlite_folder(tmp_path: Path) -> Outage:
    """A SQLite file whose folder is moved away (down) and back (up)."""
    folder, away = tmp_path / "db", tmp_path / "away"
    return Outage(f"sqlite:///{folder / 'memory.db'}", down=lambda: folder.rename(away),
                  up=lambda: away.rename(folder), fix="file or its folder is gone")


@pytest.fixture(params=["sqlite-folder-removed",
                        pytest.param("postgres-stopped", marks=pytest.mark.postgres)])
def outage(request: pytest.FixtureRequest) -> Iterator[Outage]:
    if request.param == "sqlite-folder-removed":
        yield request.getfixturevalue("sqlite_folder")
        return
    yield from clean_cluster(request.getfixturevalue("private_pg"))


def clean_cluster(cluster: Outage) -> Iterator[Outage]:
    """A fixture's body: the private cluster with an empty table, brought back up afterwards
    if the test left it down."""
    with SQLStore(cluster.url) as store:
        store.delete(store.ids().tolist())
    yield cluster
    try:  # a test that failed while the server was down leaves it down
        SQLStore(cluster.url).close()
    except StoreError:
        cluster.up()


def test_database_down_then_back_loses_nothing_within_the_bound(outage: Outage) -> None:
    memory = CompletionMemory.open(outage.url, embedder=HashEmbedder(), retry_interval_s=0,
                                   max_pending=BOUND, sync_interval_s=0)
    first = rec(memory, "before 0")
    assert first > 0 and memory.lookup("before 0", scope="s", model="m")[0][0].id == first
    with catching() as caught:
        outage.down()
        for i in range(BOUND):  # every call is answered: lookups find nothing, records wait
            assert memory.lookup("before 0", scope="s", model="m") == []
            assert list(memory.completions(scope="s", model="m")) == []
            assert rec(memory, f"during {i}") == -1
            memory.credit(first, 3)
        faults = memory.stats()["faults"]
        assert faults["records_pending"] == BOUND and faults["records_dropped"] == 0
        assert faults["lookups_skipped"] == BOUND and faults["credits_dropped"] == BOUND
        assert not faults["ok"] and faults["write_error"]
        assert memory.stats()["store_error"] is not None  # totals unknown, the counters known
        outage.up()
        hits = memory.lookup("during 3", scope="s", model="m", k=1)  # flushes, then finds
    assert hits and hits[0][0].key_text == "during 3"
    said = fault_warnings(caught)
    assert len(said) == 1, said  # once for the whole outage
    assert memory.store.url in said[0] and outage.fix in said[0] and "queued" in said[0]
    assert keys_in(memory.store) == ["before 0"] + [f"during {i}" for i in range(BOUND)]
    faults = memory.stats()["faults"]
    assert faults["ok"] and faults["records_pending"] == 0 and faults["records_dropped"] == 0
    assert faults["records_flushed"] == BOUND

    # Past the bound: the oldest are dropped, and counted; a new outage warns again.
    with catching() as caught:
        outage.down()
        for i in range(BOUND + 3):
            rec(memory, f"second {i}")
        outage.up()
        assert memory.flush() == 0
    assert len(fault_warnings(caught)) == 1
    assert keys_in(memory.store)[1 + BOUND:] == [f"second {i}" for i in range(3, BOUND + 3)]
    assert memory.stats()["faults"]["records_dropped"] == 3
    memory.close()


def test_without_the_queue_the_records_are_lost_and_the_check_above_catches_it(
        outage: Outage) -> None:
    """The same outage with ``max_pending=0``: the check of the test above fails."""
    memory = CompletionMemory.open(outage.url, embedder=HashEmbedder(), retry_interval_s=0,
                                   max_pending=0)
    rec(memory, "before 0")
    with catching() as caught:
        outage.down()
        for i in range(3):
            assert rec(memory, f"during {i}") == -1
        outage.up()
        rec(memory, "after 0")
    written_during = len(memory.store) - 2  # all but "before 0" and "after 0"
    assert 3 - written_during == 3 and memory.stats()["faults"]["records_dropped"] == 3
    # The check the test above makes on the store's contents fails here:
    check = keys_in(memory.store) == ["before 0"] + [f"during {i}" for i in range(3)] + ["after 0"]
    assert check is False
    assert "dropped (max_pending=0)" in fault_warnings(caught)[0]
    memory.close()


def test_breaker_leaves_a_failed_store_alone_until_the_retry_interval(sqlite_folder: Outage):
    memory = CompletionMemory.open(sqlite_folder.url, embedder=HashEmbedder(),
                                   retry_interval_s=3600, max_pending=BOUND)
    rec(memory, "before")
    with catching():
        sqlite_folder.down()
        rec(memory, "during")
        sqlite_folder.up()
        rec(memory, "after")  # the store works again, but is not tried before the interval
        assert memory.stats()["faults"]["records_pending"] == 2
        hits = memory.lookup("before", scope="s", model="m")  # reads never failed: they go on
        assert hits[0][0].key_text == "before"
        assert memory.flush() == 0  # flush() tries now
    assert keys_in(memory.store) == ["before", "during", "after"]
    memory.close()


def test_close_writes_the_queue_or_says_how_many_are_lost(sqlite_folder: Outage) -> None:
    memory = CompletionMemory.open(sqlite_folder.url, embedder=HashEmbedder(),
                                   retry_interval_s=3600)
    with catching():
        sqlite_folder.down()
        rec(memory, "queued")
        sqlite_folder.up()
        memory.close()  # tries now, whatever the retry interval
    with SQLStore(sqlite_folder.url) as store:
        assert keys_in(store) == ["queued"]
    memory = CompletionMemory.open(sqlite_folder.url, embedder=HashEmbedder(), retry_interval_s=0)
    with catching() as caught:
        sqlite_folder.down()
        rec(memory, "one")
        rec(memory, "two")
        memory.close()
    said = fault_warnings(caught)
    assert len(said) == 2 and "2 queued completion(s) could not be written" in said[1]
    sqlite_folder.up()


MAX_NEW = 12


@pytest.mark.slow
def test_generate_answers_every_call_through_an_outage(outage: Outage, spec) -> None:
    """The real model: no call fails, each output is plain decoding's, and what was generated
    during the outage is in the store afterwards and drafts the next repeat."""
    from agentspec import Speculator
    from agentspec.drafters.policy import DEFAULT_COST
    from tests.prompts import ALL_PROMPTS

    prompts = [ALL_PROMPTS[i] for i in (2, 4, 8, 10, 13)]
    plain = Speculator(spec.target, speculate=False, memory=None)
    refs = [plain.generate(p, MAX_NEW).token_ids for p in prompts]
    memory = CompletionMemory.open(outage.url, embedder=HashEmbedder(), retry_interval_s=0,
                                   max_pending=BOUND)
    fast = Speculator(spec.target, memory=memory, cost=DEFAULT_COST)
    failed, outputs = 0, []
    with catching() as caught:
        outputs.append(fast.generate(prompts[0], MAX_NEW, scope="s").token_ids)
        memory.flush()  # the first call's record, written behind it, lands before the outage
        outage.down()
        for p in prompts[1:4]:
            try:
                outputs.append(fast.generate(p, MAX_NEW, scope="s").token_ids)
            except Exception:  # counted, not raised: the figure is the point
                failed += 1
        pending = memory.stats()["faults"]["records_pending"]
        outage.up()
        outputs.append(fast.generate(prompts[4], MAX_NEW, scope="s").token_ids)
        again = fast.generate(prompts[2], MAX_NEW, scope="s")
    assert failed == 0 and outputs == refs and again.token_ids == refs[2]
    assert pending == 3 and len(memory.store) == 5  # 0 lost
    assert again.stats.accepted.get("memory", 0) > 0  # recorded while down, drafting now
    faults = memory.stats()["faults"]
    assert faults["records_dropped"] == 0 and faults["records_flushed"] == 3 and faults["ok"]
    assert len(fault_warnings(caught)) == 1
    memory.close()


# --- faults that are not outages -------------------------------------------------------------
@contextmanager
def on_every_connection(store: SQLStore, hook: Callable[[object], None]) -> Iterator[None]:
    """Run ``hook(dbapi_connection)`` on each new connection of ``store`` while inside."""
    def connect(dbapi_conn: object, _record: object) -> None:
        hook(dbapi_conn)

    event.listen(store._engine, "connect", connect)
    store._engine.dispose()  # pooled connections reconnect through the hook
    try:
        yield
    finally:
        event.remove(store._engine, "connect", connect)
        store._engine.dispose()


def _execute(dbapi_conn: object, *statements: str) -> None:
    autocommit = getattr(dbapi_conn, "autocommit", None)
    if autocommit is False:  # psycopg: SET outside a transaction
        dbapi_conn.autocommit = True  # type: ignore[attr-defined]
    cur = dbapi_conn.cursor()  # type: ignore[attr-defined]
    for sql in statements:
        cur.execute(sql)
    cur.close()
    if autocommit is False:
        dbapi_conn.autocommit = False  # type: ignore[attr-defined]


def _read_only(dbapi_conn: object) -> None:
    if isinstance(dbapi_conn, sqlite3.Connection):
        _execute(dbapi_conn, "PRAGMA query_only = 1")
    else:
        _execute(dbapi_conn, "SET default_transaction_read_only = on")


def test_read_only_database_still_drafts_and_queues_its_writes(db_url: str) -> None:
    memory = CompletionMemory(SQLStore(db_url), embedder=HashEmbedder(), retry_interval_s=0,
                              max_pending=BOUND, sync_interval_s=0)
    rid = rec(memory, "known")
    with catching() as caught, on_every_connection(memory.store, _read_only):
        for i in range(BOUND + 2):
            assert memory.lookup("known", scope="s", model="m")[0][0].id == rid  # reads work
            assert rec(memory, f"new {i}") == -1
        faults = memory.stats()["faults"]
        assert faults["records_pending"] == BOUND and faults["records_dropped"] == 2
        assert faults["read_error"] is None and "read" in faults["write_error"].lower()
    said = fault_warnings(caught)
    assert len(said) == 1 and "make the database writable" in said[0]
    rec(memory, "writable again")
    assert keys_in(memory.store) == (["known"] + [f"new {i}" for i in range(2, BOUND + 2)]
                                     + ["writable again"])
    assert memory.stats()["faults"]["ok"]
    memory.store.close()


def test_full_disk_queues_and_writes_once_there_is_room(db_url: str) -> None:
    """SQLite: a real SQLITE_FULL (``max_page_count`` pinned to the pages in use). PostgreSQL:
    the driver's DiskFull error raised at the one seam where it cannot be provoked cheaply."""
    memory = CompletionMemory(SQLStore(db_url), embedder=HashEmbedder(), retry_interval_s=0,
                              max_pending=50)
    rec(memory, "small")
    big = "x" * 20_000  # several pages per row

    if db_url.startswith("sqlite"):
        def pin(dbapi_conn: object) -> None:
            pages = dbapi_conn.execute("PRAGMA page_count").fetchone()[0]  # type: ignore[attr-defined]
            _execute(dbapi_conn, f"PRAGMA max_page_count = {pages}")
        full = on_every_connection(memory.store, pin)
    else:
        full = _pg_disk_full(memory.store)
    with catching() as caught, full:
        results = [rec(memory, f"big {i}", text=big) for i in range(4)]
    assert results.count(-1) >= 1  # at least the last ones found the disk full
    said = fault_warnings(caught)
    assert len(said) == 1 and "free space on the disk" in said[0]
    rec(memory, "after")
    assert keys_in(memory.store) == ["small"] + [f"big {i}" for i in range(4)] + ["after"]
    memory.store.close()


@contextmanager
def _pg_disk_full(store: SQLStore) -> Iterator[None]:
    import psycopg

    def refuse(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.lstrip().upper().startswith(("INSERT", "UPDATE")):
            raise psycopg.errors.DiskFull('could not extend file "base/1/2": No space left on device')

    event.listen(store._engine, "before_cursor_execute", refuse)
    try:
        yield
    finally:
        event.remove(store._engine, "before_cursor_execute", refuse)


def test_write_lock_held_too_long_queues_and_reads_go_on(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    memory = CompletionMemory(SQLStore(f"sqlite:///{path}", busy_timeout_s=0.05),
                              embedder=HashEmbedder(), retry_interval_s=0, sync_interval_s=0)
    rid = rec(memory, "known")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    with catching() as caught:
        assert rec(memory, "while locked") == -1
        assert memory.lookup("known", scope="s", model="m")[0][0].id == rid  # WAL: reads go on
        other.execute("COMMIT")
        other.close()
        rec(memory, "unlocked")
    said = fault_warnings(caught)
    assert len(said) == 1 and "locked" in said[0] and "write lock" in said[0]
    assert keys_in(memory.store) == ["known", "while locked", "unlocked"]
    memory.store.close()


def test_bad_fault_options_are_refused() -> None:
    from agentspec.stores import InMemoryStore

    with pytest.raises(ValueError, match="max_pending"):
        CompletionMemory(InMemoryStore(), embedder=HashEmbedder(), max_pending=-1)
    with pytest.raises(ValueError, match="retry_interval_s"):
        CompletionMemory(InMemoryStore(), embedder=HashEmbedder(), retry_interval_s=-1)
