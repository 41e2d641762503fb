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

Point-mass sampling draws each row by inverse CDF from one uniform per row; the decode loop
passes the uniform of each row's *output position* (drawn once per request from its seed), so
a seeded sampled output does not depend on how the drafts split it into steps.

Only rows on the draft's spine are bitwise what plain decoding computes (see
:mod:`agentspec.engine.forward`); :func:`cut_at_spine` ends a verdict at the first node off the spine,
whose token (a draw at its parent, a spine row) becomes the next token.
"""

from __future__ import annotations

import torch

from agentspec.config import SamplingParams
from agentspec.decoding.sampling import (
    Mask,
    greedy_host,
    greedy_tokens,
    logits_to_probs,
    sample,
    sample_inverse_cdf,
)
from agentspec.tree import child_index, spine_prefix
from agentspec.types import Draft, Verdict


def target_samples(logits: torch.Tensor, sampling: SamplingParams,
                   generator: torch.Generator | None,
                   uniforms: torch.Tensor | None = None,
                   allowed: Mask = None) -> torch.Tensor:
    """One target draw per row of ``logits`` ``[num_nodes + 1, vocab_size]`` -> ``[num_nodes + 1]``.

    Sampled rows use ``uniforms`` ``[num_nodes + 1]`` (one per row, in [0, 1)) when given,
    else fresh draws from ``generator``. ``allowed`` (bool, the logits' shape) is the
    grammar's mask of each row, applied before anything else.
    """
    if sampling.greedy:
        return greedy_tokens(logits, allowed)
    if uniforms is None:
        uniforms = torch.rand(logits.shape[0], generator=generator, device=logits.device)
    return sample_inverse_cdf(logits_to_probs(logits, sampling, allowed), uniforms)


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
                      generator: torch.Generator | None = None, *,
                      uniforms: torch.Tensor | None = None,
                      allowed: Mask = None) -> Verdict:
    """Exact acceptance of a point-mass draft (chain or tree); see the module docstring."""
    if sampling.greedy:  # one host sync
        samples = greedy_host(logits, allowed)
    else:
        samples = target_samples(logits, sampling, generator, uniforms, allowed).tolist()
    return walk(draft, samples)


def cut_at_spine(draft: Draft, verdict: Verdict) -> Verdict:
    """End ``verdict`` at its first node off the draft's spine: that node's token is the
    target's draw at its parent (a spine row), so it becomes the next token, and no logits of
    an off-spine row decide anything."""
    j = spine_prefix(draft.parents, verdict.path)
    if j == len(verdict.path):
        return verdict
    return Verdict(verdict.path[:j], verdict.accepted[:j], draft.token_ids[verdict.path[j]])


def verify_ratio(draft: Draft, logits: torch.Tensor, sampling: SamplingParams,
                 generator: torch.Generator | None = None, *,
                 allowed: Mask = None) -> Verdict:
    """Leviathan et al. (2023) Algorithm 1 for a chain drafted with probabilities q.

    Args:
        draft: a chain with ``draft_probs`` q ``[num_nodes, vocab_size]``; token ``i`` was
            drawn from ``q[i]``.
        logits: target logits ``[num_nodes + 1, vocab_size]``.
        allowed: the grammar's mask per row (bool, the logits' shape) or None; p is masked.
    """
    if sampling.greedy:  # p is a point mass at the argmax: the ratio test reduces to the walk
        return verify_point_mass(draft, logits, sampling, generator, allowed=allowed)
    if not draft.is_chain or draft.draft_probs is None:
        raise ValueError("verify_ratio needs a chain draft with draft_probs")
    n = draft.num_nodes
    p = logits_to_probs(logits, sampling, allowed)  # [n + 1, vocab_size]
    # [n, vocab_size]; a drafter's bad values (NaN, negative) must not crash the step
    q = torch.nan_to_num(draft.draft_probs.to(p.device, torch.float32), nan=0.0, posinf=0.0,
                         neginf=0.0).clamp_min(0)
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
    return Verdict.chain(draft.token_ids[:k], next_token)


def verify(draft: Draft, logits: torch.Tensor, sampling: SamplingParams,
           generator: torch.Generator | None = None, *,
           uniforms: torch.Tensor | None = None,
           allowed: Mask = None) -> Verdict:
    """Dispatch: the ratio test for drafts carrying probabilities, else the point-mass walk
    (with ``uniforms``, one per row, for its sampled rows). ``allowed``: the grammar's mask of
    each row (:mod:`agentspec.grammar.state`), or None."""
    if draft.draft_probs is not None:
        return verify_ratio(draft, logits, sampling, generator, allowed=allowed)
    return verify_point_mass(draft, logits, sampling, generator, uniforms=uniforms,
                             allowed=allowed)
