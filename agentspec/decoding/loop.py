"""The decode loop: propose -> sanitise -> score -> verify -> commit -> observe, one target
pass per step.

:class:`Decoding` is one request's loop cut at the forward: :meth:`Decoding.plan` proposes and
constrains the step's draft and returns its rows; the forward that scores them may carry other
requests' rows too (the scheduler's steps, :mod:`agentspec.scheduler`, the only caller of the
engine's forward for a request); :meth:`Decoding.conclude` verifies, commits and observes.
:func:`agentspec.scheduler.decode` runs one request alone through a scheduler of its own,
a generator of :class:`Step`. Invariant between steps: the request's sequence holds every committed token but
the last one.

The loop is the one writer of its request's :class:`~agentspec.protocols.DraftContext`: the
committed tokens and the last step's hidden rows. The drafters read it; what the scheduler
tells them (the step's share of a batched forward) comes as a value through :meth:`plan`, and
what they answer (the tokens a proposal is expected to yield) goes back as one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from agentspec.config import SamplingParams
from agentspec.decoding.sampling import Mask, token_logprobs
from agentspec.decoding.untrusted import Guarded
from agentspec.decoding.verify import cut_at_spine, verify, walk
from agentspec.engine.plan import Member, draft_member
from agentspec.engine.sequence import Sequence as KVSequence
from agentspec.engine.target import HFTarget
from agentspec.grammar.state import GrammarState
from agentspec.protocols import DraftContext, Drafter, StepObserver, StepShare
from agentspec.text import cut_at_stop
from agentspec.tree import depths, sub_draft
from agentspec.types import EMPTY_DRAFT, TARGET_ORIGIN, Draft, TokenLogprob, Verdict


@dataclass(frozen=True)
class Step:
    """One target pass: the draft, the verdict, and the tokens it committed.

    ``new_tokens`` is the verdict's output cut before the first stop token; ``stopped`` says a
    stop token ended the generation there. ``logprobs``: one per new token when the request's
    ``SamplingParams.logprobs`` asks for them, else None.
    """

    draft: Draft
    verdict: Verdict
    new_tokens: tuple[int, ...]
    stopped: bool
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def origins(self) -> tuple[str, ...]:
        """Where each of ``new_tokens`` came from: the draft source of each accepted node,
        then :data:`~agentspec.types.TARGET_ORIGIN` for the token the target chose itself
        (the recovered or bonus token); cut where ``new_tokens`` is."""
        out = [self.draft.source_of(node) for node in self.verdict.path]
        out.append(TARGET_ORIGIN)
        return tuple(out[: len(self.new_tokens)])


class Planned(NamedTuple):
    """A request's part of the next forward: its ``rows`` (the last committed token, then the
    draft) and the tokens the step is expected to commit (the drafter's estimate; 1.0 where
    it sizes nothing), which the scheduler counts in the next request's share."""

    rows: Member
    expected_tokens: float


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


