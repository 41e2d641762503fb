"""Log-probabilities do not depend on the drafts (issue 50): bitwise those of plain decoding.

``SamplingParams(logprobs=k)`` reports, per committed token, the target's log-probability of it
and its ``k`` most likely alternatives, from the verification row that decided the token. That
row's bits do not depend on the drafts, the forward's width, its place or the other sequences
in the forward (the engine's invariance), so on the real packaged model, in fp32 and bf16:

* drafts of every kind give the logprobs of plain decoding (``speculate=False``, one request
  at a time, no prefix reuse), compared with ``torch.equal``, greedy and seeded-sampled: the
  default drafters (the completion memory, suffix matches, prompt lookup) one request at a
  time, each answer drafted from its own record; trees of right, poisoned and random tokens
  with every request in the same steps;
* plain decoding's numbers are the model's own distribution: close to a log-softmax of a
  transformers forward over the prompt and the output (fp32), the top alternatives sorted,
  the chosen token the top one under greedy decoding;
* a stop string cuts them with the tokens; a stream shows them as steps commit them.

The same file shows the comparison fails: a loop that takes each token's numbers from the row
after or before the one that decided it (an off-by-one in the rows of a verdict) gives plain
decoding's numbers alone (one row a step) but other numbers under drafts.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import agentspec.decoding.loop as loop
from agentspec import SamplingParams, SpecConfig, Speculator
from agentspec.drafters.policy import DEFAULT_COST
from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores import InMemoryStore
from agentspec.text import encode_prompt
from agentspec.types import Generation, Verdict
from tests.integration.test_batching import _fresh, _together
from tests.integration.test_invariance import ShuffledTreeDrafter
from tests.prompts import ALL_PROMPTS

pytestmark = pytest.mark.slow

MAX_NEW = 10
TOP = 5
# Short open prompts (the memory and the trees draft them), the third seeded-sampled.
PROMPTS = [ALL_PROMPTS[i] for i in (10, 12, 11, 13)]


def _sampling(i: int) -> SamplingParams:
    if i % 3 == 2:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=50 + i, logprobs=TOP)
    return SamplingParams(logprobs=TOP)


@functools.cache
def _plain(dtype_name: str) -> tuple[Generation, ...]:
    """Plain decoding, one request at a time, no prefix reuse: the reference."""
    spec = Speculator(_fresh(dtype_name, reuse_prefix=False), speculate=False, memory=None,
                      cost=DEFAULT_COST)
    return tuple(spec.generate(p, MAX_NEW, sampling=_sampling(i)) for i, p in enumerate(PROMPTS))


def _as_tensors(gen: Generation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A generation's logprobs as (chosen [n], top values [n, TOP], top ids [n, TOP])."""
    assert gen.logprobs is not None and len(gen.logprobs) == len(gen.token_ids)
    assert [t.token_id for t in gen.logprobs] == list(gen.token_ids)
    chosen = torch.tensor([t.logprob for t in gen.logprobs], dtype=torch.float64)
    values = torch.tensor([[v for _, v in t.top] for t in gen.logprobs], dtype=torch.float64)
    ids = torch.tensor([[i for i, _ in t.top] for t in gen.logprobs])
    return chosen, values, ids


def _differing(outs: list[Generation], reference: tuple[Generation, ...]) -> list[int]:
    """The requests whose tokens or logprobs are not bitwise the reference's."""
    bad = []
    for i, (got, want) in enumerate(zip(outs, reference, strict=True)):
        same = got.token_ids == want.token_ids and all(
            torch.equal(a, b) for a, b in zip(_as_tensors(got), _as_tensors(want), strict=True))
        if not same:
            bad.append(i)
    return bad


def _accepted(outs: list[Generation]) -> int:
    return sum(sum(g.stats.accepted.values()) for g in outs)


class _Call:
    """One request as test_batching's ``_together`` runs it."""

    def __init__(self, i: int) -> None:
        self.i = i

    def run(self, spec: Speculator) -> Generation:
        return spec.generate(PROMPTS[self.i], MAX_NEW, sampling=_sampling(self.i))


def _trees(target: Any, dtype_name: str) -> Speculator:
    """Trees of the right continuation, a poisoned one, random tokens and prompt lookup."""
    refs = {tuple(encode_prompt(target.tokenizer, p)): g.token_ids
            for p, g in zip(PROMPTS, _plain(dtype_name), strict=True)}
    return Speculator(target, memory=None, cost=DEFAULT_COST, config=SpecConfig(max_batch=16),
                      drafters=[ShuffledTreeDrafter(refs, target.vocab_size, 3)])


# -- 1. drafts change no logprob ----------------------------------------------------------------
# fp32 in `make test-long` only: a row's bits under drafts and batching in fp32 are held by
# test_batching and test_untrusted_drafts, and which row a logprob is read from by the two
# neighbouring-row tests below; bf16 runs in `make test`.
@pytest.mark.parametrize("dtype_name", [pytest.param("fp32", marks=pytest.mark.long), "bf16"])
def test_logprobs_under_drafts_alone_and_batched_equal_plain_decoding(dtype_name):
    reference = _plain(dtype_name)
    calls = [_Call(i) for i in range(len(PROMPTS))]
    # Prompt lookup and the memory: the second pass drafts each answer from its own record.
    memory = CompletionMemory(InMemoryStore(), embedder=HashEmbedder())
    remembered = Speculator(_fresh(dtype_name), memory=memory, cost=DEFAULT_COST)
    for _ in range(2):
        outs = [c.run(remembered) for c in calls]
        assert _differing(outs, reference) == [], dtype_name
    assert outs[0].stats.accepted.get("memory", 0) > 0
    # Trees of right and wrong drafts, every request in the same steps.
    outs = _together(_trees(_fresh(dtype_name), dtype_name), calls, len(calls))
    assert _differing(outs, reference) == [], dtype_name
    assert _accepted(outs) >= len(calls)


