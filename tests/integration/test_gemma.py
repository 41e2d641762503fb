"""gemma-3-270m as a target: sliding-window layers (window 512) past the window.

HFTarget keeps every layer's full KV (rollback by crop stays exact); transformers applies the
window to chains from positions, and tree drafts get a sliding mask of their own. Checked here:
greedy identity against ``generate(do_sample=False)`` (whose KV really slides), tree scoring
equal to chain scoring past the window, and a rollback check against fresh forwards.

Tolerance: gemma's logits reach about 50 in magnitude; the KV path and a fresh forward sum in a
different order and differ by up to ~2e-4 in fp32, so logits are compared with atol 1e-3
(ignoring the window on sliding layers changes them by ~40).
"""

from __future__ import annotations

import pytest
import torch

from agentspec import Speculator
from agentspec.bench.prompts import _CODE, _RECORD
from agentspec.drafters.policy import DEFAULT_COST
from agentspec.drafters.prompt_lookup import PromptLookupDrafter
from agentspec.target import HFTarget
from agentspec.types import Draft

from .helpers import CheckingTarget, OracleTreeDrafter, cached_target
from .test_tree_scoring import TREE_PARENTS, tree_equals_chains

MAX_NEW = 8  # gemma's 262k-token head is slow on the 2-core CPU
ATOL = 1e-3
LONG = ("Here is some code and data.\n" + _CODE + "\n" + _RECORD + "\n") * 2 + "Repeat the first function:\n"
PROMPTS = ["The three primary colors are", f"Return this JSON unchanged:\n{_RECORD}\n", LONG]


@pytest.fixture(scope="module")
def gemma():
    return cached_target("gemma-3-270m")


def test_long_prompt_is_past_the_window(gemma):
    assert gemma.sliding_window == 512 and gemma.supports_trees
    assert len(gemma.tokenizer(LONG)["input_ids"]) > 512
    gemma.check_length(2000)  # no refusal past the window


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PROMPTS)), ids=["short", "json", "long"])
def test_gemma_greedy_identity(gemma, index):
    prompt = PROMPTS[index]
    ids = torch.tensor([gemma.tokenizer(prompt)["input_ids"]])
    out = gemma.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                               do_sample=False)
    expected = out[0, ids.shape[1] :].tolist()
    eos = gemma.model.generation_config.eos_token_id
    expected = expected[: expected.index(eos)] if eos in expected else expected
    plain = Speculator(gemma, speculate=False).generate(prompt, MAX_NEW)
    lookup = Speculator(gemma, drafters=[PromptLookupDrafter()], cost=DEFAULT_COST).generate(prompt, MAX_NEW)
    assert list(plain.token_ids) == expected
    assert list(lookup.token_ids) == expected


@pytest.mark.slow
def test_gemma_tree_scoring_past_the_window(gemma):
    prompt_ids = gemma.tokenizer(LONG)["input_ids"]
    tokens = tuple(gemma.tokenizer(" def average values total", add_special_tokens=False)["input_ids"])
    tokens = (tokens + (107, 108, 109, 110, 111, 112, 113, 114))[: len(TREE_PARENTS)]
    assert tree_equals_chains(gemma, prompt_ids, tokens, atol=ATOL) == 12
    # The sliding mask matters: the plain tree mask on every layer gives other logits.
    draft = Draft(tokens, TREE_PARENTS, "test")
    windowless = HFTarget(gemma.model, gemma.tokenizer, name="windowless", widths=gemma.widths)
    windowless.sliding_window = None  # the deliberately wrong mask: no window on any layer
    windowless.start(prompt_ids)
    wrong = windowless.score(prompt_ids[-1], draft)
    gemma.start(prompt_ids)
    right = gemma.score(prompt_ids[-1], draft)
    assert (wrong - right).abs().max() > 1.0


@pytest.mark.slow
def test_gemma_rollback_past_the_window(gemma):
    target = CheckingTarget(gemma.model, gemma.tokenizer, atol=ATOL)
    reference = list(Speculator(gemma, speculate=False).generate(LONG, 6).token_ids)
    tree = Speculator(target, drafters=[OracleTreeDrafter(reference, target.vocab_size)], cost=DEFAULT_COST)
    assert list(tree.generate(LONG, 6).token_ids) == reference  # a tree step, then chains
    assert target.checked_rows >= 6
