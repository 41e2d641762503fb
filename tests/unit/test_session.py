"""Sessions: stats and sources; observed_calls; the @record decorator (fake and real memory)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from agentspec.session import Session, observed_calls, record

sys.path.insert(0, str(Path(__file__).parents[1] / "adapters"))
from tests.adapters.adapter_fakes import FakeSpeculator, FakeTokenizer  # noqa: E402


class FakeMemory:
    """The one seam the decorator uses: ``record(*, scope, model, ...) -> int``."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def record(self, **row: Any) -> int:
        self.rows.append(row)
        return len(self.rows)


def test_session_sums_stats_and_collects_sources() -> None:
    spec = FakeSpeculator("abcdef")
    with spec.session("t", scope="s") as s:
        s.add_source("tool says hi")
        spec.generate("x", 6)
        spec.generate("y", 3)
    assert s.calls == 2 and s.stats.new_tokens == 9 and s.stats.accepted == {"prompt_lookup": 2}
    assert len(s.sources) == 3 and s.sources[0] == [ord(c) for c in "tool says hi"]
    with pytest.raises(ValueError, match="''"):
        Session(spec, "")
    with pytest.raises(ValueError, match="int"):
        s.add_source(3)  # type: ignore[arg-type]


def test_observed_calls_inside_and_outside_a_session() -> None:
    spec = FakeSpeculator("abc")
    with observed_calls(spec) as seen:
        spec.generate("x", 8)
    assert [g.text for g in seen] == ["abc"] and spec.calls[-1]["scope"] == "default"
    with spec.session("t", scope="mine") as s, observed_calls(spec) as seen:
        spec.generate("x", 8)
    assert len(seen) == 1 and s.calls == 1 and spec.calls[-1]["scope"] == "mine"


def test_record_sync_function_with_messages_and_prompt() -> None:
    memory, spec = FakeMemory(), FakeSpeculator()
    spec.target = type("T", (), {"fingerprint": "fake:123"})()  # type: ignore[attr-defined]

    @record(memory, scope="api-logs", speculator=spec)
    def api_model(prompt: Any) -> str:
        return "pong"

    msgs = [{"role": "user", "content": "ping"}]
    assert api_model(msgs) == "pong" and api_model("raw ping") == "pong"
    first, second = memory.rows
    assert first["scope"] == "api-logs" and first["model"] == "fake:123"
    assert first["key_text"] == "user: ping" and first["request_text"].endswith("assistant: ")
    assert first["completion_text"] == "pong" and first["completion_ids"] == [ord(c) for c in "pong"]
    assert second["request_text"] == second["key_text"] == "raw ping"


async def test_record_async_function_with_tokenizer_and_model() -> None:
    memory = FakeMemory()

    @record(memory, tokenizer=FakeTokenizer(), model="m:1")
    async def api_model(prompt: Any) -> str:
        return "ok"

    assert await api_model("hi") == "ok"
    assert memory.rows[0]["model"] == "m:1" and memory.rows[0]["scope"] == "default"


def test_record_refuses_bad_configuration_and_results() -> None:
    memory = FakeMemory()
    with pytest.raises(ValueError, match="exactly one"):
        record(memory)
    with pytest.raises(ValueError, match="model="):
        record(memory, tokenizer=FakeTokenizer())
    with pytest.raises(ValueError, match="scope"):
        record(memory, tokenizer=FakeTokenizer(), model="m", scope="")

    @record(memory, tokenizer=FakeTokenizer(), model="m")
    def bad(prompt: str) -> Any:
        return 42

    with pytest.raises(TypeError, match="int"):
        bad("x")


def test_record_into_a_real_completion_memory() -> None:
    from agentspec.memory.completion import CompletionMemory
    from agentspec.memory.embedder import HashEmbedder
    from agentspec.stores import InMemoryStore

    memory = CompletionMemory(InMemoryStore(), embedder=HashEmbedder())

    @record(memory, scope="warm", tokenizer=FakeTokenizer(), model="m:1")
    def api_model(messages: Any) -> str:
        return "SELECT 1;"

    api_model([{"role": "user", "content": "one"}])
    (rec, _score), = memory.lookup("user: one", scope="warm", model="m:1")
    assert rec.completion_text == "SELECT 1;" and rec.completion_ids == tuple(ord(c) for c in "SELECT 1;")


def test_first_token_seconds_add_up_like_seconds():
    from agentspec.types import GenerationStats

    a = GenerationStats(steps=2, new_tokens=4, seconds=1.0, first_token_seconds=0.25)
    b = GenerationStats(steps=1, new_tokens=1, seconds=0.5, first_token_seconds=0.5)
    assert (a + b).first_token_seconds == 0.75 and (a + b).as_dict()["first_token_seconds"] == 0.75