class Decoding:
    """One request's decode loop between forwards, on sequence ``seq`` of ``target``.

    Args:
        target: the model (its forward scores the rows :meth:`plan` returns).
        seq: the request's sequence, holding every prompt token but the last (prefilled).
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

    def __init__(self, target: HFTarget, seq: KVSequence, drafter: Drafter,
                 context: DraftContext, *, sampling: SamplingParams, max_new_tokens: int,
                 stop_token_ids: frozenset[int], generator: torch.Generator | None = None,
                 grammar_drafts: bool = True, lazy_masks: bool = True,
                 observers: Sequence[StepObserver] = ()) -> None:
        self.target, self.seq, self.context = target, seq, context
        self.sampling, self.max_new_tokens = sampling, max_new_tokens
        self.stop_token_ids, self.generator = stop_token_ids, generator
        self.grammar_drafts = grammar_drafts
        self.lazy_masks = lazy_masks and sampling.greedy
        self.observers = tuple(observers)
        self.grammar = None if sampling.grammar is None else GrammarState(
            sampling.grammar, target.tokenizer, vocab_size=target.vocab_size,
            eos_ids=sorted(stop_token_ids), device=target.device)
        self.drafter = Guarded(drafter, vocab_size=target.vocab_size,
                               max_nodes=target.max_draft_nodes)
        self.produced = 0
        self.done = False
        # One uniform per output position, so a seeded sample does not depend on the drafts.
        self._uniforms = None if sampling.greedy else torch.rand(
            max_new_tokens, generator=generator, device=target.device)  # [max_new_tokens]
        self._draft: Draft = EMPTY_DRAFT
        self._allowed: Mask = None

    @property
    def wants_hidden(self) -> bool:
        """Whether the step's forward should keep the final hidden rows (an observer or a
        drafter reads them)."""
        return self.drafter.wants_hidden or any(o.wants_hidden for o in self.observers)

    def begin(self) -> None:
        self.drafter.begin(self.context)

    def end(self) -> None:
        """The drafters' end of the request; the grammar's matcher back for the next one."""
        try:
            self.drafter.end(self.context)
        finally:
            if self.grammar is not None:
                self.grammar.close()

    def plan(self, max_nodes: int | None = None, share: StepShare | None = None) -> Planned:
        """Steps 2 and 2b: propose a draft (untrusted: the guard sanitises it, leaving room for
        the recovered or bonus token), let a grammar prune what it forbids, add what it forces
        and mask every row; the rows to score: the last committed token, then the draft.
        ``max_nodes``: the draft's first nodes only (depth first: the spine first), where a
        batched step has fewer rows left. ``share``: what the step's other rows cost and yield
        (None: the request is alone), handed to the drafters that size their drafts."""
        room = self.max_new_tokens - self.produced - 1
        draft, expected = self.drafter.propose(self.context, max_tokens=room, share=share)
        cap = self.target.max_draft_nodes if max_nodes is None else min(
            max_nodes, self.target.max_draft_nodes)
        if draft.num_nodes > cap:
            draft = sub_draft(draft, list(range(cap)))
        allowed: Mask = None
        if self.grammar is not None:
            draft, allowed = self.grammar.constrain(draft, room=max(room, 0), max_nodes=cap,
                                                    force=self.grammar_drafts, lazy=self.lazy_masks)
        self._draft, self._allowed = draft, allowed
        return Planned(draft_member(self.seq, self.context.tokens[-1], draft), expected)

    @property
    def argmax_decides(self) -> bool:
        """Whether this step's verdict is a walk over the rows' plain argmax (greedy, no
        grammar mask): the scheduler then takes every such request's argmax in one copy."""
        return self.sampling.greedy and self._allowed is None

    def conclude(self, logits: torch.Tensor, hidden: torch.Tensor | None = None,
                 argmax: list[int] | None = None) -> Step:
        """Steps 4 to 6 on the planned rows' ``logits`` ``[num_nodes + 1, vocab_size]``: verify
        exactly (one host sync; none where the rows' ``argmax`` is given, when
        :attr:`argmax_decides`), deciding only on spine rows; commit the accepted path into
        the sequence; let the drafters learn from it."""
        draft, context = self._draft, self.context
        if argmax is not None and self.argmax_decides:
            verdict = cut_at_spine(draft, walk(draft, argmax))
        else:
            rows = None if self._uniforms is None else self._uniforms[
                _row_offsets(draft, self.produced)]
            verdict = cut_at_spine(draft, verify(draft, logits, self.sampling, self.generator,
                                                 uniforms=rows, allowed=self._allowed))
        for observer in self.observers:
            observer.step(hidden, draft, verdict)
        position = self.seq.kv_len if hidden is not None else -1  # the root's position
        self.seq.commit(context.tokens[-1], verdict)
        new_tokens, stopped = cut_at_stop(verdict.new_tokens, self.stop_token_ids)
        logprobs = None if self.sampling.logprobs is None else token_logprobs(
            logits, deciding_rows(verdict)[: len(new_tokens)], new_tokens, self.sampling.logprobs)
        context.tokens.extend(new_tokens)
        self.produced += len(new_tokens)
        if self.grammar is not None:
            self.grammar.advance(new_tokens)
        context.hidden, context.hidden_position = hidden, position
        self.drafter.observe(context, draft, verdict)
        self.done = stopped or self.produced >= self.max_new_tokens
        return Step(draft, verdict, new_tokens, stopped, logprobs)


def deciding_rows(verdict: Verdict) -> list[int]:
    """The row of a step's forward that decided each of ``verdict.new_tokens``: the root's row
    (0) the first, then the row of each accepted node (its index + 1) the token after it. After
    :func:`~agentspec.decoding.verify.cut_at_spine` these are spine rows, bitwise the rows plain
    decoding computes at those positions."""
    return [0, *(node + 1 for node in verdict.path)]


def _row_offsets(draft: Draft, produced: int) -> torch.Tensor:
    """Output position of each scored row: the root's next token, then each node's."""
    return torch.tensor([produced, *(produced + d for d in depths(draft.parents))])
