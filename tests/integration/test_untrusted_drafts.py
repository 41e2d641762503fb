"""Untrusted drafters cannot change an output (issue 14): a property test on the real model.

A hostile drafter returns random drafts: random ids (out of range, negative, not ints), random
parents (forward, self, below -1), duplicate siblings, huge trees, token ids and parents of
unequal lengths, per-node sources of the wrong length, ``draft_probs`` of the wrong shape,
``support`` counts that do not fit, things that are not drafts at all, and sometimes raises
from ``begin``/``propose``/``observe``/``end``. Hypothesis picks the seeds, prompts, sampling
and how hostile; each example is one generation, through the decode loop alone (the drafter
at the top) or through a Speculator's drafter chain (a dozen hostile sources at once). Over
at least ``MIN_DRAFTS`` random drafts the outputs equal plain decoding
(``Speculator(target, speculate=False)``), greedy and seeded-sampled. The same file shows
the check failing for a deliberately wrong loop: a verify that accepts a draft's first token
without checking it.
"""

from __future__ import annotations

import functools
import logging
import random
from collections import Counter
from typing import Any

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import agentspec.decoding.loop as decode_module  # noqa: E402
from agentspec import SamplingParams, Speculator  # noqa: E402
from agentspec.decoding.sampling import make_generator  # noqa: E402
from agentspec.decoding.verify import verify, walk  # noqa: E402
from agentspec.drafters.policy import CostModel  # noqa: E402
from agentspec.protocols import DraftContext  # noqa: E402
from agentspec.scheduler import decode  # noqa: E402
from agentspec.types import Draft, Verdict  # noqa: E402
from tests.integration.helpers import cached_target  # noqa: E402

pytestmark = pytest.mark.slow

MAX_NEW = 10
MIN_DRAFTS = 2000
EXAMPLES = 40
SOURCES = 32  # hostile sources in the chain mode
PROMPTS: list[Any] = [
    [{"role": "user", "content": "Name two prime numbers."}],
    "import numpy as np\n\ndef mean(xs):\n    ",
    [{"role": "user", "content": "Say hi in French."}],
]
FLAT = CostModel(1.0, 0.0)  # drafts cost nothing more than plain steps: the chain keeps them
SEEDS = (11, 12)


def _sampling(seed: int | None) -> SamplingParams:
    return SamplingParams() if seed is None else SamplingParams(temperature=0.9, top_p=0.95, seed=seed)


@functools.cache
def _target() -> Any:
    return cached_target("smollm2-135m-instruct")


@functools.cache
def _plain() -> Speculator:
    return Speculator(_target(), speculate=False, cost=FLAT, memory=None)


@functools.cache
def _reference(prompt: int, seed: int | None) -> tuple[int, ...]:
    return _plain().generate(PROMPTS[prompt], MAX_NEW, sampling=_sampling(seed)).token_ids


def _raw(token_ids: Any, parents: Any, source: Any = "hostile", probs: Any = None,
         support: Any = None) -> Draft:
    """A Draft built without its checks, as a hostile drafter can."""
    draft = object.__new__(Draft)
    for name, value in (("token_ids", token_ids), ("parents", parents), ("source", source),
                        ("draft_probs", probs), ("support", support)):
        object.__setattr__(draft, name, value)
    return draft


class Boom(RuntimeError):
    pass


