"""Scoring a tree in one forward equals scoring each root-to-leaf path as a chain (fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.prompts import GROUNDED

from .helpers import TREE_PARENTS, leaf_paths, tree_equals_chains


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
