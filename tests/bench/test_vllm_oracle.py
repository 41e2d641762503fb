"""The vLLM bench's oracle proposer: each row gets the next k tokens of its request's known
output, found by the row's prompt and checked against what the row has generated; an unknown
row, or one that left its known output, gets none."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from agentspec.bench.vllm import engine_args, speculative_config
from agentspec.bench.vllm_oracle import OracleProposer


def _config(tmp_path, pairs, k=3):
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(pairs))
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           additional_config={"agentspec_oracle": {"pairs": str(path)}})


def _rows(*rows, width=32):
    out = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def test_each_row_drafts_its_own_requests_next_k_tokens(tmp_path):
    oracle = OracleProposer(_config(tmp_path, [[[1, 2], [10, 11, 12, 13, 14]],
                                               [[1, 2, 3], [20, 21, 22, 23]],
                                               [[5], [30, 31]]]))
    rows = _rows([1, 2, 10, 11], [1, 2, 3, 20], [5, 30], [5, 99], [7, 7])
    out = oracle.propose([[11], [20], [30], [99], [7]], np.array([4, 4, 2, 2, 2]), rows)
    # [1, 2, 3] is the longer prompt that row 1 starts with; row 2 is one token from its end;
    # row 3 left its output (99), row 4's prompt is unknown.
    assert out == [[12, 13, 14], [21, 22, 23], [31], [], []]
    # A row mid-prefill (nothing sampled) is not drafted for.
    assert oracle.propose([[], [20]], np.array([4, 4]), rows[:2]) == [[], [21, 22, 23]]


def test_the_bench_wires_the_oracle_as_a_custom_proposer(tmp_path):
    spec = speculative_config("oracle", 4)
    assert spec == {"method": "custom_class",
                    "model": "agentspec.bench.vllm_oracle.OracleProposer",
                    "num_speculative_tokens": 4}
    args = engine_args("oracle", "m", k=4, streams=1, db=None, stats_path=None,
                       max_model_len=64, oracle_pairs="p.json")
    assert args["additional_config"] == {"agentspec_oracle": {"pairs": "p.json"}}
    with pytest.raises(ValueError, match="oracle"):
        speculative_config("0racle", 4)


def test_without_pairs_it_says_what_is_missing():
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=2),
                             additional_config={})
    with pytest.raises(ValueError, match="agentspec_oracle"):
        OracleProposer(config)


def test_a_pairs_file_that_grows_is_read_again_for_a_row_it_did_not_know(tmp_path):
    config = _config(tmp_path, [[[1, 2], [10, 11]]], k=2)
    oracle = OracleProposer(config)
    rows = _rows([5, 6, 7])
    assert oracle.propose([[7]], np.array([3]), rows) == [[]]  # not known yet
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([[[1, 2], [10, 11]], [[5, 6], [7, 8, 9]]]))  # plain told it
    assert oracle.propose([[7]], np.array([3]), rows) == [[8, 9]]


def test_methods_take_turns_in_a_rotating_order_with_the_oracle_after_plain():
    from agentspec.bench.vllm import turn_order

    kids = [SimpleNamespace(method=m) for m in ("plain", "suffix", "agentspec", "oracle")]
    orders = [[c.method for c in turn_order(kids, t)] for t in range(4)]
    assert [o[0] for o in orders] == ["plain", "suffix", "agentspec", "plain"]
    for order in orders:
        assert sorted(order) == sorted(c.method for c in kids)
        assert order.index("plain") < order.index("oracle")
    # Without an oracle the rotation is plain: each method leads one turn.
    three = kids[:3]
    assert [turn_order(three, t)[0].method for t in range(3)] == ["plain", "suffix", "agentspec"]
