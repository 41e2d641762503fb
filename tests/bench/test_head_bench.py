"""The draft head's bench tools on the tiny model: bench.head_replay's token counts and
bench.head_cost's acceptance on bench lines (the head itself: tests/unit/test_head.py)."""

from __future__ import annotations

import pytest
import torch

from agentspec.drafters.head_train import acceptance_by_depth, replay, vocabulary
from agentspec.engine.target import HFTarget
from tests.tiny_model import (
    OPENING_A,
    OPENING_B,
    cycle_records,
    random_head,
    tiny_target,
    turn_records,
)


@pytest.fixture(scope="module")
def target() -> HFTarget:
    return tiny_target()


def test_head_replay_bench_counts_the_tokens_each_order_runs(target):
    """``bench.head_replay`` times both orders; its token counts are the target's own inputs:
    on records that interleave two conversations the store's order runs more of them, and
    both orders give each record the same rows."""
    from agentspec.bench.head_replay import timed_replay

    a, b = OPENING_A, OPENING_B
    turns = [a, b, a + [6, 3, 4, 5, 6, 3], b + [6, 3, 4, 5, 3, 4]]
    records = turn_records(turns)
    vocab = vocabulary(records, target.tokenizer)
    _, sorted_tokens, by_tokens = timed_replay(target, records, vocab, sort=True)
    _, store_tokens, by_store = timed_replay(target, records, vocab, sort=False)
    # the store's order: each turn shares only the token "1" with the one before it
    assert sorted_tokens < store_tokens == len(a) + 4 + sum(len(p) + 4 - 1 for p in turns[1:])
    for x, y in zip(by_tokens, by_store, strict=True):
        assert x.tokens.tolist() == y.tokens.tolist()
        torch.testing.assert_close(x.hidden, y.hidden, atol=1e-4, rtol=1e-4)


def test_acceptance_on_bench_lines_lays_rows_out_as_the_training_replay(target):
    """``head_cost --lines`` runs each bench line through the target once; its rows must be
    the ones the training replay gives the same request, or its acceptance is another's."""
    from collections import Counter

    from agentspec.bench.head_cost import lines_acceptance
    from agentspec.bench.replay import Line

    records = cycle_records(6)
    vocab = vocabulary(records, target.tokenizer)
    data = replay(target.model, target.tokenizer, records, vocab)
    with torch.no_grad():  # a one-token head accepted where the target's greedy token is it
        greedy = Counter(t for d in data
                         for t in (d.hidden[1:] @ target.model.lm_head.weight.T).argmax(-1).tolist())
    head = random_head(target, [greedy.most_common(1)[0][0]])
    lines = [Line(str(r.id), "measure", "s", tuple(int(t) for t in r.request_text.split()),
                  r.key_text, r.completion_ids, "", 16) for r in records]
    by_lines = lines_acceptance(target, head, lines, depth=3)
    by_replay = acceptance_by_depth(head, data, depth=3)
    assert by_lines["lines"] == 6 and by_replay["mean_accepted"] > 0
    assert {k: by_lines[k] for k in by_replay} == by_replay
