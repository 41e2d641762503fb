"""Scoring a tree in one forward equals scoring each root-to-leaf path as a chain (fp32)."""

from __future__ import annotations

import pytest
import torch

from agentspec.bench.prompts import GROUNDED
from agentspec.engine.target import HFTarget
from agentspec.types import Draft

# Three levels, four leaves; siblings distinct; node order is not a path order.
TREE_PARENTS = (-1, -1, 0, 0, 1, 2, 4, 3)


def leaf_paths(parents: tuple[int, ...]) -> list[list[int]]:
    """Root-to-leaf node paths of a parent-pointer tree."""
    has_child = {p for p in parents if p >= 0}
    paths = []
    for leaf in (i for i in range(len(parents)) if i not in has_child):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def tree_equals_chains(target: HFTarget, prompt_ids: list[int], tokens: tuple[int, ...],
                       atol: float) -> int:
    """Score the tree once and every path as a chain from a fresh prefill; returns rows compared."""
    draft = Draft(tokens, TREE_PARENTS, "test")
    target.start(prompt_ids)
    tree_logits = target.score(prompt_ids[-1], draft).float()  # [num_nodes + 1, vocab_size]
    compared = 0
    for path in leaf_paths(TREE_PARENTS):
        target.start(prompt_ids)
        chain = Draft.chain([tokens[i] for i in path], "test")
        chain_logits = target.score(prompt_ids[-1], chain).float()  # [len(path) + 1, vocab_size]
        rows = [0] + [i + 1 for i in path]
        torch.testing.assert_close(tree_logits[rows], chain_logits, atol=atol, rtol=0)
        compared += len(rows)
    return compared


def test_leaf_paths():
    assert leaf_paths(TREE_PARENTS) == [[0, 2, 5], [1, 4, 6], [0, 3, 7]]


@pytest.mark.slow
def test_tree_scoring_equals_chains(spec):
    target = spec.target
    assert target.supports_trees and next(target.model.parameters()).dtype == torch.float32
    prompt_ids = spec.encode(GROUNDED[2])
    tokens = tuple(spec.tokenizer.encode(" def is even ( n ) :", add_special_tokens=False)[:8])
    tokens = (tokens + (11, 12, 13, 14, 15, 16, 17, 18))[:8]
    assert tree_equals_chains(target, prompt_ids, tokens, atol=1e-4) == 12
