"""The native forward over quantized weights for each family it runs (``quant/runner.py``'s
``FAMILIES``), on a tiny random checkpoint quantized at load (int8, ``tests/families.py``) and
held in bfloat16 (what ``load_target(dtype="bfloat16")`` does on the CPU):

* the engine takes the native forward;
* its logits after a prompt are within 1e-2 of the model's own modules over the same products
  (the native forward's float16 KV and fixed-order sums are the difference);
* every row of a verified draft equals the same row scored alone.

The control, in this file: a Qwen3 forward that skips its head norms misses the closeness
check.
"""

from __future__ import annotations

import functools

import pytest
import torch

from agentspec.engine.quant.model import weights_mode
from agentspec.engine.quant.quantize import hold_bfloat16, quantize_model
from agentspec.engine.quant.runner import FAMILIES
from agentspec.engine.target import HFTarget
from agentspec.types import Draft
from tests.families import BY_NAME, build, tokenizer
from tests.solo import solo, verified_and_alone

PROMPT = "Name three colours and a tool that paints with them."
CHAIN = [11, 22, 33, 44, 55]


HOLDS = ("int8", "bf16")


@functools.cache
def _target(name: str, held: str = "int8") -> HFTarget:
    model = build(BY_NAME[name])
    model = quantize_model(model, "int8") if held == "int8" else hold_bfloat16(model)
    return HFTarget(model, tokenizer(), name=name)


def _gap(target: HFTarget) -> float:
    """The largest difference between the native forward's logits after the prompt and the
    modules' own."""
    ids = tokenizer()(PROMPT)["input_ids"]
    solo(target).start(ids)
    native = solo(target).score(ids[-1], Draft())[0]
    with torch.inference_mode():
        modules = target.model(torch.tensor([ids])).logits[0, -1]
    return float((native - modules).abs().max())


@pytest.mark.parametrize("held", HOLDS)
@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_runs_the_native_forward_close_to_its_modules(name, held):
    target = _target(name, held)
    assert target.forward.native is not None
    assert weights_mode(target.model) == ("int8" if held == "int8" else "bfloat16")
    assert _gap(target) < 1e-2


@pytest.mark.parametrize("held", HOLDS)
@pytest.mark.parametrize("name", FAMILIES)
def test_a_verified_row_is_the_row_scored_alone(name, held):
    target = _target(name, held)
    verified, alone = verified_and_alone(target, tokenizer()(PROMPT)["input_ids"], CHAIN)
    assert torch.equal(verified, alone)


def test_qwen3_without_its_head_norms_misses_that_check():
    target = HFTarget(quantize_model(build(BY_NAME["qwen3"]), "int8"), tokenizer(), name="q3")
    for layer in target.forward.native._layers:  # a target of its own: its pool is thrown away
        layer.norm_q = layer.norm_k = None
    assert _gap(target) >= 1e-2
