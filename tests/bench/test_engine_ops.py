"""``python -m agentspec.bench.engine --ops``: operations in one 64-row forward per KV capacity,
of the packaged model and of each family the fused forward covers (``--family``)."""

from __future__ import annotations

import pytest
import torch

from agentspec.bench import engine
from agentspec.bench.families import REFERENCES, tiny_model
from agentspec.engine.target import HFTarget


@pytest.mark.slow
def test_doubling_the_kv_adds_one_addition_per_block_fold(capsys):
    result = engine.main(["--ops", "512,1024,2048", "--device", "cpu"])
    ops = result["ops"]
    layers = 30  # SmolLM2-135M
    assert all(0 < c["in attention"] < c["operations"] for c in ops.values())
    # Two blocks to four: the softmax sums and the weighted values each take one more level of
    # the tree (blocks added first to last would take two more additions each).
    assert ops["1024"]["in attention"] - ops["512"]["in attention"] == 2 * layers
    assert ops["1024"]["operations"] - ops["512"]["operations"] == 2 * layers
    assert '"forward_rows": 64' in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["", "x", "64", "1024,abc"])
def test_bad_capacities_are_named(bad, capsys):
    with pytest.raises(SystemExit):
        engine.main(["--ops", bad, "--device", "cpu"])
    assert "--ops" in capsys.readouterr().err


_GRANITE_DEPTH = ("granite-3.3-2b-instruct has 40 layers: six kernels a layer (the fewest the "
                  "fixed tiles allow is five: a norm over a whole row needs a product's every "
                  "column first) come to 240 before the embedding and the head; the bound holds "
                  "to 32 layers")


@pytest.mark.parametrize("family", [
    pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=_GRANITE_DEPTH))
    if f == "granite" else f for f in REFERENCES])
def test_each_fused_family_takes_at_most_200_operations_a_forward(family):
    """One 64-row fused forward at 2,048 slots, counted on a tiny checkpoint of the family as
    deep as its reference checkpoint (the count depends on the depth, not the widths)."""
    base, _ = engine.family_target(family, "cpu", torch.bfloat16)
    ops = engine.fused_ops(base, (2048,))
    assert "unsupported" not in ops, ops
    assert ops["2048"]["operations"] <= 200


def test_granite_within_the_bound_at_mistrals_depth():
    """The bound Granite's reference misses is its depth: at 32 layers it holds (its
    multipliers cost one operation, the embedding's)."""
    model = tiny_model("granite", layers=32)
    ops = engine.fused_ops(HFTarget(model, None, reuse_prefix=False), (2048,))
    assert 0 < ops["2048"]["operations"] <= 200


def test_the_ops_count_takes_a_family(capsys):
    result = engine.main(["--ops", "2048", "--device", "cpu", "--family", "olmo2"])
    assert result["model"] == "tiny olmo2, 16 layers as OLMo-2-0425-1B-Instruct"
    assert 0 < result["fused ops"]["2048"]["operations"] <= 200
    assert result["fused ops"]["2048"]["operations"] < result["ops"]["2048"]["operations"]
    assert '"dtype": "bf16"' in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--family", "qwen3"], "give --ops too"),
    (["--ops", "2048", "--family", "gpt2"], "invalid choice: 'gpt2'"),
])
def test_a_bad_family_is_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        engine.main([*argv, "--device", "cpu"])
    assert message in capsys.readouterr().err
