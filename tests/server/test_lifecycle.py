"""The server's lifecycle: a drain on SIGTERM (503s and /ready for new requests, the ones in
flight finished, the rest stopped after the grace, the memory's writes flushed, exit 0), a
kill -9 mid-request and a restart on the same memory (no committed row lost or torn, the
index consistent at start), and the start's index check itself."""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentspec.adapters.lifecycle import ServiceConfig, check_memory, shut_down
from agentspec.errors import MemoryFaultWarning
from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.memory.index import index_paths
from agentspec.stores.memory_store import content_hash
from agentspec.types import Record
from tests.server.conftest import MASTER_KEY, MODEL, Server, start_server
from tests.server.inproc import chat, serving, speculator, stream_events

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
AUTH = {"Authorization": f"Bearer {MASTER_KEY}"}
LONG = "Write a long story about a dragon who learns to fly."


def _wait(condition: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# --- in this process: the drain without a signal's delivery (DrainingServer.handle_exit) ----

def test_sigterm_drains_the_requests_in_flight_and_refuses_new_ones(spec: Any) -> None:
    fast = speculator(spec)
    with serving(fast, ServiceConfig(grace=60)) as live, ThreadPoolExecutor(2) as pool:
        running = [pool.submit(chat, live, f"Count to {n} in French.", max_tokens=16,
                               headers={"X-Agentspec-Scope": "drain"}) for n in (5, 6)]
        _wait(lambda: len(live.server.lifecycle.tickets) == 2, "two requests in flight")
        live.uv.handle_exit(signal.SIGTERM, None)
        refused = chat(live, "Say hi.", max_tokens=2)
        ready = httpx.get(f"{live.root}/ready", timeout=30)
        health = httpx.get(f"{live.root}/health", timeout=30)
        answers = [f.result() for f in running]
        live.thread.join(60)
        assert not live.thread.is_alive()  # it stopped by itself once drained
        shut_down(live.server.executor, fast.memory)  # as serve does after the server
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert int(refused.headers["Retry-After"]) >= 1
    assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
    assert health.status_code == 200
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [16, 16]
    assert fast.memory.store.count(scope="drain") == 2  # both written (behind), then flushed


def test_the_grace_ends_with_the_rest_stopped(spec: Any) -> None:
    """A stream still running when the grace ends gets an error event and [DONE]; it is
    not recorded, and the server exits."""
    fast = speculator(spec)
    with serving(fast, ServiceConfig(grace=0.2)) as live, ThreadPoolExecutor(1) as pool:
        events = pool.submit(stream_events, live, LONG, max_tokens=48,
                             headers={"X-Agentspec-Scope": "cut"})
        _wait(lambda: len(live.server.lifecycle.tickets) == 1, "a stream in flight")
        live.uv.handle_exit(signal.SIGTERM, None)
        got = events.result()
        live.thread.join(60)
        assert not live.thread.is_alive()
        shut_down(live.server.executor, fast.memory)
    assert got[-1] == "[DONE]" and got[-2]["error"]["code"] == "shutting_down"
    assert fast.memory.store.count(scope="cut") == 0


@pytest.mark.parametrize(("field", "value"), [("max_queue", -1), ("max_queue", 1.5),
                                               ("request_timeout", 0), ("grace", -2.0),
                                               ("grace", float("nan"))])
def test_bad_service_settings_are_refused_naming_them(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        ServiceConfig(**{field: value})


# --- the start's index check ------------------------------------------------------------------

def _record(memory: CompletionMemory, scope: str, text: str) -> int:
    return memory.record(scope=scope, model="m", request_text=text, key_text=text,
                         completion_text=f"answer to {text}", completion_ids=(1, 2, 3))


def test_the_start_check_makes_every_index_hold_the_stores_rows(tmp_path: Path) -> None:
    url, index_dir = f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "index"
    with CompletionMemory.open(url, embedder=HashEmbedder(), index_dir=index_dir) as memory:
        old = [_record(memory, "a", f"question {i}") for i in range(4)]
        _record(memory, "b", "another question")
        b_file, _ = index_paths(index_dir, "b", memory.embedder.name, str(memory.store.url))
    # Behind the saved files' back (another process, killed before it saved its own): rows
    # deleted and added in "a"; and the file of "b" made garbage.
    with CompletionMemory.open(url, embedder=HashEmbedder()) as other:
        other.store.delete(old[:2])
        _record(other, "a", "a later question")
    b_file.write_bytes(b"\x00garbage" * 100)
    memory = CompletionMemory.open(url, embedder=HashEmbedder(), index_dir=index_dir)
    try:
        assert memory.stats()["indexes"] == {}  # nothing loaded before the check
        with pytest.warns(MemoryFaultWarning, match="rebuilding it from the store"):
            assert check_memory(memory) == {"a": 3, "b": 1}
        hits = memory.lookup("a later question", scope="a", model="m", k=1)
        assert hits and hits[0][0].key_text == "a later question"
        # Between two row counts the memory trusts its index: one that lost a vector in
        # this process stays short after a plain sync; the start check rebuilds it.
        memory._indexes[("a", memory.embedder.name)].index.remove([old[2]])
        memory.search("anything", k=1)
        assert memory.stats()["indexes"]["a"] == 2  # what a check that only syncs leaves
        assert check_memory(memory) == {"a": 3, "b": 1}
    finally:
        memory.close()


# --- a real process: kill -9 mid-request, restart on the same memory, then SIGTERM ----------

PROMPTS = ["Name three fruits.", "Name three rivers.", "Name three mountains."]


def _ask(server: Server, text: str, max_tokens: int = 12) -> httpx.Response:
    return httpx.post(f"{server.url}/chat/completions", headers=AUTH, timeout=120,
                      json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                            "max_tokens": max_tokens, "temperature": 0})


def _rows(db: str) -> list[tuple[Any, ...]]:
    path = db.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return conn.execute("SELECT scope, model, key_text, completion_text, completion_ids, "
                            "num_tokens, embedding, dim, content_hash FROM agentspec_records "
                            "ORDER BY id").fetchall()


def _whole(row: tuple[Any, ...], tokenizer: Any) -> bool:
    """A row as it was written: its token ids its text, its counts and hash its own."""
    scope, model, key, text, ids_blob, num_tokens, embedding, dim, digest = row
    ids = [int.from_bytes(ids_blob[i:i + 4], "little", signed=True)
           for i in range(0, len(ids_blob), 4)]
    record = Record(scope=scope, model=model, request_text="", key_text=key,
                    completion_text=text, completion_ids=tuple(ids))
    return (len(ids_blob) == 4 * num_tokens and len(embedding) == 4 * dim and dim > 0
            and tokenizer.decode(ids) == text and content_hash(record) == digest)


def _stream_until_first_text(server: Server, text: str, started: threading.Event) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 48,
            "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{server.url}/chat/completions", headers=AUTH, json=body,
                          timeout=120) as res:
            for line in res.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                        "content"):
                    started.set()
    except httpx.HTTPError:
        pass  # the server was killed under it


