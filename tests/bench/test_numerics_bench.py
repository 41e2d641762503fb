"""``python -m agentspec.bench.numerics --held``: the bytes a GGUF's quantized tensors are held
in, per type, agree with what the loaded model holds (the packaged SmolLM2: its Q4_1 layers and
Q8_0 table, the tied head held once; the model adds its float norms)."""

from __future__ import annotations

import pytest

from agentspec.bench.numerics import held
from agentspec.engine.load import gguf_file, load_target
from agentspec.engine.quant.model import weight_bytes


@pytest.mark.slow
@pytest.mark.long  # make test-long: test_quant holds each format's bytes in make test
def test_held_bytes_per_type_add_up_to_the_models():
    out = held(gguf_file("smollm2-135m-instruct"))
    assert set(out) >= {"Q4_1", "Q8_0", "all quantized"}
    total = out["all quantized"]
    assert total["held"] == out["Q4_1"]["held"] + out["Q8_0"]["held"]
    model = load_target(device="cpu", dtype="gguf").model
    floats = sum(p.numel() * p.element_size() for p in model.parameters())  # the norms
    assert total["held"] + floats == weight_bytes(model)
    assert total["x"] <= 1.0
