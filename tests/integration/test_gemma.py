"""gemma-3-270m as a target: sliding-window layers (window 512) past the window, and chat
requests in Gemma's turn format (the packaged GGUF, a base model, carries no chat template).

HFTarget keeps every layer's full KV (rollback by crop stays exact); transformers applies the
window to chains from positions, and tree drafts get a sliding mask of their own. Checked here:
greedy identity against ``generate(do_sample=False)`` (whose KV really slides), tree scoring
equal to chain scoring past the window, and a rollback check against fresh forwards.

Tolerance: gemma's logits reach about 50 in magnitude; the KV path and a fresh forward sum in a
different order and differ by up to ~2e-4 in fp32, so logits are compared with atol 1e-3
(ignoring the window on sliding layers changes them by ~40).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from agentspec import Speculator
from agentspec.drafters.policy import DEFAULT_COST
from agentspec.drafters.prompt_lookup import PromptLookupDrafter
from agentspec.engine.load import GEMMA_TURNS, PACKAGED_MODELS, give_turn_format
from agentspec.engine.target import HFTarget
from agentspec.text import encode_prompt, render_chat
from agentspec.types import Draft
from tests.prompts import CODE, RECORD
from tests.solo import solo

from .helpers import (
    TREE_PARENTS,
    CheckingTarget,
    OracleTreeDrafter,
    cached_target,
    tree_equals_chains,
)

MAX_NEW = 8  # gemma's 262k-token head is slow on the 2-core CPU
ATOL = 1e-3
LONG = ("Here is some code and data.\n" + CODE + "\n" + RECORD + "\n") * 2 + "Repeat the first function:\n"
PROMPTS = ["The three primary colors are", f"Return this JSON unchanged:\n{RECORD}\n", LONG]


@pytest.fixture(scope="module")
def gemma():
    from importlib.metadata import version

    from packaging.version import Version

    low = PACKAGED_MODELS["gemma-3-270m"].min_transformers
    if low is not None and Version(version("transformers")).release[:2] < Version(low).release:
        pytest.skip(f"the packaged Gemma needs transformers>={low}: below it "
                    f"{PACKAGED_MODELS['gemma-3-270m'].below_min}")
    return cached_target("gemma-3-270m")


def _cut(ids: list[int], gemma) -> list[int]:
    """``generate``'s tokens before the first of the model's stop tokens."""
    eos = gemma.model.generation_config.eos_token_id
    stops = {eos} if isinstance(eos, int) else set(eos)
    return next((ids[:i] for i, t in enumerate(ids) if t in stops), ids)


CHAT = [{"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": f"Return this JSON unchanged:\n{RECORD}"}]


def test_gemma_speaks_in_gemma_turns(gemma):
    """The packaged GGUF (a base model) carries no chat template: messages get Gemma's turn
    format (system text opening the first turn, the assistant as ``model``), and the turn's
    end stops ``generate`` and agentspec alike."""
    turns = CHAT + [{"role": "assistant", "content": "{}"}, {"role": "tool", "content": "ok"}]
    assert render_chat(gemma.tokenizer, turns) == (
        "<bos><start_of_turn>user\nAnswer in one line.\n\nReturn this JSON unchanged:\n"
        f"{RECORD}<end_of_turn>\n<start_of_turn>model\n{{}}<end_of_turn>\n"
        "<start_of_turn>tool\nok<end_of_turn>\n<start_of_turn>model\n")
    ids = encode_prompt(gemma.tokenizer, CHAT)
    assert ids[:2] == [gemma.tokenizer.bos_token_id, gemma.tokenizer.convert_tokens_to_ids("<start_of_turn>")]
    assert ids.count(gemma.tokenizer.bos_token_id) == 1
    end = gemma.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end in gemma.model.generation_config.eos_token_id
    assert end in Speculator(gemma, speculate=False, memory=None).stop_token_ids


def test_a_template_of_the_model_is_kept():
    """The turn format is given only where the tokenizer has none."""
    entry = PACKAGED_MODELS["gemma-3-270m"]
    tokenizer = SimpleNamespace(chat_template="{{ messages }}", unk_token_id=3,
                                convert_tokens_to_ids=lambda token: 106)
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=1))
    give_turn_format(entry, model, tokenizer)
    assert tokenizer.chat_template == "{{ messages }}" and model.generation_config.eos_token_id == 1
    tokenizer.chat_template = None
    give_turn_format(entry, model, tokenizer)
    assert tokenizer.chat_template == GEMMA_TURNS and model.generation_config.eos_token_id == [1, 106]


def test_messages_without_a_template_are_refused_clearly():
    """A base model of the user's (a folder or GGUF without a template): messages are refused
    with the remedy named, not transformers' error from deep in the call."""
    tokenizer = SimpleNamespace(chat_template=None, name_or_path="/models/base")
    with pytest.raises(ValueError, match=r"'/models/base' has no chat template.*raw string"):
        encode_prompt(tokenizer, CHAT)


