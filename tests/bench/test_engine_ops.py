"""``python -m agentspec.bench.engine --ops``: operations in one 64-row forward per KV capacity."""

from __future__ import annotations

import pytest

from agentspec.bench import engine


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
