"""The small-model drafter: greedy identity (same and different tokenizers) and the ratio test's
exactness end to end.

Statistics: a tiny random target and a tiny random draft model share a 5-token vocabulary
(LlamaConfig models built from a config, no hub). We decode 3 tokens many times through the
real decode loop (draft model with its own KV, ratio test, target KV commit) and compare the
joint distribution of the 3 tokens with the exact one, a product of the target's processed
conditionals computed by plain forward passes. Chi-square threshold: p > 0.001 for the real
drafter; a deliberately wrong drafter, which attaches q before the temperature is applied (it
samples from one distribution and reports another), must give p < 0.001 on the same test.

(Verifying the model's draft as a point-mass draft, ignoring q, would *not* be wrong: the walk
emits target samples only, so it is exact for any draft, just accepted less often.)
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from agentspec import SamplingParams, Speculator
from agentspec.decoding.sampling import logits_to_probs
from agentspec.drafters.model import ModelDrafter
from agentspec.drafters.policy import CostModel
from agentspec.engine.load import load_layer_skip
from agentspec.engine.target import HFTarget
from agentspec.protocols import DraftContext
from agentspec.scheduler import decode
from agentspec.types import Draft
from tests.prompts import ALL_PROMPTS
from tests.stats import p_value

from .helpers import cached_target

V, LENGTH, PROMPT, ALPHA = 5, 3, (1, 2, 3), 1e-3
# Drafting looks free under this cost model, so the chain keeps the model's draft every step
# however rarely an untrained draft is accepted: identity is checked on drafted steps.
ALWAYS_DRAFT = CostModel(base=1000.0, per_token=1e-6)  # a draft model's own time is negligible here
DRAWS, WRONG_DRAWS = 2000, 1200  # the wrong drafter gives p ~ 1e-6 at 1000 draws
T = SamplingParams(temperature=0.5)


class TinyTokenizer:
    """Just what HFTarget and ModelDrafter ask of a tokenizer: a vocabulary."""

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(V)}

    def __len__(self) -> int:
        return V


def tiny_model(seed: int) -> HFTarget:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=False, initializer_range=0.5)
    model = LlamaForCausalLM(config).eval()
    return HFTarget(model, TinyTokenizer(), name=f"tiny-{seed}")


# Tiny tensors: intra-op threads only add synchronisation cost (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[HFTarget, HFTarget]:
    return tiny_model(0), tiny_model(1)


def exact_joint(target: HFTarget, sampling: SamplingParams) -> np.ndarray:
    out = np.zeros(V**LENGTH)
    with torch.inference_mode():
        for i, seq in enumerate(itertools.product(range(V), repeat=LENGTH)):
            logits = target.model(input_ids=torch.tensor([[*PROMPT, *seq[:-1]]])).logits[0]
            probs = logits_to_probs(logits[-LENGTH:], sampling)  # [LENGTH, V]
            out[i] = float(np.prod([float(probs[t, seq[t]]) for t in range(LENGTH)]))
    return out


class TemperatureBlindDrafter(ModelDrafter):
    """Wrong: samples from q at the request's temperature but attaches q at temperature 1."""

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        draft = super().propose(context, max_tokens=max_tokens)
        if draft.draft_probs is None:
            return draft
        assert context.sampling is not None
        raw = draft.draft_probs ** context.sampling.temperature  # softmax(logits / 1)
        return Draft.chain(draft.token_ids, draft.source, raw / raw.sum(-1, keepdim=True))


def run(target: HFTarget, drafter: ModelDrafter, draws: int, seed: int = 7) -> tuple[np.ndarray, int]:
    """Counts of the 3-token outputs, and how many draft tokens were accepted."""
    g = torch.Generator().manual_seed(seed)
    counts, accepted = np.zeros(V**LENGTH), 0
    for _ in range(draws):
        context = DraftContext(tokens=list(PROMPT), prompt_len=len(PROMPT), sampling=T, generator=g)
        for step in decode(target, drafter, context, sampling=T, max_new_tokens=LENGTH,
                           stop_token_ids=frozenset(), generator=g):
            accepted += len(step.verdict.accepted)
        counts[int(np.ravel_multi_index(context.generated, (V,) * LENGTH))] += 1
    return counts, accepted


