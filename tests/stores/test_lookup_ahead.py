"""A lookup started ahead (``CompletionMemory.prefetch`` with a scope and model): it runs on
the memory's worker while the caller does other work, the lookup with the same arguments takes
its answer, and it never answers without a record written before that lookup."""

from __future__ import annotations

import threading

import pytest

from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores import InMemoryStore

ARGS = {"scope": "s", "model": "m", "k": 4, "min_similarity": 0.1}


class NotingStore(InMemoryStore):
    """Notes the thread of every row fetch; ``gate`` holds them until it opens."""

    def __init__(self):
        super().__init__()
        self.threads: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def get_many(self, ids):
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(10)
        return super().get_many(ids)


def _memory():
    return CompletionMemory(NotingStore(), embedder=HashEmbedder(), sync_interval_s=0.0)


def _drain(memory):
    """Wait for what the worker was handed so far (it runs in order)."""
    memory.worker.submit(lambda: None).result(timeout=10)


def _rec(memory, key, scope="s"):
    return memory.record(scope=scope, model="m", request_text=key, key_text=key,
                         completion_text=f"answer to {key}", completion_ids=[1, 2, 3])


def test_the_lookup_takes_the_answer_found_ahead_on_the_worker():
    memory = _memory()
    rid = _rec(memory, "user: list the files")
    store = memory.store
    store.gate.clear()  # the worker's fetch waits: the caller goes on meanwhile
    memory.prefetch("user: list the files please", **ARGS)
    memory.prefetch("user: list the files please", **ARGS)  # on its way: not started twice
    store.gate.set()
    hits = memory.lookup("user: list the files please", **ARGS)
    assert [r.id for r, _ in hits] == [rid]
    assert len(store.threads) == 1 and store.threads[0].startswith("agentspec-embed")
    # The answer is used once: the next lookup of the same arguments looks up itself.
    assert [r.id for r, _ in memory.lookup("user: list the files please", **ARGS)] == [rid]
    assert len(store.threads) == 2 and not store.threads[1].startswith("agentspec-embed")
    memory.close()


def test_other_arguments_or_a_record_written_since_are_looked_up_anew():
    memory = _memory()
    first = _rec(memory, "user: list the files")
    memory.prefetch("user: list the files please", **ARGS)
    other = dict(ARGS, k=2)
    memory.lookup("user: list the files please", **other)  # another k: not the answer ahead
    _drain(memory)
    assert len(memory.store.threads) == 2
    # A record of the scope written after the lookup started must be found by the lookup;
    # the answer found ahead may lack it, so it is discarded.
    second = _rec(memory, "user: list the files please")
    hits = memory.lookup("user: list the files please", **ARGS)
    assert {r.id for r, _ in hits} == {first, second}
    # A record written behind a call, after the prefetch, is found too.
    memory.prefetch("user: list all files", **ARGS)
    third = memory.record_behind(scope="s", model="m", request_text="r",
                                 key_text="user: list all files", completion_text="ls -a",
                                 completion_ids=[4, 5]).result(timeout=10)
    assert third in {r.id for r, _ in memory.lookup("user: list all files", **ARGS)}
    # A record of another scope leaves the answer ahead in place.
    memory.prefetch("user: list the files", **ARGS)
    _drain(memory)
    before = len(memory.store.threads)
    _rec(memory, "user: list the files", scope="elsewhere")
    memory.lookup("user: list the files", **ARGS)
    assert len(memory.store.threads) == before  # no fetch of its own: the answer ahead
    memory.close()


def test_a_variant_that_keeps_answers_across_records_misses_the_new_record(monkeypatch):
    # The check above must be able to fail: with the discard switched off, the lookup takes
    # the answer found before the record and misses it.
    memory = _memory()
    first = _rec(memory, "user: list the files")
    monkeypatch.setattr(memory, "_discard_ahead", lambda scope: None)
    memory.prefetch("user: list the files please", **ARGS)
    _drain(memory)
    _rec(memory, "user: list the files please")
    hits = memory.lookup("user: list the files please", **ARGS)
    assert {r.id for r, _ in hits} == {first}
    memory.close()


def test_a_failed_lookup_ahead_is_looked_up_again_where_its_error_is_met(monkeypatch):
    memory = _memory()
    _rec(memory, "user: hello")
    calls = []
    nearest = memory._nearest

    def flaky(*args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise RuntimeError("index down")
        return nearest(*args, **kwargs)

    monkeypatch.setattr(memory, "_nearest", flaky)
    memory.prefetch("user: hello", **ARGS)
    hits = memory.lookup("user: hello", **ARGS)
    assert len(hits) == 1 and len(calls) == 2 and calls[0].startswith("agentspec-embed")
    memory.prefetch("user: hello", **ARGS)
    monkeypatch.setattr(memory, "_nearest", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("index down")))
    with pytest.raises(RuntimeError, match="index down"):
        memory.lookup("user: hello", **ARGS)
    memory.close()