def test_logprobs_are_the_models_distribution():
    """Plain decoding's numbers against a transformers forward over prompt and output (fp32:
    other kernels, so close, not equal)."""
    target = _fresh("fp32")
    for i, gen in enumerate(_plain("fp32")):
        prompt = encode_prompt(target.tokenizer, PROMPTS[i])
        ids = torch.tensor([prompt + list(gen.token_ids)])
        with torch.inference_mode():
            logits = target.model(input_ids=ids).logits[0].float()  # [tokens, vocab_size]
        n = len(gen.token_ids)
        # The row before each output token is the one that predicts it.
        logp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + n], dim=-1)
        chosen, values, top_ids = _as_tensors(gen)
        want = logp.gather(1, torch.tensor(gen.token_ids)[:, None]).squeeze(1).double()
        torch.testing.assert_close(chosen, want, atol=2e-4, rtol=0)
        torch.testing.assert_close(values, logp.gather(1, top_ids).double(), atol=2e-4, rtol=0)
        assert bool((values[:, :-1] >= values[:, 1:]).all()), "top alternatives not sorted"
        assert bool((chosen <= 0).all()) and bool((values[:, 0] >= chosen).all())
        if not _sampling(i).temperature:  # greedy: the chosen token is the most likely one
            assert torch.equal(top_ids[:, 0], torch.tensor(gen.token_ids))


def test_a_stop_string_cuts_logprobs_with_the_tokens_and_a_stream_shows_them():
    spec = Speculator(_fresh("fp32"), memory=None, cost=DEFAULT_COST)
    prompt, whole = PROMPTS[1], _plain("fp32")[1]
    stop = spec.tokenizer.decode(whole.token_ids[3:5])
    cut = spec.generate(prompt, MAX_NEW, sampling=_sampling(1), stop=[stop])
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(whole.token_ids)
    assert cut.logprobs == whole.logprobs[: len(cut.token_ids)]
    stream = spec.stream(prompt, MAX_NEW, sampling=_sampling(1))
    seen = [len(stream.logprobs or ()) for _ in stream]
    assert seen == sorted(seen) and seen[0] >= 1
    assert stream.generation is not None and stream.generation.logprobs == whole.logprobs
    assert stream.logprobs == whole.logprobs
    # Without logprobs asked for: none computed.
    assert spec.generate(prompt, 4).logprobs is None
    assert spec.stream(prompt, 4).logprobs is None


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5, "5"])
def test_logprobs_out_of_range_is_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match=f"logprobs must be None or an int in \\[0, 20\\].*{bad!r}"):
        SamplingParams(logprobs=bad)


def test_zero_alternatives_gives_the_chosen_tokens_only():
    spec = Speculator(_fresh("fp32"), memory=None, cost=DEFAULT_COST)
    gen = spec.generate(PROMPTS[0], 4, sampling=SamplingParams(logprobs=0))
    whole = _plain("fp32")[0]
    assert gen.logprobs is not None and all(t.top == () for t in gen.logprobs)
    assert [t.logprob for t in gen.logprobs] == [t.logprob for t in whole.logprobs[:4]]


# -- 2. the comparison fails a wrong implementation ---------------------------------------------
RIGHT_ROWS = loop.deciding_rows


def _row_after(verdict: Verdict) -> list[int]:
    """Each token's numbers from the row that decides the next token (the last one's own)."""
    rows = RIGHT_ROWS(verdict)
    return rows[1:] + rows[-1:]


def _row_before(verdict: Verdict) -> list[int]:
    """Each token's numbers from the row that decided the token before (the first one's own)."""
    rows = RIGHT_ROWS(verdict)
    return rows[:1] + rows[:-1]


@pytest.mark.parametrize("wrong", [_row_after, _row_before])
def test_logprobs_from_a_neighbouring_row_fail_that_check(monkeypatch, wrong):
    monkeypatch.setattr(loop, "deciding_rows", wrong)
    reference = _plain("fp32")[:2]
    calls = [_Call(i) for i in range(len(reference))]
    # Alone, one row a step: the wrong rows are the right ones, plain decoding is unchanged.
    plain = Speculator(_fresh("fp32", reuse_prefix=False), speculate=False, memory=None,
                       cost=DEFAULT_COST)
    assert _differing([calls[0].run(plain)], reference[:1]) == []
    trees = _trees(_fresh("fp32"), "fp32")
    outs = [c.run(trees) for c in calls]
    assert [g.token_ids for g in outs] == [g.token_ids for g in reference]  # tokens exact
    assert _differing(outs, reference), "logprobs from the wrong rows passed the check"


# -- 3. prompts given as token ids (the completions endpoint's) ---------------------------------
def test_a_prompt_of_token_ids_is_the_prompt_those_ids_encode():
    spec = Speculator(_fresh("fp32"), memory=None, cost=DEFAULT_COST)
    ids = encode_prompt(spec.tokenizer, PROMPTS[0])
    got, want = spec.generate(ids, MAX_NEW, sampling=_sampling(0)), _plain("fp32")[0]
    assert (got.text, got.token_ids, got.logprobs) == (want.text, want.token_ids, want.logprobs)
    assert spec.generate(tuple(ids), 3).token_ids == _plain("fp32")[0].token_ids[:3]
    for bad in ([*ids[:2], spec.target.vocab_size], [-1]):
        with pytest.raises(ValueError, match=f"prompt token {len(bad) - 1} is {bad[-1]}, outside"):
            spec.generate(bad, 2)
