"""The draft head's drafts stay exact: statistics on a tiny random model, through the real loop.

A tiny random target (LlamaConfig from a config, no hub) over a 4-token vocabulary and a
random :class:`~agentspec.drafters.head.RecurrentHead` on its embeddings. We decode 4 tokens
many times through :func:`agentspec.decoding.loop.decode` with the head drafting from the target's
hidden rows (the first step has none: plain), and compare the joint distribution of the 4
tokens with the exact one (a product of the target's processed conditionals, from plain
forwards) by a chi-square test. Threshold: p > 0.001 for the real drafts:

* a beam-search tree (branches on): a deterministic draft, verified by the point-mass walk;
* a chain drawn from q with q attached (``sampling_aware``): Leviathan's ratio test.

The same test must give p < 0.001 for a deliberately wrong head drafter, which attaches the
beam's q to its beam-searched (deterministic) chain: the ratio test then believes the token
was drawn from q, and the output is biased (shown below). Greedy drafts equal plain decoding.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from agentspec import SamplingParams
from agentspec.decoding.loop import NoDrafter
from agentspec.decoding.sampling import logits_to_probs
from agentspec.drafters.head import HeadDrafter, RecurrentHead, beam_search
from agentspec.engine.target import HFTarget
from agentspec.protocols import DraftContext
from agentspec.scheduler import decode
from agentspec.types import Draft
from tests.stats import p_value

V, LENGTH, PROMPT, ALPHA = 4, 4, (1, 2, 3), 1e-3
DRAWS, WRONG_DRAWS = 800, 800  # the wrong drafter gave p < 1e-5 at 800 draws (3 seeds)
T = SamplingParams(temperature=0.7)


class TinyTokenizer:
    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(V)}

    def __len__(self) -> int:
        return V


# Tiny tensors: intra-op threads only add synchronisation cost (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> tuple[HFTarget, RecurrentHead]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=False, initializer_range=0.5)
    target = HFTarget(LlamaForCausalLM(config).eval(), TinyTokenizer(), name="tiny-head")
    head = RecurrentHead(target.model.get_input_embeddings().weight.detach().float(),
                         target.model.get_output_embeddings().weight.detach().float(),
                         torch.arange(V))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.4)
    return target, head.eval()


def exact_joint(target: HFTarget, sampling: SamplingParams) -> np.ndarray:
    out = np.zeros(V**LENGTH)
    with torch.inference_mode():
        for i, seq in enumerate(itertools.product(range(V), repeat=LENGTH)):
            logits = target.model(input_ids=torch.tensor([[*PROMPT, *seq[:-1]]])).logits[0]
            probs = logits_to_probs(logits[-LENGTH:], sampling)  # [LENGTH, V]
            out[i] = float(np.prod([float(probs[t, seq[t]]) for t in range(LENGTH)]))
    return out


class BeamWithQ(HeadDrafter):
    """Wrong: a beam-searched (deterministic) chain that carries the head's q as if sampled."""

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        state = self._state(context)
        head = self.head_for(context.scope)
        if head is None or state.h is None or state.position != len(context.tokens) - 2:
            return Draft()
        tree = beam_search(head, state.h, context.tokens[-1], width=self.width,
                           depth=min(self.depth, max_tokens))
        toks = list(tree.token_ids[: tree.spine])
        if not toks:
            return Draft()
        rows, s, tok = [], torch.zeros(1, head.hidden), torch.tensor([context.tokens[-1]])
        with torch.inference_mode():
            for t in toks:
                s, logits = head.step(s, tok, state.h[None])
                assert context.sampling is not None
                rows.append(logits_to_probs(logits, context.sampling)[0])
                tok = torch.tensor([t])
        return Draft.chain(toks, self.name, torch.stack(rows))


def run(target: HFTarget, drafter, sampling: SamplingParams, draws: int,
        seed: int = 11) -> tuple[np.ndarray, int, int]:
    """Counts of the outputs, accepted draft tokens, and steps whose draft was a tree."""
    g = torch.Generator().manual_seed(seed)
    counts, accepted, trees = np.zeros(V**LENGTH), 0, 0
    for _ in range(draws):
        context = DraftContext(tokens=list(PROMPT), prompt_len=len(PROMPT), scope="s",
                               sampling=sampling, generator=g)
        for step in decode(target, drafter, context, sampling=sampling, max_new_tokens=LENGTH,
                           stop_token_ids=frozenset(), generator=g):
            accepted += len(step.verdict.accepted)
            trees += not step.draft.is_chain
        counts[int(np.ravel_multi_index(context.generated[:LENGTH], (V,) * LENGTH))] += 1
    return counts, accepted, trees


def test_head_tree_is_exact_under_sampling(tiny):
    target, head = tiny
    drafter = HeadDrafter(target.fork(), {"s": head}, width=3, depth=3, branches=True)
    counts, accepted, trees = run(drafter.target, drafter, T, DRAWS)
    assert accepted > DRAWS // 2 and trees > DRAWS // 2  # trees were drafted and accepted
    assert p_value(counts, exact_joint(target, T)) > ALPHA


def test_head_sampled_chain_with_q_is_exact(tiny):
    target, head = tiny
    drafter = HeadDrafter(target.fork(), {"s": head}, depth=2, sampling_aware=True)
    counts, accepted, _ = run(drafter.target, drafter, T, DRAWS)
    assert accepted > DRAWS // 2
    assert p_value(counts, exact_joint(target, T)) > ALPHA


def test_beam_chain_carrying_q_is_rejected(tiny):
    target, head = tiny
    wrong = BeamWithQ(target.fork(), {"s": head}, width=3, depth=2)
    counts, accepted, _ = run(wrong.target, wrong, T, WRONG_DRAWS)
    assert accepted > 0
    assert p_value(counts, exact_joint(target, T)) < ALPHA


def test_greedy_head_drafts_equal_plain_decoding(tiny):
    target, head = tiny
    greedy = SamplingParams()
    for prompt in ([1, 2, 3], [3, 3, 0, 1], [2]):
        outs = []
        for drafter in (NoDrafter(), HeadDrafter(target.fork(), {"s": head}, width=3, depth=4,
                                                 branches=True)):
            twin = drafter.target if isinstance(drafter, HeadDrafter) else target.fork()
            context = DraftContext(tokens=list(prompt), prompt_len=len(prompt), scope="s",
                                   sampling=greedy)
            list(decode(twin, drafter, context, sampling=greedy, max_new_tokens=12,
                        stop_token_ids=frozenset()))
            outs.append(context.generated)
        assert outs[0] == outs[1]
