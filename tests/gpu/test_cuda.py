"""The CUDA path: bf16 on the GPU, greedy output equal to plain decoding through the same loop.

Marked ``gpu``; skipped where CUDA is not available (CI has no GPU).
"""

from __future__ import annotations

import pytest
import torch

from agentspec import Speculator
from agentspec.bench.prompts import GROUNDED

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def gpu_spec():
    return Speculator.from_pretrained("smollm2-135m-instruct", memory=None, device="cuda")


def test_loads_in_bf16_on_cuda(gpu_spec):
    param = next(gpu_spec.target.model.parameters())
    assert param.device.type == "cuda" and param.dtype == torch.bfloat16


def test_greedy_speculation_matches_plain_decoding_on_cuda(gpu_spec):
    plain = Speculator(gpu_spec.target, speculate=False)
    for prompt in GROUNDED[:4]:
        assert gpu_spec.generate(prompt, 64).token_ids == plain.generate(prompt, 64).token_ids
