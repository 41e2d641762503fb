"""A GGUF's weights as stored on CUDA (``dtype="gguf"``): held as
:class:`~agentspec.engine.quant.tiles.TileWeight`, run by the fused forward's products, each
weight tile dequantised as it is loaded.

What is checked: the packaged model loads so within 1.2x its file's bytes; its logits are
bitwise the bfloat16 model's (the file dequantised, rounded to bfloat16) and a row the same
bits at any width; greedy and seeded outputs with drafts and many concurrent calls are each
call's solo plain output. Marked ``gpu``; skipped where CUDA is not available (CI has no GPU:
tests/unit/test_fused_quant.py runs the same kernels in Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch

from agentspec import Speculator
from tests.prompts import GROUNDED
from tests.solo import solo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def held():
    return Speculator.from_pretrained("smollm2-135m-instruct", memory=None, device="cuda",
                                      dtype="gguf")


@pytest.fixture(scope="module")
def dense():
    return Speculator.from_pretrained("smollm2-135m-instruct", memory=None, device="cuda",
                                      dtype="bfloat16")


def _scored(spec, prompt, tail: int, **target_kw) -> torch.Tensor:
    from agentspec.engine.target import HFTarget
    from agentspec.types import Draft

    target = HFTarget(spec.target.model, spec.target.tokenizer, **target_kw)
    solo(target).start(prompt)
    return solo(target).score(prompt[-1], Draft.chain(prompt[-tail:], "x")).clone()


def test_the_file_loads_as_stored_on_cuda_in_about_its_bytes(held):
    from agentspec.engine.load import gguf_file
    from agentspec.engine.quant.model import weight_bytes, weights_mode

    model = held.target.model
    assert weights_mode(model) == "gguf"
    assert weight_bytes(model) <= 1.2 * gguf_file("smollm2-135m-instruct").stat().st_size
    assert held.target.forward.fused is not None


def test_held_weights_give_the_bfloat16_models_logits_bitwise_at_any_width(held, dense):
    prompt = held.encode(GROUNDED[0])
    got = _scored(held, prompt, 8)
    assert torch.equal(got, _scored(dense, prompt, 8))
    assert torch.equal(_scored(held, prompt, 8, widths=(32,)), got)  # in 32 rows, not 16


def test_concurrent_calls_on_held_weights_equal_their_solo_runs(held):
    from tests.gpu.concurrent import concurrent_and_solo

    want, got, _ = concurrent_and_solo(held.target)
    assert got == want
