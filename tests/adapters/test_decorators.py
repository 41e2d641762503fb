"""@tool_loop: one session per call of the decorated function; threads and tasks isolated."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from agentspec.adapters.decorators import current, tool_loop
from agentspec.adapters.langchain import ChatAgentSpec
from tests.adapters.adapter_fakes import FakeSpeculator


def test_sync_function_runs_in_one_session(fake_spec: FakeSpeculator) -> None:
    @tool_loop(fake_spec, scope="sql-agent")
    def agent(task: str) -> Any:
        s = current(fake_spec)
        assert s is not None and s.name.endswith("agent")
        fake_spec.generate(task, 8)
        s.add_source("tool output")
        fake_spec.generate(task, 8)
        return s

    s = agent("hi")
    assert current(fake_spec) is None
    assert s.calls == 2 and s.stats.new_tokens == 16 and s.stats.steps == 6
    assert [c["scope"] for c in fake_spec.calls] == ["sql-agent", "sql-agent"]
    # the second call drafts from the first completion and the added tool output
    assert [c["sources"] for c in fake_spec.calls] == [0, 2]
    assert agent.__name__ == "agent"


async def test_async_function_and_langchain_calls_join_the_session(fake_spec: FakeSpeculator) -> None:
    chat = ChatAgentSpec(speculator=fake_spec)

    @tool_loop(fake_spec, scope="planner", name="plan")
    async def agent() -> Any:
        await chat.ainvoke("a")
        _ = [c async for c in chat.astream("b")]
        chat.invoke("c")
        return current(fake_spec)

    s = await agent()
    assert s.name == "plan" and s.calls == 3
    assert {c["scope"] for c in fake_spec.calls} == {"planner"}


def test_nested_decorated_helpers_join_the_outer_session(fake_spec: FakeSpeculator) -> None:
    @tool_loop(fake_spec, scope="inner")
    def helper() -> Any:
        fake_spec.generate("x", 4)
        return current(fake_spec)

    @tool_loop(fake_spec, scope="outer")
    def agent() -> Any:
        inner = helper()
        assert current(fake_spec) is inner
        return inner

    s = agent()
    assert s.scope == "outer" and s.calls == 1 and current(fake_spec) is None


def test_bad_options_are_named(fake_spec: FakeSpeculator) -> None:
    with pytest.raises(ValueError, match="''"):
        tool_loop(fake_spec, scope="")
    with pytest.raises(ValueError, match="''"):
        tool_loop(fake_spec, scope="x", name="")


def _isolated_agent(spec: FakeSpeculator, i: int) -> Any:
    @tool_loop(spec, scope=f"tenant-{i}")
    def agent() -> Any:
        s = current(spec)
        for _ in range(i % 3 + 1):
            ChatAgentSpec(speculator=spec).invoke(f"q{i}")
        assert current(spec) is s
        return s

    return agent


def test_eight_threads_stay_isolated() -> None:
    spec = FakeSpeculator()
    with ThreadPoolExecutor(8) as pool:
        sessions = list(pool.map(lambda i: _isolated_agent(spec, i)(), range(8)))
    for i, s in enumerate(sessions):
        assert s.scope == f"tenant-{i}" and s.calls == i % 3 + 1
        assert s.stats.new_tokens == (i % 3 + 1) * len(spec.reply)
    assert sorted(c["scope"] for c in spec.calls) == sorted(
        f"tenant-{i}" for i in range(8) for _ in range(i % 3 + 1))


async def test_eight_asyncio_tasks_stay_isolated() -> None:
    spec = FakeSpeculator()

    def make(i: int) -> Any:
        @tool_loop(spec, scope=f"tenant-{i}")
        async def agent() -> Any:
            s = current(spec)
            for _ in range(i % 3 + 1):
                await ChatAgentSpec(speculator=spec).ainvoke(f"q{i}")
                await asyncio.sleep(0)
            assert current(spec) is s
            return s
        return agent

    sessions = await asyncio.gather(*(make(i)() for i in range(8)))
    for i, s in enumerate(sessions):
        assert s.scope == f"tenant-{i}" and s.calls == i % 3 + 1


@pytest.mark.slow
def test_real_model_threads_keep_their_own_session_stats(real_spec: Any) -> None:
    def run(i: int) -> Any:
        @tool_loop(real_spec, scope=f"real-{i}")
        def agent() -> Any:
            real_spec.generate("Count: 1, 2, 3,", 4)
            return current(real_spec)
        return agent()

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(run, range(2))
    assert (a.scope, b.scope) == ("real-0", "real-1")
    assert a.calls == b.calls == 1 and 1 <= a.stats.new_tokens <= 4 and a.stats.steps >= 1
