"""Table-driven tests of the verification walk and greedy verification."""

import pytest
import torch

from agentspec.config import SamplingParams
from agentspec.decoding.verify import cut_at_spine, verify, walk
from agentspec.tree import spine_length
from agentspec.types import Draft, Verdict

TREE = Draft((5, 6, 7, 8, 9), (-1, -1, 0, 0, 1), "t")  # 5->{7,8}, 6->{9}


@pytest.mark.parametrize(
    ("draft", "samples", "expected"),
    [
        (Draft(), [4], Verdict((), (), 4)),
        (Draft.chain([1, 2, 3], "c"), [1, 2, 3, 9], Verdict((0, 1, 2), (1, 2, 3), 9)),
        (Draft.chain([1, 2, 3], "c"), [1, 5, 3, 9], Verdict((0,), (1,), 5)),
        (Draft.chain([1, 2, 3], "c"), [0, 2, 3, 9], Verdict((), (), 0)),
        (TREE, [5, 8, 0, 0, 0, 0], Verdict((0, 3), (5, 8), 0)),
        (TREE, [6, 0, 9, 0, 0, 4], Verdict((1, 4), (6, 9), 4)),
        (TREE, [5, 9, 0, 0, 0, 0], Verdict((0,), (5,), 9)),  # 9 is a child of 6, not of 5
        (TREE, [3, 0, 0, 0, 0, 0], Verdict((), (), 3)),
    ],
)
def test_walk(draft, samples, expected):
    assert walk(draft, samples) == expected


def one_hot_logits(rows, vocab=10):
    logits = torch.full((len(rows), vocab), -5.0)
    for i, t in enumerate(rows):
        logits[i, t] = 5.0
    return logits


def test_greedy_verify_uses_argmax_per_node():
    logits = one_hot_logits([5, 8, 0, 0, 0, 0])
    assert verify(TREE, logits, SamplingParams()) == Verdict((0, 3), (5, 8), 0)


def test_greedy_ratio_draft_reduces_to_walk():
    q = torch.full((2, 10), 0.1)
    draft = Draft.chain([1, 2], "model", draft_probs=q)
    logits = one_hot_logits([1, 3, 0])
    assert verify(draft, logits, SamplingParams()) == Verdict((0,), (1,), 3)


def test_draft_rejects_malformed_trees():
    with pytest.raises(ValueError, match="parents"):
        Draft((1, 2), (-1, 1), "x")
    with pytest.raises(ValueError, match="differ in length"):
        Draft((1, 2), (-1,), "x")
    with pytest.raises(ValueError, match="sibling"):
        walk(Draft((1, 1), (-1, -1), "x"), [1, 0, 0])


def test_untrusted_drafts_are_pruned_not_trusted():
    from agentspec.decoding.untrusted import sanitize

    def _sanitize(draft, vocab, room, nodes):
        return sanitize(draft, vocab_size=vocab, room=room, max_nodes=nodes)

    tree = Draft((1, 99, 3, 4, 5), (-1, 0, 1, 0, -1), "m")  # 99 is out of a 10-token vocabulary
    assert _sanitize(tree, 10, 8, 63) == Draft((1, 4, 5), (-1, 0, -1), "m")
    assert _sanitize(Draft.chain([1, 2, 3, 4], "c"), 10, 2, 63) == Draft.chain([1, 2], "c")
    assert _sanitize(Draft.chain([-1, 2], "c"), 10, 8, 63).num_nodes == 0
    assert _sanitize(Draft.chain([1, 2, 3, 4], "c"), 10, 8, 3) == Draft.chain([1, 2, 3], "c")


def test_sanitize_orders_nodes_depth_first_so_first_children_form_the_spine():
    from agentspec.decoding.untrusted import sanitize

    def _sanitize(draft, vocab, room, nodes):
        return sanitize(draft, vocab_size=vocab, room=room, max_nodes=nodes)

    # Breadth-first: a, b under the root; a's child c; b's child d; c's child e.
    tree = Draft((1, 2, 3, 4, 5), (-1, -1, 0, 1, 2), ("a", "b", "c", "d", "e"))
    out = _sanitize(tree, 10, 8, 63)
    assert out == Draft((1, 3, 5, 2, 4), (-1, 0, 1, -1, 3), ("a", "c", "e", "b", "d"))
    assert spine_length(out.parents) == 3 and spine_length(tree.parents) == 1
    # A node budget keeps a depth-first prefix: always a subtree.
    assert _sanitize(tree, 10, 8, 4).parents == (-1, 0, 1, -1)


def test_cut_at_spine_ends_a_verdict_at_its_first_node_off_the_spine():
    tree = Draft((1, 3, 5, 2, 4), (-1, 0, 1, -1, 3), "m")
    on_spine = Verdict((0, 1), (1, 3), 9)
    assert cut_at_spine(tree, on_spine) == on_spine
    # The walk went to the second root child (node 3) and on to node 4: node 3's token was the
    # target's draw after the root, so it is the next token; node 4 is not decided.
    assert cut_at_spine(tree, Verdict((3, 4), (2, 4), 7)) == Verdict((), (), 2)
    chain = Draft.chain([1, 2, 3], "c")
    assert cut_at_spine(chain, Verdict((0, 1, 2), (1, 2, 3), 4)) == Verdict((0, 1, 2), (1, 2, 3), 4)
