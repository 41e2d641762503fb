"""Backpressure: a bounded queue answers 429 with Retry-After; a request past its timeout
stops with a 504 (a stream: an error event, then [DONE]); a request not streamed whose client
leaves stops too. "Stops" is shown by the memory: a generation that runs to its end records
its completion, a stopped one records nothing, and the controls show the recording happens."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from agentspec.adapters.lifecycle import POLL_S, ServiceConfig, Ticket
from agentspec.adapters.openai_protocol import ApiError
from tests.server.inproc import (
    KEY,
    MODEL,
    chat,
    scrape,
    serving,
    speculator,
    stream_events,
    total,
    user,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
LONG = "Write a long story about a dragon who learns to fly."
CHAT = "/v1/chat/completions"


def _burst(live: Any, n: int) -> list[httpx.Response]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: chat(live, f"Tell me a fact about the number {i}.",
                                            max_tokens=12), range(n)))


def test_a_full_queue_answers_429_with_retry_after(spec: Any) -> None:
    """One request runs (max_batch 1), one may wait (max_queue 1): of six at once, the rest
    get a 429; every request is answered and counted. The control: the same burst without
    the bound is all 200s."""
    one = speculator(spec, memory=False, max_batch=1)
    with serving(one, ServiceConfig(max_queue=1)) as live:
        answers = _burst(live, 6)
        samples = scrape(live)
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 429} and codes.count(200) >= 2 and codes.count(429) >= 1, codes
    for res in answers:
        if res.status_code == 429:
            error = res.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
            assert "--max-queue 1" in error["message"]
            assert int(res.headers["Retry-After"]) >= 1
    assert total(samples, "agentspec_requests_total", endpoint=CHAT, status="429") == \
        codes.count(429)
    assert total(samples, "agentspec_requests_total", endpoint=CHAT) == len(answers)
    with serving(one) as unbounded:
        assert [r.status_code for r in _burst(unbounded, 6)] == [200] * 6


def _rows(spec: Any, scope: str) -> int:
    spec.memory.flush()  # the writes handed behind the calls, done
    return int(spec.memory.store.count(scope=scope))


def test_a_request_past_its_timeout_stops_with_504(spec: Any) -> None:
    """The control: the long request run to its end on a server without a timeout (it is
    recorded). With a timeout of a quarter of its time, the same request, plain and
    streamed, stops soon after the deadline, and nothing of it is recorded."""
    fast = speculator(spec)
    with serving(fast) as live:
        started = time.monotonic()
        full = chat(live, LONG, max_tokens=48, headers={"X-Agentspec-Scope": "full"})
        took = time.monotonic() - started
    assert full.status_code == 200 and full.json()["usage"]["completion_tokens"] == 48
    timeout = took / 4
    with serving(fast, ServiceConfig(request_timeout=timeout)) as live:
        started = time.monotonic()
        res = chat(live, LONG, max_tokens=48, headers={"X-Agentspec-Scope": "slow"})
        stopped_after = time.monotonic() - started
        events = stream_events(live, LONG, max_tokens=48,
                               headers={"X-Agentspec-Scope": "slow-stream"})
        samples = scrape(live)
    assert res.status_code == 504, res.text
    error = res.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "request_timeout")
    assert "--request-timeout" in error["message"]
    assert stopped_after < took * 3 / 4  # stopped soon after the deadline, not at its end
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert not any("usage" in e for e in events if isinstance(e, dict))  # it never finished
    assert _rows(fast, "full") == 1  # a request that ends is recorded (the control) ...
    assert _rows(fast, "slow") == _rows(fast, "slow-stream") == 0  # ... stopped ones are not
    assert total(samples, "agentspec_requests_stopped_total", reason="timeout") == 2
    assert fast.generate("Say hi.", 2).token_ids  # the engine is free: nothing left stuck


def _post_and_leave(url: str, scope: str, after_s: float) -> None:
    """A request not streamed, its socket closed ``after_s`` seconds after it was sent."""
    parts = urlsplit(url)
    body = json.dumps({"model": MODEL, "messages": user(LONG), "max_tokens": 32,
                       "temperature": 0}).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nX-Agentspec-Scope: {scope}\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(after_s)


def test_a_client_that_leaves_stops_its_request(spec: Any) -> None:
    """The control runs the same request to its end (and it is recorded); the one whose
    client leaves is stopped: after twice the control's time nothing of it is recorded,
    and it is counted as stopped by a disconnect (499)."""
    fast = speculator(spec)
    with serving(fast) as live:
        started = time.monotonic()
        full = chat(live, LONG, max_tokens=32, headers={"X-Agentspec-Scope": "stayed"})
        took = time.monotonic() - started
        assert full.status_code == 200 and full.json()["usage"]["completion_tokens"] == 32
        _post_and_leave(live.url, "left", after_s=min(0.5, took / 4))
        deadline = time.monotonic() + 2 * took
        while time.monotonic() < deadline and not fast.memory.store.count(scope="left"):
            time.sleep(0.1)
        samples = scrape(live)
    assert _rows(fast, "stayed") == 1
    assert _rows(fast, "left") == 0
    assert total(samples, "agentspec_requests_stopped_total", reason="disconnect") == 1
    assert total(samples, "agentspec_requests_total", endpoint=CHAT, status="499") == 1


class _Client:
    """A request double whose client leaves at ``left_at`` (time.monotonic())."""

    def __init__(self, left_at: float) -> None:
        self.left_at = left_at

    async def is_disconnected(self) -> bool:
        return time.monotonic() >= self.left_at


async def _ticking(closed: asyncio.Event) -> AsyncIterator[int]:
    """Items every 10 ms, faster than the client is polled, without end."""
    i = 0
    try:
        while True:
            await asyncio.sleep(0.01)
            yield i
            i += 1
    finally:
        closed.set()


@pytest.mark.parametrize("why", ["disconnect", "timeout"])
async def test_a_fast_stream_is_stopped_too(why: str) -> None:
    """Items arriving faster than the poll interval do not hide a client that left or a
    deadline that passed (a guard that looked only while waiting for a slow item would run
    on here until the test's own timeout)."""
    closed = asyncio.Event()
    ticket = Ticket(0.2 if why == "timeout" else None)
    client = _Client(time.monotonic() + (0.2 if why == "disconnect" else 60))
    started = time.monotonic()
    with pytest.raises(ApiError) as stop:
        async with asyncio.timeout(10):
            async for _ in ticket.guard(_ticking(closed), client):  # type: ignore[arg-type]
                pass
    assert ticket.reason == why and stop.value.status == {"disconnect": 499, "timeout": 504}[why]
    assert time.monotonic() - started < 0.2 + POLL_S + 0.5
    assert closed.is_set()  # the items were closed
