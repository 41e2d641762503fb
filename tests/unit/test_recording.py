"""Turning recording off: a call's ``record=``, ``SpecConfig.record`` and ``AGENTSPEC_RECORD``
(a switch above both). Tiny model, in-memory store; the memory's writes settle before counting."""

from __future__ import annotations

import pytest

from agentspec import SpecConfig, Speculator
from agentspec.drafters.policy import CostModel
from agentspec.engine.target import HFTarget
from agentspec.home import recording_allowed
from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores import InMemoryStore
from tests.tiny_model import DecodingTokenizer, tiny_target


@pytest.fixture(scope="module")
def target() -> HFTarget:
    base = tiny_target(5)
    return HFTarget(base.model, DecodingTokenizer(), name="tiny-record")


def _recorded(target: HFTarget, calls: list[bool | None], **config: bool) -> int:
    spec = Speculator(target, memory=CompletionMemory(InMemoryStore(), embedder=HashEmbedder()),
                      config=SpecConfig(**config), cost=CostModel(base=0.05, per_token=0.001))
    for i, record in enumerate(calls):
        spec.generate(f"1 2 {4 + i}", 6, scope="s", record=record)  # non-empty completions
    memory = spec.memory
    memory.worker.settle()  # writes handed behind the calls are in
    return len(list(memory.records(scope="s")))


def test_a_call_and_the_setting_decide_and_the_environment_overrides_both(target, monkeypatch):
    monkeypatch.delenv("AGENTSPEC_RECORD", raising=False)
    assert _recorded(target, [None, True, False]) == 2  # default on; a call may say no
    assert _recorded(target, [None, True, False], record=False) == 1  # default off; a call may say yes
    monkeypatch.setenv("AGENTSPEC_RECORD", "0")
    assert _recorded(target, [None, True, False]) == 0  # off for the process, whatever is asked
    monkeypatch.setenv("AGENTSPEC_RECORD", "yes")
    assert _recorded(target, [True]) == 1


def test_a_bad_switch_value_is_named(monkeypatch):
    monkeypatch.setenv("AGENTSPEC_RECORD", "maybe")
    with pytest.raises(ValueError, match="AGENTSPEC_RECORD.*'maybe'"):
        recording_allowed()
    with pytest.raises(ValueError, match="record must be True or False"):
        SpecConfig(record="no")  # type: ignore[arg-type]


def test_both_constructors_open_the_home_memory_by_default(target, tmp_path, monkeypatch):
    """``Speculator(target)`` records where ``from_pretrained`` does (issue: the two differed);
    ``memory=None`` is the way out, for both."""
    import inspect

    from agentspec.adapters.langchain import ChatAgentSpec

    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    monkeypatch.delenv("AGENTSPEC_DB", raising=False)
    spec = Speculator(target, cost=CostModel(base=0.05, per_token=0.001))
    assert isinstance(spec.memory, CompletionMemory)
    assert spec.memory.store.url == f"sqlite:///{tmp_path / 'memory.db'}"
    spec.memory.close()
    defaults = {f.__qualname__: inspect.signature(f).parameters["memory"].default
                for f in (Speculator.__init__, Speculator.from_pretrained,
                          ChatAgentSpec.from_pretrained)}
    assert set(defaults.values()) == {"default"}, defaults
    assert Speculator(target, memory=None, cost=CostModel(base=0.05, per_token=0.001)).memory is None