def test_kill_mid_request_restart_then_sigterm(tmp_path: Path) -> None:
    pytest.importorskip("uvicorn", reason="the server needs: pip install 'agentspec-llm[serve]'")
    from transformers import AutoTokenizer

    from agentspec.engine.load import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(MODEL)[1])
    first = start_server(tmp_path, "--max-tokens", "48", "--grace", "60")
    try:
        answers = [_ask(first, text) for text in PROMPTS]
        assert [a.status_code for a in answers] == [200] * 3
        _wait(lambda: len(_rows(first.db)) == 3, "the three records written behind")
        flags = [threading.Event() for _ in range(2)]
        streams = [threading.Thread(target=_stream_until_first_text, args=(first, t, f))
                   for t, f in zip((LONG, LONG.replace("dragon", "whale")), flags, strict=True)]
        for t in streams:
            t.start()
        _wait(lambda: all(f.is_set() for f in flags), "two streams answering")
        first.proc.send_signal(signal.SIGKILL)
        assert first.proc.wait(30) == -signal.SIGKILL
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
    for t in streams:
        t.join(30)
    rows = _rows(first.db)
    assert len(rows) == 3 and all(_whole(r, tokenizer) for r in rows)  # none lost, none torn
    assert sorted(r[3] for r in rows) == sorted(a.json()["choices"][0]["message"]["content"]
                                                for a in answers)

    second = start_server(tmp_path, "--max-tokens", "48", "--grace", "60")
    try:
        log = second.log_tail(20000)
        assert "memory: 1 scope(s), 3 indexed rows" in log, log
        assert "Traceback" not in log and "MemoryFaultWarning" not in log, log
        again = _ask(second, PROMPTS[0])  # found through the index the start checked
        assert again.json()["choices"][0]["message"] == answers[0].json()["choices"][0]["message"]
        assert again.json()["agentspec"]["stats"]["drafted_by_source"].get("memory", 0) > 0

        with ThreadPoolExecutor(2) as pool:
            running = [pool.submit(_ask, second, f"Tell a long tale number {n}.", 48)
                       for n in (1, 2)]
            _wait(lambda: _metric(second, "agentspec_requests_running") == 2, "two in flight")
            second.proc.send_signal(signal.SIGTERM)
            refused = _ask(second, "Say hi.", 2)
            ready = httpx.get(second.url.removesuffix("/v1") + "/ready", timeout=30)
            finished = [f.result() for f in running]
        assert second.proc.wait(90) == 0, second.log_tail()
    finally:
        if second.proc.poll() is None:
            second.proc.kill()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert ready.status_code == 503
    assert [f.status_code for f in finished] == [200, 200]
    rows = _rows(second.db)
    assert len(rows) == 3 + 2 and all(_whole(r, tokenizer) for r in rows)  # flushed at exit
    assert list((tmp_path / "home" / "index").glob("*.faiss"))  # the index saved at exit


def _metric(server: Server, name: str) -> float:
    res = httpx.get(server.url.removesuffix("/v1") + "/metrics", headers=AUTH, timeout=30)
    for line in res.text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