def test_ratio_test_is_exact_end_to_end(tiny_pair):
    target, draft = tiny_pair
    drafter = ModelDrafter(draft, target.tokenizer, max_draft=2, min_confidence=0.0)
    assert drafter.same_tokenizer
    counts, accepted = run(target, drafter, DRAWS)
    assert accepted > DRAWS // 2  # the draft really was used (and sometimes rejected)
    assert p_value(counts, exact_joint(target, T)) > ALPHA


def test_wrong_q_is_rejected(tiny_pair):
    target, draft = tiny_pair
    wrong = TemperatureBlindDrafter(draft, target.tokenizer, max_draft=2, min_confidence=0.0)
    counts, _ = run(target, wrong, WRONG_DRAWS)
    assert p_value(counts, exact_joint(target, T)) < ALPHA


def test_greedy_drafts_are_point_masses(tiny_pair):
    target, draft = tiny_pair
    drafter = ModelDrafter(draft, target.tokenizer, max_draft=3, min_confidence=0.0)
    context = DraftContext(tokens=list(PROMPT), prompt_len=3, sampling=SamplingParams())
    drafter.begin(context)
    out = drafter.propose(context, max_tokens=3)
    assert out.num_nodes == 3 and out.draft_probs is None and out.source == "model"
    # The draft model's KV follows the committed context: a rollback, then new tokens.
    context.tokens[:] = [1, 2, 4, 0]
    again = drafter.propose(context, max_tokens=3)
    with torch.inference_mode():
        logits = draft.model(input_ids=torch.tensor([context.tokens])).logits[0, -1]
    assert again.token_ids[0] == int(logits.argmax())
    assert drafter.fed == len(context.tokens) + 2


# --- Real models: greedy identity. ---------------------------------------------------------

@pytest.fixture(scope="module")
def skip_layer_draft(tmp_path_factory) -> HFTarget:
    """SmolLM2 with 12 of its 30 layers: the same tokenizer, a different (cheaper) model."""
    out: Path = tmp_path_factory.mktemp("draft") / "smollm2-skip"
    return load_layer_skip("smollm2-135m-instruct", out, [*range(8), *range(26, 30)])


# In `make test-long`: the same-tokenizer drafter's exactness is held by the ratio test on a
# tiny pair above, and greedy identity on the real model by the cross-tokenizer test below.
@pytest.mark.slow
@pytest.mark.long
def test_greedy_identity_same_tokenizer(spec, skip_layer_draft):
    plain = Speculator(spec.target, speculate=False, memory=None)
    drafted = Speculator(spec.target, drafters=[ModelDrafter(skip_layer_draft, spec.tokenizer)],
                          cost=ALWAYS_DRAFT, memory=None)
    for prompt in (ALL_PROMPTS[3], ALL_PROMPTS[13]):
        out = drafted.generate(prompt, 24)
        assert out.token_ids == plain.generate(prompt, 24).token_ids
        assert out.stats.drafted.get("model", 0) >= out.stats.steps - 1
    sampled = drafted.generate(ALL_PROMPTS[3], 12, sampling=SamplingParams(temperature=0.8, seed=1))
    assert sampled.stats.drafted.get("model", 0) > 0
    # The facade's keyword: prompt lookup first, the model drafter last.
    default = Speculator(spec.target, draft_model=skip_layer_draft, cost=ALWAYS_DRAFT, memory=None)
    assert isinstance(default.drafters[-1], ModelDrafter)
    assert default.generate(ALL_PROMPTS[2], 24).token_ids == plain.generate(ALL_PROMPTS[2], 24).token_ids


@pytest.mark.slow
def test_greedy_identity_cross_tokenizer(spec):
    gemma = cached_target("gemma-3-270m")
    smollm = HFTarget(spec.target.model, spec.tokenizer, name="smollm2-draft")  # its own KV
    drafter = ModelDrafter(smollm, gemma.tokenizer)
    assert not drafter.same_tokenizer
    plain = Speculator(gemma, speculate=False, memory=None)
    drafted = Speculator(gemma, drafters=[drafter], cost=ALWAYS_DRAFT, memory=None)
    for prompt in ("The three primary colors are", "def fibonacci(n):\n    "):
        out = drafted.generate(prompt, 16)
        assert out.token_ids == plain.generate(prompt, 16).token_ids
        assert out.stats.drafted.get("model", 0) > 0
