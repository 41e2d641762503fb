"""``agentspec.bench.gpu_weights`` end to end on a small shape: on a machine without CUDA its
fused forwards run in Triton's interpreter (times meaningless, the path the same); the int4
model holds about a quarter of the bf16 one's bytes and both run the fused forward."""

from __future__ import annotations

import pytest
import torch

from agentspec.bench import gpu_weights
from agentspec.bench.synthetic import Shape
from agentspec.engine.fused import kernels
from agentspec.engine.quant.tiles import TileWeight

pytestmark = pytest.mark.skipif(
    not kernels.AVAILABLE or not (torch.cuda.is_available() or kernels.INTERPRETED),
    reason="needs Triton (on CUDA or in its interpreter)")

SMALL = Shape(hidden=64, layers=1, heads=2, kv_heads=1, head_dim=32, intermediate=128, vocab=256,
              rope_theta=10000.0, tied=True)


def test_both_modes_run_the_fused_forward_and_report_against_the_read_time():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = gpu_weights.measure(SMALL, ["bf16", "int4"], context=20, repeats=1, probe_mib=1,
                              device=device, rows=(1, 8), width=16)  # one width: no probe
    assert out["bandwidth_gb_s"] > 0
    bf16, int4 = out["modes"]["bf16"], out["modes"]["int4"]
    for mode in (bf16, int4):
        assert mode["fused"] and set(mode["forward_ms"]) == set(mode["x_read"]) == {1, 8}
        assert mode["read_ms"] == pytest.approx(1000 * mode["weights_bytes"] / (
            1e9 * out["bandwidth_gb_s"]), rel=0.1)
    assert int4["weights_bytes"] < 0.4 * bf16["weights_bytes"]


def test_the_int4_model_is_held_as_tiles_tied_once():
    model = gpu_weights.build(SMALL, "int4", torch.device("cpu"), 64)
    embed, head = model.model.embed_tokens.qweight, model.lm_head.qweight
    assert isinstance(embed, TileWeight) and head is embed
    assert torch.isfinite(embed.dequantized()).all()
