"""The replay's ``held past the draft`` account: where a chain's tokens per step fall short of
the ceiling's (:mod:`agentspec.bench.replay`).

Each step, every proposal the chain asked for is scored against the output as if verified
whole (its spine): ``cut`` sums how far the verified draft's source's own proposal would have
held past the nodes the step accepted, or, in a step that verified no draft, the best proposal
(the sizing left out what would have held); ``other`` how far the best other proposal would
have held past both (the choice of source). What is left of the gap is steps where no proposal
held at all, and where the ceiling's steps begin.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentspec.protocols import DraftContext, Drafter
from agentspec.tree import common_prefix_len, spine_length
from agentspec.types import Draft, Verdict


class Recorder:
    """A drafter that keeps its proposal of the current step, for the replay's account of
    what the proposals would have held (:func:`held_past`). Everything else, the
    acceptance class a chain reads after ``propose`` included, is the drafter's own."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.last: Draft | None = None

    def __getattr__(self, attr: str) -> Any:  # only for what this class does not define
        return getattr(self.drafter, attr)

    def begin(self, context: DraftContext) -> None:
        self.drafter.begin(context)

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        self.last = self.drafter.propose(context, max_tokens=max_tokens)
        return self.last

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        self.drafter.observe(context, draft, verdict)

    def end(self, context: DraftContext) -> None:
        self.drafter.end(context)


def held_past(recorders: Sequence[Recorder], draft: Draft, accepted: int,
              todo: Sequence[int]) -> tuple[int, int]:
    """``(cut, other)`` for one step: how far the proposal of the verified draft's source would
    have held, verified whole, past the ``accepted`` nodes (with no draft verified: the best
    proposal), and how far the best other proposal would have held past both. ``todo``: the
    output from the step on, the stop last; a proposal is scored by its spine, leaving the step
    its next token."""
    source = draft.source_of(0) if draft.num_nodes else None
    chosen = best = 0
    for rec in recorders:
        if rec.last is None or rec.last.num_nodes == 0:
            continue
        spine = rec.last.token_ids[: spine_length(rec.last.parents)]
        held = min(common_prefix_len(spine, todo), len(todo) - 1)
        best = max(best, held)
        if rec.name == source:
            chosen = held
    if source is None:  # no draft: the sizing (or plain decoding's rate) left every one out
        return best, 0
    return max(0, chosen - accepted), max(0, best - max(chosen, accepted))