class HostileDrafter:
    """Random drafts of every malformed kind; the reference continuation now and then, so that
    long accepted paths (and cuts inside them) are exercised too."""

    def __init__(self, name: str, rng: random.Random, reference: tuple[int, ...], vocab: int, *,
                 raise_rate: float, valid_probs: bool, counts: Counter[str]) -> None:
        self.name, self.rng, self.reference, self.vocab = name, rng, reference, vocab
        self.raise_rate, self.valid_probs, self.counts = raise_rate, valid_probs, counts

    def _maybe_raise(self, where: str) -> None:
        if self.rng.random() < self.raise_rate:
            self.counts["raised"] += 1
            raise Boom(f"{self.name} fails in {where}")

    def begin(self, context: DraftContext) -> None:
        self._maybe_raise("begin")

    def end(self, context: DraftContext) -> None:
        self._maybe_raise("end")

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        self._maybe_raise("observe")

    def propose(self, context: DraftContext, *, max_tokens: int) -> Any:
        self._maybe_raise("propose")
        self.counts["drafts"] += 1
        r = self.rng
        done = len(context.tokens) - context.prompt_len
        right = list(self.reference[done : done + r.randint(1, 40)])
        kind = r.choice(["right", "right", "tree", "tree", "huge", "lengths", "junk", "not a draft"])
        if kind == "not a draft":
            return r.choice([None, "draft", [1, 2, 3], Draft.chain([1], "x").token_ids, 42])
        n = {"right": len(right), "tree": r.randint(0, 80), "huge": r.randint(300, 5000),
             "lengths": r.randint(1, 30), "junk": r.randint(1, 20)}[kind]
        ids = [self._token(r) for _ in range(n)]
        parents = [r.choice([i - 1, i - 1, r.randint(-1, max(i - 1, -1)), r.randint(-4, i + 3)])
                   for i in range(n)]
        if kind == "right":
            ids, parents = right + ids[: r.randint(0, 8)], list(range(-1, len(right) - 1)) + parents[:8]
            parents = parents[: len(ids)]
        if r.random() < 0.3 and n:  # duplicate siblings: copy some nodes under the same parent
            for _ in range(r.randint(1, 6)):
                i = r.randrange(len(ids))
                ids.append(ids[i])
                parents.append(parents[i])
        if kind == "lengths":
            parents = parents[: r.randint(0, len(parents) + 3)] + [0] * r.randint(0, 3)
        if kind == "junk":
            ids = [r.choice([1.5, None, "7", -1, 2**40, True, torch.tensor(3), ids[0]]) for _ in ids]
        source = r.choice(["hostile", self.name, ("a",) * r.randint(0, len(ids) + 2), 7, None])
        # Support counts: none, right, of the wrong length, or not counts at all (drawn from a
        # stream of their own, so the drafts above are the ones the examples always had).
        c = random.Random(f"{self.name}:{self.counts['drafts']}")
        support = c.choice([None, tuple(c.randint(1, 9) for _ in ids),
                            tuple(c.randint(1, 9) for _ in range(c.randint(0, len(ids) + 2))),
                            tuple(c.choice([0, -2, 3, "4", 2.0, None]) for _ in ids),
                            [2] * len(ids), "many"])
        return _raw(tuple(ids) if r.random() < 0.8 else ids, tuple(parents), source,
                    self._probs(r, len(ids)), support)

    def _token(self, r: random.Random) -> int:
        return r.choice([r.randrange(self.vocab), r.randrange(self.vocab), r.randint(-5, -1),
                         self.vocab + r.randint(0, 5)])

    def _probs(self, r: random.Random, n: int) -> Any:
        choice = r.random()
        if choice < 0.6 or n == 0:
            return None
        if n > 64:  # a [n, vocab] tensor would be large; the sanitiser drops it anyway
            return torch.rand(n, 3)
        if choice < 0.8 and self.valid_probs:  # the right shape: only under greedy (see module)
            return torch.rand(n, self.vocab).softmax(-1)
        return r.choice([torch.rand(n + 1, self.vocab), torch.rand(n, 7), torch.rand(n), "q",
                         torch.zeros(n, self.vocab, dtype=torch.long)])