@pytest.mark.slow
def test_gemma_chat_greedy_identity(gemma):
    """A chat request: the same tokens as ``generate`` on the rendered turns, which stops at
    the turn's end too."""
    ids = torch.tensor([encode_prompt(gemma.tokenizer, CHAT)])
    out = gemma.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                               do_sample=False)
    expected = _cut(out[0, ids.shape[1] :].tolist(), gemma)
    lookup = Speculator(gemma, drafters=[PromptLookupDrafter()], cost=DEFAULT_COST, memory=None).generate(CHAT, 24)
    assert list(lookup.token_ids) == expected


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
    expected = _cut(out[0, ids.shape[1] :].tolist(), gemma)
    plain = Speculator(gemma, speculate=False, memory=None).generate(prompt, MAX_NEW)
    lookup = Speculator(gemma, drafters=[PromptLookupDrafter()], cost=DEFAULT_COST, memory=None).generate(prompt, MAX_NEW)
    assert list(plain.token_ids) == expected
    assert list(lookup.token_ids) == expected


# long (make test-long): tests/integration/test_families.py holds trees and rollback across a
# crossed window on gemma3_text in make test, with its windowless control.
@pytest.mark.slow
@pytest.mark.long
def test_gemma_tree_scoring_past_the_window(gemma):
    prompt_ids = gemma.tokenizer(LONG)["input_ids"]
    tokens = tuple(gemma.tokenizer(" def average values total", add_special_tokens=False)["input_ids"])
    tokens = (tokens + (107, 108, 109, 110, 111, 112, 113, 114))[: len(TREE_PARENTS)]
    assert tree_equals_chains(gemma, prompt_ids, tokens, atol=ATOL) == 12
    # The sliding mask matters: the plain tree mask on every layer gives other logits.
    draft = Draft(tokens, TREE_PARENTS, "test")
    windowless = HFTarget(gemma.model, gemma.tokenizer, name="windowless", widths=gemma.widths)
    windowless.forward.window = None  # the deliberately wrong mask: no window on any layer
    solo(windowless).start(prompt_ids)
    wrong = solo(windowless).score(prompt_ids[-1], draft)
    solo(gemma).start(prompt_ids)
    right = solo(gemma).score(prompt_ids[-1], draft)
    assert (wrong - right).abs().max() > 1.0


# long (make test-long): tests/integration/test_families.py holds trees and rollback across a
# crossed window on gemma3_text in make test, with its windowless control.
@pytest.mark.slow
@pytest.mark.long
def test_gemma_rollback_past_the_window(gemma):
    target = CheckingTarget(gemma.model, gemma.tokenizer, atol=ATOL)
    reference = list(Speculator(gemma, speculate=False, memory=None).generate(LONG, 6).token_ids)
    tree = Speculator(target, drafters=[OracleTreeDrafter(reference, target.vocab_size)], cost=DEFAULT_COST, memory=None)
    assert list(tree.generate(LONG, 6).token_ids) == reference  # a tree step, then chains
    assert target.checked_rows >= 6
