"""The transformers systems on the real model (slow: it loads): ``hf-static`` (a static KV,
compiled where transformers compiles) gives hf-greedy's tokens in fp32 on the CPU, falls back
when compiling fails, and leaves the shared model as it found it."""

from __future__ import annotations

import pytest

from agentspec.bench.hf import STATIC_STATE, HFStaticSystem, HFSystem
from agentspec.bench.workload import WorkloadItem

pytestmark = pytest.mark.slow

ITEMS = [
    WorkloadItem(id="grounded-0", messages=(
        {"role": "user", "content": 'Repeat exactly: {"city": "Paris", "unit": "c"}'},)),
    WorkloadItem(id="open-0", prompt="The three primary colors are"),
]
BUDGET = 8


def _outputs(system: HFSystem) -> list[tuple[int, ...]]:
    return [system.run(item, BUDGET, None).token_ids for item in ITEMS]


def _model_state(model) -> tuple[dict, dict]:
    return (model.generation_config.to_dict(),
            {k: getattr(model, k) for k in STATIC_STATE if hasattr(model, k)})


@pytest.fixture
def greedy(spec) -> list[tuple[int, ...]]:
    return _outputs(HFSystem("hf-greedy", spec, temperature=0.0))


def test_hf_static_equals_hf_greedy_in_fp32_and_leaves_the_model_alone(spec, greedy) -> None:
    model = spec.target.model
    assert str(next(model.parameters()).dtype) == "torch.float32"
    assert spec.target.device.type == "cpu"
    before = _model_state(model)
    static = HFStaticSystem("hf-static", spec, temperature=0.0, max_cache_len=200)
    static.warm(ITEMS[0], BUDGET)
    assert _outputs(static) == greedy and all(greedy)
    assert _model_state(model) == before  # no generation_config change, no static-KV state
    assert static._state.get("_previous_max_cache_length") == 200  # it is hf-static's own
    assert static.note is not None and "without torch.compile" in static.note  # CPU: no compile


def test_the_models_own_static_state_is_put_back(spec) -> None:
    model = spec.target.model
    model._previous_max_cache_length = 3  # as if someone else had run a static generate
    try:
        HFStaticSystem("hf-static", spec, temperature=0.0, max_cache_len=200).run(
            ITEMS[1], BUDGET, None)
        assert model._previous_max_cache_length == 3
    finally:
        del model._previous_max_cache_length


def test_a_failing_compile_falls_back_to_the_uncompiled_static_kv(spec, greedy,
                                                                  monkeypatch) -> None:
    from transformers import CompileConfig

    def no_compiler(compile_config):
        def compiled(*args, **kwargs):
            raise RuntimeError("no C++ compiler found\nsecond line")
        return compiled

    monkeypatch.setattr(spec.target.model, "get_compiled_call", no_compiler)
    config = CompileConfig()
    config._compile_all_devices = True  # transformers' switch to compile off CUDA
    static = HFStaticSystem("hf-static", spec, temperature=0.0, max_cache_len=200,
                            compile_config=config)
    assert static.compiled and static.note is None
    static.warm(ITEMS[0], BUDGET)
    assert not static.compiled
    assert static.note == ("hf-static: torch.compile failed (RuntimeError: no C++ compiler "
                           "found); static KV without torch.compile")
    assert _outputs(static) == greedy
    assert not any(hasattr(spec.target.model, k) for k in STATIC_STATE)
