"""The decode loop: propose -> score -> verify -> commit -> observe, one target pass per step.

A generator of :class:`Step`, so streaming and ``generate`` are the same code. Invariant between
steps: the target's KV holds every committed token but the last one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from agentspec.config import SamplingParams
from agentspec.protocols import DraftContext, Drafter
from agentspec.target import HFTarget
from agentspec.tree import depths, preorder
from agentspec.types import EMPTY_DRAFT, Draft, Verdict
from agentspec.verify import cut_at_spine, verify


@dataclass(frozen=True)
class Step:
    """One target pass: the draft, the verdict, and the tokens it committed.

    ``new_tokens`` is the verdict's output cut before the first stop token; ``stopped`` says a
    stop token ended the generation there.
    """

    draft: Draft
    verdict: Verdict
    new_tokens: tuple[int, ...]
    stopped: bool


class NoDrafter:
    """Plain decoding through the same loop: every draft is empty."""

    name = "none"

    def begin(self, context: DraftContext) -> None:
        pass

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        return EMPTY_DRAFT

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        pass

    def end(self, context: DraftContext) -> None:
        pass


def decode(target: HFTarget, drafter: Drafter, context: DraftContext, *,
           sampling: SamplingParams, max_new_tokens: int, stop_token_ids: frozenset[int],
           generator: torch.Generator | None = None) -> Iterator[Step]:
    """Generate up to ``max_new_tokens`` tokens after ``context.tokens``, appending to it.

    Args:
        target: the model; its KV is reset here.
        drafter: any source of drafts; its drafts are untrusted.
        context: the prompt tokens (extended in place with every committed token).
        sampling: greedy or the sampling parameters every emitted token follows exactly.
        stop_token_ids: a committed stop token ends the generation and is not emitted.
        generator: the explicit random source for sampling.
    """
    # 1. Prefill: the KV takes every prompt token but the last.
    target.start(context.tokens)
    drafter.begin(context)
    try:
        yield from _steps(target, drafter, context, sampling, max_new_tokens, stop_token_ids,
                          generator)
    finally:
        drafter.end(context)


def _steps(target: HFTarget, drafter: Drafter, context: DraftContext, sampling: SamplingParams,
           max_new_tokens: int, stop_token_ids: frozenset[int],
           generator: torch.Generator | None) -> Iterator[Step]:
    produced = 0
    # One uniform per output position, so a seeded sample does not depend on the drafts.
    uniforms = None if sampling.greedy else torch.rand(
        max_new_tokens, generator=generator, device=target.device)  # [max_new_tokens]
    while produced < max_new_tokens:
        # 2. Propose, leaving room for the recovered/bonus token.
        room = max_new_tokens - produced - 1
        draft = drafter.propose(context, max_tokens=room) if room > 0 else EMPTY_DRAFT
        draft = _sanitize(draft, target.vocab_size, room, target.max_draft_nodes)
        # 3. Score the last committed token and the whole draft in one forward.
        logits = target.score(context.tokens[-1], draft)  # [num_nodes + 1, vocab_size]
        # 4. Verify exactly (one host sync), deciding only on spine rows.
        rows = None if uniforms is None else uniforms[_row_offsets(draft, produced)]
        verdict = cut_at_spine(draft, verify(draft, logits, sampling, generator, uniforms=rows))
        # 5. Commit: the KV keeps the accepted path only.
        target.commit(draft, verdict)
        new_tokens, stopped = _cut_at_stop(verdict.new_tokens, stop_token_ids)
        context.tokens.extend(new_tokens)
        produced += len(new_tokens)
        # 6. Observe: drafters learn from what was accepted.
        drafter.observe(context, draft, verdict)
        yield Step(draft, verdict, new_tokens, stopped)
        if stopped:
            return


def _row_offsets(draft: Draft, produced: int) -> torch.Tensor:
    """Output position of each scored row: the root's next token, then each node's."""
    return torch.tensor([produced, *(produced + d for d in depths(draft.parents))])


def _sanitize(draft: Draft, vocab_size: int, room: int, max_nodes: int) -> Draft:
    """Drafts are untrusted: keep only nodes with in-vocabulary ids, valid ancestors and a
    depth that fits ``room``, in depth-first order (first children form the spine, see
    :func:`~agentspec.tree.preorder`), at most ``max_nodes`` of them."""
    if draft.num_nodes == 0:
        return draft
    if draft.is_chain and draft.num_nodes <= min(room, max_nodes) and (
            0 <= min(draft.token_ids) and max(draft.token_ids) < vocab_size):
        return draft
    valid: dict[int, int] = {-1: 0}  # kept node -> its depth
    for i, (tok, par) in enumerate(zip(draft.token_ids, draft.parents, strict=True)):
        if par in valid and 0 <= tok < vocab_size and valid[par] < room:
            valid[i] = valid[par] + 1
    kept = [i for i in valid if i >= 0]
    parents = [draft.parents[i] for i in kept]
    position = {old: new for new, old in enumerate(kept)}
    order = preorder([-1 if p < 0 else position[p] for p in parents])[:max_nodes]
    keep = [kept[i] for i in order]
    if not keep:
        return EMPTY_DRAFT
    remap = {old: new for new, old in enumerate(keep)}
    source = draft.source if isinstance(draft.source, str) else tuple(draft.source[i] for i in keep)
    return Draft(tuple(draft.token_ids[i] for i in keep),
                 tuple(-1 if draft.parents[i] < 0 else remap[draft.parents[i]] for i in keep),
                 source, None if draft.draft_probs is None else draft.draft_probs[keep])


def _cut_at_stop(tokens: tuple[int, ...], stop_ids: frozenset[int]) -> tuple[tuple[int, ...], bool]:
    for i, tok in enumerate(tokens):
        if tok in stop_ids:
            return tokens[:i], True
    return tokens, False
