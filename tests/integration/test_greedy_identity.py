"""Greedy output is token-identical to transformers' generate(do_sample=False) on the real model."""

from __future__ import annotations

import pytest
import torch

from agentspec import SamplingParams, Speculator
from agentspec.protocols import DraftContext
from agentspec.scheduler import decode
from tests.prompts import ALL_PROMPTS

from .helpers import OracleTreeDrafter

MAX_NEW = 32


@pytest.fixture(scope="module")
def plain(spec):
    return Speculator(spec.target, speculate=False, memory=None)


def hf_greedy(spec, prompt) -> list[int]:
    ids = torch.tensor([spec.encode(prompt)])
    out = spec.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                     do_sample=False)
    tokens = out[0, ids.shape[1] :].tolist()
    return [t for t in tokens if t not in spec.stop_token_ids][: len(tokens)]


def cut_at_stop(tokens, stop_ids):
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i]
    return tokens


# Every second prompt is `long` (make test-long): the check is the same on each, and the half
# that make test keeps spans the workloads the file of prompts mixes.
@pytest.mark.slow
@pytest.mark.parametrize("index", [pytest.param(i, marks=pytest.mark.long) if i % 2 else i
                                   for i in range(len(ALL_PROMPTS))])
def test_greedy_identity(spec, plain, index):
    prompt = ALL_PROMPTS[index]
    ids = torch.tensor([spec.encode(prompt)])
    out = spec.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                     do_sample=False)
    expected = cut_at_stop(out[0, ids.shape[1] :].tolist(), spec.stop_token_ids)
    greedy = SamplingParams(temperature=0.0)
    with_lookup = spec.generate(prompt, MAX_NEW, sampling=greedy)
    without = plain.generate(prompt, MAX_NEW, sampling=greedy)
    assert list(without.token_ids) == expected
    assert list(with_lookup.token_ids) == expected
    assert without.stats.steps == len(expected) + (1 if len(expected) < MAX_NEW else 0)


@pytest.mark.slow
def test_greedy_identity_with_trees(spec, plain):
    """A tree drafter that hides the right continuation in a later branch changes nothing; put
    first, on the spine, it is accepted whole."""
    prompt = ALL_PROMPTS[0]
    reference = list(plain.generate(prompt, 48).token_ids)
    vocab = spec.target.vocab_size
    # The loop itself (no drafter chain, whose policy may prune the tree to one branch).
    context = DraftContext(tokens=spec.encode(prompt), prompt_len=len(spec.encode(prompt)))
    steps = list(decode(spec.target, OracleTreeDrafter(reference, vocab), context,
                        sampling=SamplingParams(), max_new_tokens=48,
                        stop_token_ids=spec.stop_token_ids))
    assert [t for s in steps for t in s.new_tokens] == reference
    trees = [s for s in steps if not s.draft.is_chain]
    assert len(trees) > 30
    assert all(len(s.verdict.new_tokens) == 1 for s in trees)  # off the spine: cut at its first node
    first = Speculator(spec.target, drafters=[OracleTreeDrafter(reference, vocab, right_first=True)], memory=None)
    out = first.generate(prompt, 48)
    assert list(out.token_ids) == reference
    assert out.stats.tokens_per_step > 2.5  # the oracle's spine really was accepted


@pytest.mark.slow
def test_stream_concatenates_to_generate(spec):
    prompt = ALL_PROMPTS[3]
    assert "".join(spec.stream(prompt, MAX_NEW)) == spec.generate(prompt, MAX_NEW).text


@pytest.mark.slow
def test_stop_strings_cut_the_text(spec):
    full = spec.generate(ALL_PROMPTS[10], MAX_NEW).text
    word = full.split()[2]
    out = spec.generate(ALL_PROMPTS[10], MAX_NEW, stop=[word])
    assert out.text == full[: full.index(word)] and out.finish_reason == "stop"
    assert word not in "".join(spec.stream(ALL_PROMPTS[10], MAX_NEW, stop=[word]))
