"""A streamed OpenAI chat call, timed: the one client of :mod:`agentspec.bench.servers`.

Standard library only (``http.client``), so the bench times the servers, not a client library,
and needs nothing beyond the core. Every call is streamed (``stream: true`` with
``stream_options.include_usage``): its time to first token is the time to the first chunk that
carries content or a tool call, its latency the time to ``[DONE]``.

What a server says of its steps is read where it says it: agentspec's last chunk carries
``agentspec.stats.steps``; llama.cpp's carries ``timings`` (``predicted_n``, and with its own
speculation ``draft_n_accepted``: every step commits its accepted draft tokens and one more,
so steps = ``predicted_n - draft_n_accepted``; it leaves the draft counts out when it drafted
nothing). A server that says neither has no steps.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class ServerGone(ConnectionError):
    """The server refused, dropped or broke a call (it died, or was never up)."""


@dataclass(frozen=True)
class Answer:
    """One streamed chat completion, as the client saw it.

    Attributes:
        text: the content deltas, joined.
        tool_calls: the calls, each ``{"name": ..., "arguments": <the JSON text>}``, in order.
        completion_tokens: the server's ``usage.completion_tokens`` (else the count of content
            chunks, an estimate the report marks by ``counted``).
        seconds: from sending the request to ``[DONE]``.
        first_token_seconds: from sending the request to the first content or tool-call delta
            (``seconds`` when there was none).
        steps: forward steps the server says it took, or None.
        counted: True when ``completion_tokens`` came from the server's usage.
        finish_reason: the last choice's ``finish_reason``.
    """

    text: str
    tool_calls: tuple[dict[str, str], ...]
    completion_tokens: int
    seconds: float
    first_token_seconds: float
    steps: int | None
    counted: bool
    finish_reason: str | None

    def output(self) -> str:
        """What the answer said, for comparing answers: the text and the calls."""
        if not self.tool_calls:
            return self.text
        return self.text + "\x00" + json.dumps(list(self.tool_calls), sort_keys=True)


def _steps(chunk: dict[str, Any]) -> int | None:
    stats = (chunk.get("agentspec") or {}).get("stats") or {}
    if isinstance(stats.get("steps"), int):
        return int(stats["steps"])
    timings = chunk.get("timings") or {}
    if isinstance(timings.get("predicted_n"), int):  # no draft_n_*: nothing was drafted
        return int(timings["predicted_n"]) - int(timings.get("draft_n_accepted") or 0)
    return None


class _Stream:
    """The state of one streamed answer, chunk by chunk."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}
        self.usage: int | None = None
        self.steps: int | None = None
        self.finish: str | None = None
        self.first: float | None = None
        self.chunks = 0

    def take(self, chunk: dict[str, Any], now: float) -> None:
        if isinstance(chunk.get("usage"), dict):
            tokens = chunk["usage"].get("completion_tokens")
            self.usage = tokens if isinstance(tokens, int) else self.usage
        steps = _steps(chunk)
        self.steps = steps if steps is not None else self.steps
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            self.finish = choice.get("finish_reason") or self.finish
            if delta.get("content"):
                self.text.append(delta["content"])
                self.chunks += 1
                self.first = now if self.first is None else self.first
            for part in delta.get("tool_calls") or ():
                call = self.calls.setdefault(int(part.get("index", len(self.calls))),
                                             {"name": "", "arguments": ""})
                fn = part.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
                self.first = now if self.first is None else self.first

    def answer(self, seconds: float) -> Answer:
        return Answer(text="".join(self.text),
                      tool_calls=tuple(self.calls[i] for i in sorted(self.calls)),
                      completion_tokens=self.usage if self.usage is not None else self.chunks,
                      seconds=seconds,
                      first_token_seconds=seconds if self.first is None else self.first,
                      steps=self.steps, counted=self.usage is not None, finish_reason=self.finish)


def chat(base_url: str, body: dict[str, Any], *, timeout: float = 600.0,
         api_key: str | None = None) -> Answer:
    """POST ``body`` to ``{base_url}/chat/completions`` streamed, and read the answer whole.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000/v1``.
        body: the request; ``stream`` and ``stream_options`` are set here.
        timeout: seconds a read may wait.
        api_key: sent as a bearer token when given.

    Raises:
        ServerGone: the connection was refused or dropped before ``[DONE]``.
        RuntimeError: the server answered with an HTTP error (its status and body named).
    """
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                      timeout=timeout)
    payload = json.dumps({**body, "stream": True,
                          "stream_options": {"include_usage": True}}).encode()
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    stream = _Stream()
    started = time.perf_counter()
    try:
        conn.request("POST", url.path.rstrip("/") + "/chat/completions", payload, headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{base_url} answered HTTP {response.status}: "
                               f"{response.read(2000).decode(errors='replace')}")
        done = False
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            stream.take(json.loads(data), time.perf_counter() - started)
        if not done:
            raise ServerGone(f"{base_url} closed the stream before [DONE]")
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        if isinstance(e, ServerGone):
            raise
        raise ServerGone(f"{base_url}: {type(e).__name__}: {e}") from e
    finally:
        conn.close()
    return stream.answer(time.perf_counter() - started)
