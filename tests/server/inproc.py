"""An ``agentspec serve`` server in this process: the real app behind uvicorn's
:class:`~agentspec.adapters.lifecycle.DrainingServer` on a free loopback port, in a thread,
over a Speculator sharing the session's loaded model. The metrics, backpressure and drain
tests use it; what needs a process of its own (signals, a kill) starts one
(:func:`tests.server.conftest.start_server`).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

pytest.importorskip("prometheus_client", reason="the server needs: pip install 'agentspec-llm[serve]'")

import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from agentspec import Speculator  # noqa: E402
from agentspec.adapters.lifecycle import DrainingServer, ServiceConfig  # noqa: E402
from agentspec.adapters.openai_server import OpenAIServer, ServerConfig  # noqa: E402
from agentspec.config import SpecConfig  # noqa: E402
from agentspec.drafters.policy import DEFAULT_COST  # noqa: E402
from agentspec.memory.completion import CompletionMemory  # noqa: E402
from agentspec.memory.embedder import HashEmbedder  # noqa: E402
from agentspec.stores import InMemoryStore  # noqa: E402

MODEL = "m"
KEY = "inproc-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Live:
    """A running in-process server: its base URL (``.../v1``), the app's object, uvicorn's."""

    url: str
    server: OpenAIServer
    uv: DrainingServer
    thread: threading.Thread

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")


def speculator(spec: Any, *, memory: bool = True, max_batch: int = 16) -> Speculator:
    """A Speculator on the session's loaded model: a fresh in-memory completion memory
    (hash embeddings: no embedding model), the default cost curve (nothing measured)."""
    store = CompletionMemory(InMemoryStore(), embedder=HashEmbedder()) if memory else None
    return Speculator(spec.target, memory=store, cost=DEFAULT_COST,
                      config=SpecConfig(max_batch=max_batch))


@contextmanager
def serving(spec: Speculator, service: ServiceConfig | None = None, **config: Any
            ) -> Iterator[Live]:
    """Serve ``spec`` (keyed by :data:`KEY`, model name :data:`MODEL`) until the block ends."""
    server = OpenAIServer(spec, ServerConfig(models=(MODEL,), api_keys=frozenset({KEY}),
                                             **config), service)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    uv = DrainingServer(uvicorn.Config(server.app, log_level="warning", lifespan="off",
                                       timeout_graceful_shutdown=5), server.lifecycle)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = sock.getsockname()[1]
    try:
        yield Live(f"http://127.0.0.1:{port}/v1", server, uv, thread)
    finally:
        uv.should_exit = True
        thread.join(30)
        server.close()
        sock.close()


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def chat(live: Live, text: str, *, timeout: float = 120, headers: dict[str, str] | None = None,
         **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": user(text), "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(f"{live.url}/chat/completions", json=body, timeout=timeout,
                      headers={**AUTH, **(headers or {})})


def stream_events(live: Live, text: str, *, headers: dict[str, str] | None = None,
                  **fields: Any) -> list[Any]:
    """A streamed request's events, decoded (``[DONE]`` kept as the string)."""
    body = {"model": MODEL, "messages": user(text), "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **fields}
    events: list[Any] = []
    with httpx.stream("POST", f"{live.url}/chat/completions", json=body, timeout=120,
                      headers={**AUTH, **(headers or {})}) as res:
        assert res.status_code == 200, res.read()
        for line in res.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def scrape(live: Live, *, key: bool = True) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as ``{(sample name, sorted labels): value}``."""
    res = httpx.get(f"{live.root}/metrics", headers=AUTH if key else {}, timeout=30)
    assert res.status_code == 200, res.text
    assert res.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(res.text) for s in family.samples}


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, have), v in samples.items()
               if n == name and set(labels.items()) <= set(have))
