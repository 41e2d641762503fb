"""Statistical exactness of the verifier on small synthetic targets.

A synthetic target assigns a fixed random distribution to every prefix of up to 3 tokens over a
4-token vocabulary. We decode 3 tokens many times with speculation (chain, tree and ratio
drafts) and compare the joint distribution of the 3 tokens with the exact one (a product of
the target's conditionals) by a chi-square test. Threshold: p > 0.001 for the real verifier;
the same test must give p < 0.001 for a deliberately wrong verifier (shown below), so it has
the power to catch a bias.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from agentspec.config import SamplingParams
from agentspec.decoding.sampling import logits_to_probs
from agentspec.decoding.verify import verify, walk
from agentspec.types import Draft, Verdict
from tests.stats import p_value

V, LENGTH, DRAWS, ALPHA = 4, 3, 50_000, 1e-3
WRONG_DRAWS = 20_000  # enough power to reject each wrong verifier by a wide margin


# Tiny tensors: intra-op threads only add synchronisation cost (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


def make_table(seed: int, scale: float = 1.5) -> dict[tuple[int, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    table = {}
    for n in range(LENGTH + 3):
        for prefix in itertools.product(range(V), repeat=n):
            table[prefix] = torch.randn(V, generator=g) * scale
    return table


TARGET = make_table(0)
DRAFT_Q = make_table(1, scale=1.0)


def exact_joint(sampling: SamplingParams) -> np.ndarray:
    out = np.zeros(V**LENGTH)
    for i, seq in enumerate(itertools.product(range(V), repeat=LENGTH)):
        p = 1.0
        for t in range(LENGTH):
            p *= float(logits_to_probs(TARGET[seq[:t]][None], sampling)[0, seq[t]])
        out[i] = p
    return out


def chain_draft(prefix, g):
    return Draft.chain([(sum(prefix) + k) % V for k in range(3)], "c")


def tree_draft(prefix, g):
    a = sum(prefix) % V
    # a -> {a+1, a+2}, a+3 -> {a}
    return Draft((a, (a + 1) % V, (a + 2) % V, (a + 3) % V, a), (-1, 0, 0, -1, 3), "t")


def ratio_draft(prefix, g):
    toks, rows = [], []
    for _ in range(2):
        q = torch.softmax(DRAFT_Q[tuple(prefix) + tuple(toks)], -1)
        toks.append(int(torch.multinomial(q, 1, generator=g)))
        rows.append(q)
    return Draft.chain(toks, "model", draft_probs=torch.stack(rows))


def node_prefixes(draft: Draft) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for i, p in enumerate(draft.parents):
        out.append((out[p] if p >= 0 else ()) + (draft.token_ids[i],))
    return out


def run(make_draft, sampling, verifier, seed=123, draws=DRAWS) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(V**LENGTH)
    for _ in range(draws):
        seq: list[int] = []
        while len(seq) < LENGTH:
            draft = make_draft(seq, g)
            rows = [TARGET[tuple(seq)]] + [TARGET[tuple(seq) + p] for p in node_prefixes(draft)]
            verdict = verifier(draft, torch.stack(rows), sampling, g)
            seq.extend(verdict.new_tokens)
        counts[int(np.ravel_multi_index(seq[:LENGTH], (V,) * LENGTH))] += 1
    return counts


T1 = SamplingParams(temperature=1.0)
TRUNC = SamplingParams(temperature=0.8, top_k=3, top_p=0.9)


# The ratio test under truncation in make test-long (make test's time): make test holds the
# ratio test at temperature 1 and truncation on trees.
@pytest.mark.parametrize(
    ("make_draft", "sampling"),
    [(chain_draft, T1), (tree_draft, T1), (tree_draft, TRUNC), (ratio_draft, T1),
     pytest.param(ratio_draft, TRUNC, marks=pytest.mark.long)],
    ids=["chain", "tree", "tree-topk-topp", "ratio", "ratio-topk-topp"],
)
def test_verifier_is_exact(make_draft, sampling):
    assert p_value(run(make_draft, sampling, verify), exact_joint(sampling)) > ALPHA


# --- Deliberately wrong verifiers: the same test must reject them. ---------------------------

def accept_if_possible(draft, logits, sampling, g):
    """Wrong: accepts every draft token the target gives non-zero probability."""
    probs = logits_to_probs(logits, sampling)
    path, node = [], -1
    for i in range(draft.num_nodes):
        if draft.parents[i] == node and probs[node + 1, draft.token_ids[i]] > 0.05:
            path.append(i)
            node = i
    nxt = int(torch.multinomial(probs[node + 1], 1, generator=g))
    return Verdict(tuple(path), tuple(draft.token_ids[i] for i in path), nxt)


def ratio_recover_from_p(draft, logits, sampling, g):
    """Wrong: samples the recovered token from p instead of norm(max(0, p - q))."""
    p = logits_to_probs(logits, sampling)
    q = draft.draft_probs
    for i, x in enumerate(draft.token_ids):
        if float(torch.rand(1, generator=g)) >= min(1.0, float(p[i, x] / q[i, x])):
            nxt = int(torch.multinomial(p[i], 1, generator=g))
            return Verdict(tuple(range(i)), tuple(draft.token_ids[:i]), nxt)
    nxt = int(torch.multinomial(p[-1], 1, generator=g))
    return Verdict(tuple(range(draft.num_nodes)), draft.token_ids, nxt)


def walk_that_trusts_draft(draft, logits, sampling, g):
    """Wrong: a point-mass walk that also descends when the sample misses, half the time."""
    samples = torch.multinomial(logits_to_probs(logits, sampling), 1, generator=g).squeeze(-1).tolist()
    verdict = walk(draft, samples)
    if not verdict.path and draft.num_nodes and float(torch.rand(1, generator=g)) < 0.5:
        return Verdict((0,), (draft.token_ids[0],), samples[1])
    return verdict


@pytest.mark.parametrize(
    ("make_draft", "wrong"),
    [(tree_draft, accept_if_possible), (ratio_draft, ratio_recover_from_p),
     (chain_draft, walk_that_trusts_draft)],
    ids=["greedy-accept", "ratio-wrong-residual", "biased-walk"],
)
def test_wrong_verifier_is_rejected(make_draft, wrong):
    assert p_value(run(make_draft, T1, wrong, draws=WRONG_DRAWS), exact_joint(T1)) < ALPHA
