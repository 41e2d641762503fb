"""Exact acceptance: pure functions from (draft, target logits) to a Verdict.

Two rules, both exact:

* Point-mass drafts (prompt lookup, memory, suffix; a chain or a tree). Sample the processed
  target distribution once at every node (argmax when greedy), then walk from the root: while
  the sample at the current node is the token of one of its children, descend; otherwise emit
  the sample and stop. Each emitted token is a draw from the target at its own prefix, so the
  output is distributed exactly as plain decoding. This is the deterministic-draft special case
  of Leviathan et al. (2023): accepting x with probability p(x) and otherwise drawing from
  norm(p with x removed) is the same as drawing y ~ p and accepting iff y == x.
* Probabilistic drafts (a small model's chain with its probabilities): Leviathan et al. 2023,
  Algorithm 1. p is the target distribution, q the draft distribution; accept x with
  probability min(1, p(x) / q(x)); at the first rejection sample the recovered token from
  norm(max(0, p - q)); when every token is accepted sample the bonus token from p.

Either way one device-to-host transfer per step.
"""

from __future__ import annotations

import torch

from agentspec.config import SamplingParams
from agentspec.sampling import logits_to_probs, sample
from agentspec.tree import child_index
from agentspec.types import Draft, Verdict


def target_samples(logits: torch.Tensor, sampling: SamplingParams,
                   generator: torch.Generator | None) -> torch.Tensor:
    """One target draw per row of ``logits`` ``[num_nodes + 1, vocab_size]`` -> ``[num_nodes + 1]``."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return sample(logits_to_probs(logits, sampling), generator)


def walk(draft: Draft, samples: list[int]) -> Verdict:
    """Descend the draft tree while each node's target sample names one of its children.

    Args:
        draft: the tree (``num_nodes`` nodes).
        samples: host list of ``num_nodes + 1`` target draws; ``samples[0]`` is drawn after the
            root, ``samples[i + 1]`` after node ``i``.
    """
    if draft.num_nodes == 0:
        return Verdict((), (), samples[0])
    children = child_index(draft.token_ids, draft.parents) if not draft.is_chain else None
    path: list[int] = []
    node = -1
    while True:
        tok = samples[node + 1]
        if children is None:  # chain: the only child of node is node + 1
            nxt = node + 1 if node + 1 < draft.num_nodes and draft.token_ids[node + 1] == tok else None
        else:
            nxt = children.get((node, tok))
        if nxt is None:
            return Verdict(tuple(path), tuple(draft.token_ids[i] for i in path), tok)
        path.append(nxt)
        node = nxt


def verify_point_mass(draft: Draft, logits: torch.Tensor, sampling: SamplingParams,
                      generator: torch.Generator | None = None) -> Verdict:
    """Exact acceptance of a point-mass draft (chain or tree); see the module docstring."""
    samples = target_samples(logits, sampling, generator).tolist()  # the one host sync
    return walk(draft, samples)


def verify_ratio(draft: Draft, logits: torch.Tensor, sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> Verdict:
    """Leviathan et al. (2023) Algorithm 1 for a chain drafted with probabilities q.

    Args:
        draft: a chain with ``draft_probs`` q ``[num_nodes, vocab_size]``; token ``i`` was
            drawn from ``q[i]``.
        logits: target logits ``[num_nodes + 1, vocab_size]``.
    """
    if sampling.greedy:  # p is a point mass at the argmax: the ratio test reduces to the walk
        return verify_point_mass(draft, logits, sampling, generator)
    if not draft.is_chain or draft.draft_probs is None:
        raise ValueError("verify_ratio needs a chain draft with draft_probs")
    n = draft.num_nodes
    p = logits_to_probs(logits, sampling)  # [n + 1, vocab_size]
    q = draft.draft_probs.to(p.device, torch.float32)  # [n, vocab_size]
    x = torch.tensor(draft.token_ids, device=p.device)  # [n]
    rows = torch.arange(n, device=p.device)
    p_x, q_x = p[rows, x], q[rows, x]  # [n]
    u = torch.rand(n, generator=generator, device=p.device)
    accept = u * q_x < p_x  # u < p(x)/q(x), written without a division by q(x) = 0
    residual = (p[:n] - q).clamp_min(0)  # [n, vocab_size]
    mass = residual.sum(dim=-1, keepdim=True)
    # Where p == q the residual is empty, but then rejection is impossible: any row will do.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:n])
    recovered = sample(residual, generator)  # [n]
    bonus = sample(p[n:], generator)  # [1]
    host = torch.cat([accept.long(), recovered, bonus]).tolist()  # the one host sync
    accepted_mask, recovered_l, bonus_tok = host[:n], host[n : 2 * n], host[2 * n]
    k = next((i for i, a in enumerate(accepted_mask) if not a), n)
    next_token = recovered_l[k] if k < n else bonus_tok
    return Verdict(tuple(range(k)), tuple(draft.token_ids[:k]), next_token)


def verify(draft: Draft, logits: torch.Tensor, sampling: SamplingParams,
           generator: torch.Generator | None = None) -> Verdict:
    """Dispatch: the ratio test for drafts carrying probabilities, else the point-mass walk."""
    if draft.draft_probs is not None:
        return verify_ratio(draft, logits, sampling, generator)
    return verify_point_mass(draft, logits, sampling, generator)
