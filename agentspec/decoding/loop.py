"""The decode loop: propose -> sanitise -> score -> verify -> commit -> observe, one target
pass per step.

A generator of :class:`Step`, so streaming and ``generate`` are the same code. Invariant between
steps: the target's KV holds every committed token but the last one. Another call may use the
target between two steps (the Speculator's turns): a step first restores the KV for its own
tokens (prefix reuse, the same bits: ``tests/integration/test_invariance.py``), so
interleaving never changes an output.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass

import torch

from agentspec.config import SamplingParams
from agentspec.decoding.sampling import Mask
from agentspec.decoding.untrusted import Guarded
from agentspec.decoding.verify import cut_at_spine, verify
from agentspec.engine.target import HFTarget
from agentspec.grammar.state import GrammarState
from agentspec.protocols import DraftContext, Drafter, StepObserver
from agentspec.text import cut_at_stop
from agentspec.tree import depths
from agentspec.types import EMPTY_DRAFT, Draft, Verdict


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
           generator: torch.Generator | None = None,
           grammar_drafts: bool = True,
           lazy_masks: bool = True,
           observers: Sequence[StepObserver] = ()) -> Generator[Step, None, None]:
    """Generate up to ``max_new_tokens`` tokens after ``context.tokens``, appending to it.

    Args:
        target: the model; its KV is reset here.
        drafter: any source of drafts; untrusted: its drafts are sanitised, and if it raises
            it is logged once and the call goes on as plain decoding.
        context: the prompt tokens (extended in place with every committed token).
        sampling: greedy or the sampling parameters every emitted token follows exactly.
        stop_token_ids: a committed stop token ends the generation and is not emitted.
        generator: the explicit random source for sampling.
        grammar_drafts: with ``sampling.grammar``, append the tokens the grammar forces to
            every draft (free drafts; plain decoding turns them off).
        lazy_masks: with ``sampling.grammar`` and greedy decoding, masks on demand
            (:class:`~agentspec.grammar.state.LazyMasks`): a row is masked only where its argmax is
            a token the grammar forbids. Same outputs.
        observers: watch each step after its verdict (:class:`~agentspec.protocols.StepObserver`;
            the draft head's training rows are kept this way). Read only: no token depends
            on them.
    """
    grammar = None if sampling.grammar is None else GrammarState(
        sampling.grammar, target.tokenizer, vocab_size=target.vocab_size,
        eos_ids=sorted(stop_token_ids), device=target.device)
    # 1. Prefill: the KV takes every prompt token but the last.
    target.start(context.tokens)
    guarded = Guarded(drafter, vocab_size=target.vocab_size, max_nodes=target.max_draft_nodes)
    guarded.begin(context)
    try:
        yield from _steps(target, guarded, context, sampling, max_new_tokens, stop_token_ids,
                          generator, grammar, grammar_drafts, lazy_masks and sampling.greedy,
                          tuple(observers))
    finally:
        guarded.end(context)
        if grammar is not None:
            grammar.close()  # its matcher serves the next call of the same grammar


def _steps(target: HFTarget, drafter: Guarded, context: DraftContext, sampling: SamplingParams,
           max_new_tokens: int, stop_token_ids: frozenset[int],
           generator: torch.Generator | None, grammar: GrammarState | None,
           grammar_drafts: bool, lazy_masks: bool,
           observers: tuple[StepObserver, ...] = ()) -> Iterator[Step]:
    produced = 0
    keep_hidden = any(o.wants_hidden for o in observers)
    # One uniform per output position, so a seeded sample does not depend on the drafts.
    uniforms = None if sampling.greedy else torch.rand(
        max_new_tokens, generator=generator, device=target.device)  # [max_new_tokens]
    while produced < max_new_tokens:
        # 2. Propose, leaving room for the recovered/bonus token; drafts are untrusted (the
        # guard sanitises them).
        room = max_new_tokens - produced - 1
        draft = drafter.propose(context, max_tokens=room)
        # 2b. A grammar prunes what it forbids, adds what it forces, and masks every row.
        allowed: Mask = None
        if grammar is not None:
            draft, allowed = grammar.constrain(draft, room=max(room, 0),
                                               max_nodes=target.max_draft_nodes,
                                               force=grammar_drafts, lazy=lazy_masks)
        # 3. Score the last committed token and the whole draft in one forward, on a KV that
        # holds this generation: checked here, after the drafters ran (one may have used the
        # target for a call of its own) and after other calls since our last step.
        if not target.holds(context.tokens):
            target.start(context.tokens)
        logits = target.score(context.tokens[-1], draft,
                              keep_hidden=keep_hidden)  # [num_nodes + 1, vocab_size]
        # 4. Verify exactly (one host sync), deciding only on spine rows.
        rows = None if uniforms is None else uniforms[_row_offsets(draft, produced)]
        verdict = cut_at_spine(draft, verify(draft, logits, sampling, generator, uniforms=rows,
                                             allowed=allowed))
        for observer in observers:
            observer.step(target, draft, verdict)
        # 5. Commit: the KV keeps the accepted path only.
        target.commit(draft, verdict)
        new_tokens, stopped = cut_at_stop(verdict.new_tokens, stop_token_ids)
        context.tokens.extend(new_tokens)
        produced += len(new_tokens)
        if grammar is not None:
            grammar.advance(new_tokens)
        # 6. Observe: drafters learn from what was accepted.
        drafter.observe(context, draft, verdict)
        yield Step(draft, verdict, new_tokens, stopped)
        if stopped:
            return


def _row_offsets(draft: Draft, produced: int) -> torch.Tensor:
    """Output position of each scored row: the root's next token, then each node's."""
    return torch.tensor([produced, *(produced + d for d in depths(draft.parents))])