def _example(seed: int, prompt: int, sample_seed: int | None, mode: str, raise_rate: float,
             counts: Counter[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One generation driven by hostile drafts: ``(its tokens, plain decoding's tokens)``."""
    target, reference = _target(), _reference(prompt, sample_seed)
    rng = random.Random(seed)

    def hostile(name: str) -> HostileDrafter:
        return HostileDrafter(name, rng, reference, target.vocab_size, raise_rate=raise_rate,
                              valid_probs=sample_seed is None, counts=counts)

    sampling = _sampling(sample_seed)
    if mode == "chain":
        spec = Speculator(target, drafters=[hostile(f"hostile{i}") for i in range(SOURCES)],
                          cost=FLAT, memory=None)
        return spec.generate(PROMPTS[prompt], MAX_NEW, sampling=sampling).token_ids, reference
    ids = _plain().encode(PROMPTS[prompt])
    generator = make_generator(sampling.seed, target.device)
    context = DraftContext(tokens=list(ids), prompt_len=len(ids), sampling=sampling,
                           generator=generator)
    steps = decode(target, hostile("hostile"), context, sampling=sampling, max_new_tokens=MAX_NEW,
                   stop_token_ids=_plain().stop_token_ids,
                   generator=generator)
    out = [t for step in steps for t in step.new_tokens]
    return tuple(out), reference


def _counting_verifier(counts: Counter[str], check: Any = verify) -> Any:
    def counted(draft: Draft, *args: Any, **kwargs: Any) -> Verdict:
        counts["verified"] += bool(draft.num_nodes)
        return check(draft, *args, **kwargs)
    return counted


def test_random_drafts_never_change_the_output(monkeypatch, caplog):
    counts: Counter[str] = Counter()
    monkeypatch.setattr(decode_module, "verify", _counting_verifier(counts))
    # A batched step decides greedy calls by a walk over the rows' argmax, not through verify.
    monkeypatch.setattr(decode_module, "walk", _counting_verifier(counts, walk))
    caplog.set_level(logging.CRITICAL, logger="agentspec")  # the failures are expected here

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(seed=st.integers(0, 2**32 - 1), prompt=st.integers(0, len(PROMPTS) - 1),
           sample_seed=st.sampled_from([None, *SEEDS]), mode=st.sampled_from(["decode", "chain", "chain"]),
           raise_rate=st.sampled_from([0.0, 0.01, 0.05]))
    def outputs_equal_plain(seed, prompt, sample_seed, mode, raise_rate):
        got, want = _example(seed, prompt, sample_seed, mode, raise_rate, counts)
        assert got == want

    outputs_equal_plain()
    assert counts["drafts"] >= MIN_DRAFTS, counts
    assert counts["verified"] >= 100, counts  # many reached the verifier, not only the chain
    assert counts["raised"] > 0, counts


def test_a_loop_that_accepts_the_first_draft_token_unchecked_fails_it(monkeypatch, caplog):
    def accept_first(draft: Draft, logits: torch.Tensor, sampling: SamplingParams,
                     generator: Any = None, *, uniforms: Any = None,
                     allowed: Any = None) -> Verdict:
        verdict = verify(draft, logits, sampling, generator, uniforms=uniforms, allowed=allowed)
        if draft.num_nodes and not verdict.path:  # wrong: trusts the draft's first token
            return Verdict((0,), (draft.token_ids[0],), verdict.next_token)
        return verdict

    def accept_first_walk(draft: Draft, samples: list[int]) -> Verdict:
        verdict = walk(draft, samples)
        if draft.num_nodes and not verdict.path:  # the same wrong rule where argmax decides
            return Verdict((0,), (draft.token_ids[0],), verdict.next_token)
        return verdict

    monkeypatch.setattr(decode_module, "verify", accept_first)
    # A step decides greedy calls by a walk over the rows' argmax, not through verify.
    monkeypatch.setattr(decode_module, "walk", accept_first_walk)
    caplog.set_level(logging.CRITICAL, logger="agentspec")
    counts: Counter[str] = Counter()
    runs = [_example(seed, seed % len(PROMPTS), None, "decode", 0.0, counts) for seed in range(3)]
    assert sum(got != want for got, want in runs) >= 2


def test_a_raising_drafter_is_logged_once_and_skipped(caplog):
    class Raises:
        name = "raises"

        def begin(self, context): pass

        def propose(self, context, *, max_tokens):
            raise Boom("no draft today")

        def observe(self, context, draft, verdict): pass

        def end(self, context): pass

    class Oracle:
        name = "oracle"

        def begin(self, context): pass

        def propose(self, context, *, max_tokens):
            done = len(context.tokens) - context.prompt_len
            return Draft.chain(_reference(1, None)[done : done + max_tokens], self.name)

        def observe(self, context, draft, verdict): pass

        def end(self, context): pass

    caplog.set_level(logging.WARNING, logger="agentspec")
    spec = Speculator(_target(), drafters=[Raises(), Oracle()], cost=FLAT, memory=None)
    gens = [spec.generate(PROMPTS[1], MAX_NEW) for _ in range(2)]
    assert [g.token_ids for g in gens] == [_reference(1, None)] * 2
    logged = [r for r in caplog.records if "raises" in r.getMessage()]
    assert len(logged) == 1 and "propose" in logged[0].getMessage()
    assert all(g.stats.accepted.get("oracle", 0) > 0 for g in gens)  # the other source drafts on


def test_a_drafter_that_runs_a_call_on_the_target_mid_step_changes_nothing():
    """A drafter may share the target with other calls: here each of its proposals first runs
    a whole generation of another prompt on it, between the loop's checks and its forward."""
    class Meddler:
        name = "meddler"

        def begin(self, context): pass

        def propose(self, context, *, max_tokens):
            Speculator(_target(), speculate=False, cost=FLAT, memory=None).generate(PROMPTS[0], 2)
            done = len(context.tokens) - context.prompt_len
            return Draft.chain(reference[done : done + max_tokens][:3], self.name)

        def observe(self, context, draft, verdict): pass

        def end(self, context): pass

    reference = _reference(1, None)
    spec = Speculator(_target(), drafters=[Meddler()], cost=FLAT, memory=None)
    assert spec.generate(PROMPTS[1], MAX_NEW).token_ids == reference
