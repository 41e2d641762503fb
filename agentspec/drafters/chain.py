"""The drafter chain: each step, the draft with the best expected tokens per second.

Drafters are asked in priority order. Each proposes its longest continuation; the chain sizes
it with the cost-aware policy (:mod:`agentspec.drafters.policy`) from that source's acceptance
so far, and keeps the one with the highest expected rate, or none when plain decoding is
faster. A drafter's own time to propose (measured, a running mean) counts in its rate, and a
drafter is not asked at all when even its best possible draft could not beat the best one in
hand: a small model's forwards are only paid for when lookup has nothing as good.

No source is starved of evidence. Choosing one source per step and learning only from the one
chosen is a bandit without exploration: a source whose prior is lower is never tried, so its
estimate never moves (on single-turn tool calls the memory kept drafting, rejected, while
prompt lookup, never tried, would have been right). But every proposal of a step can be scored
against what the step committed: the committed tokens are the target's own, so a proposal's
first path would have been accepted up to its common prefix with them, and rejected there if
the prefix ends before both. Each step therefore updates every source that proposed (full
information, as in prediction with expert advice): a prefix that reaches the end of what was
committed is a censored observation (``accepted`` tokens, no rejection), exactly the
likelihood of a geometric acceptance run. With every estimate fed every step, the greedy choice
needs no exploration: it follows the source whose recent acceptance is best.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from agentspec.decoding.untrusted import Guarded, wants_hidden
from agentspec.drafters.policy import (
    DEFAULT_COST,
    Acceptance,
    CostModel,
    SharedCost,
    best_subtree,
    best_tree_rate,
    node_probabilities,
)
from agentspec.protocols import Credits, DraftContext, Drafter, Proposal, StepShare
from agentspec.tree import common_prefix_len, depths, spine_length, sub_draft
from agentspec.types import EMPTY_DRAFT, Draft, Verdict

# Per-token acceptance before any evidence: remembered completions are usually right, and one
# that has matched every generated token so far ("memory/follow") almost always.
PRIORS = {"memory": 0.85, "memory/follow": 0.97, "suffix": 0.6, "prompt_lookup": 0.5,
          "prompt_lookup/1": 0.2, "model": 0.6, "head": 0.5}
# How often a tree's alternative branch is right where the first one was wrong, before evidence.
ALTERNATIVE_PRIOR = 0.3
# A skipped drafter is asked again once the skipped steps took this many times its own cost.
PROBE_RATIO = 30
# A node's support class by how many of its drafter's candidates back it (index: the count,
# the last entry for any count beyond): one, two or three, four or more.
SUPPORT_CLASSES = ("s1", "s1", "s2", "s2", "s4")


class AcceptanceKey(NamedTuple):
    """An acceptance class the chain learns a rate for: a proposal's ``source`` (the drafter's
    name, or the finer class it declared, :attr:`~agentspec.types.Draft.acceptance`), refined
    per node by whether the request's context holds the node's token right after its
    parent's (``seen``), then by how many of the drafter's candidates back it (``support``,
    one of :data:`SUPPORT_CLASSES`; only under ``seen``). Printed as ``source|seen|s2``
    (``new`` where not seen), as the chain's reports name classes.

    Immutable, and a tuple so that hashing and comparing it (per node, every step) cost what
    a string's do."""

    source: str
    seen: bool | None = None
    support: str | None = None

    @property
    def name(self) -> str:
        """The drafter the class is of: the source up to its first ``/`` (``memory`` for
        ``memory/follow``), whose prior a declared class without one of its own starts from."""
        return self.source.partition("/")[0]

    @property
    def coarser(self) -> AcceptanceKey | None:
        """The class this one refines (its rate is learned over that one's); None for a
        source's own class."""
        source, seen, support = self
        if support is not None:
            return _make_key(AcceptanceKey, (source, seen, None))
        if seen is not None:
            return _make_key(AcceptanceKey, (source, None, None))
        return None

    def of(self, drafter: str) -> bool:
        """Whether a draft of ``drafter`` may get this class: its own name, or a class it
        declares under it (``drafter/...``), at any refinement."""
        return self.source == drafter or self.source.startswith(drafter + "/")

    def __str__(self) -> str:
        out = self.source if self.seen is None else f"{self.source}|{'seen' if self.seen else 'new'}"
        return out if self.support is None else f"{out}|{self.support}"


# Builds a key from its three fields without the named tuple's Python-level constructor (the
# chain walks up the refinements of every node's class each step).
_make_key = tuple.__new__


def alternatives_tried(parents: tuple[int, ...], path: tuple[int, ...]) -> tuple[int, int]:
    """``(tried, right)``: nodes on the accepted path (and where it ended) at which the first
    child was wrong and alternatives existed; ``right`` is 1 where one of them was accepted."""
    first: dict[int, int] = {}
    count: dict[int, int] = {}
    for node, parent in enumerate(parents):
        first.setdefault(parent, node)
        count[parent] = count.get(parent, 0) + 1
    tried = right = 0
    at = -1
    for node in path:
        if count.get(at, 0) > 1 and node != first[at]:  # went down an alternative
            tried += 1
            right += 1
        at = node
    if count.get(at, 0) > 1:  # the path ended where every branch was wrong
        tried += 1
    return tried, right


def trim_to_depth(draft: Draft, depth: int) -> Draft:
    """Keep the nodes at depth <= ``depth`` (parents come first, so indices stay ordered)."""
    d = depths(draft.parents)
    if max(d) <= depth:
        return draft
    return sub_draft(draft, [i for i in range(draft.num_nodes) if d[i] <= depth])


def first_path(draft: Draft) -> Draft:
    """The chain of first children from the root: a tree's best candidate, for chain-only models."""
    path, node = [], -1
    for i, p in enumerate(draft.parents):
        if p == node:
            path.append(i)
            node = i
    source = draft.source if isinstance(draft.source, str) else draft.source[path[0]]
    probs = None if draft.draft_probs is None else draft.draft_probs[path]
    support = None if draft.support is None else tuple(draft.support[i] for i in path)
    return Draft.chain([draft.token_ids[i] for i in path], source, probs, support,
                       draft.acceptance)


@dataclass
class _Request:
    """One request's view of the chain: its sources (each guarded: one that raises is skipped
    for the rest of the request), which have not been timed yet, and the acceptance class of
    the draft its last ``propose`` returned, and every source's proposal of that step (its
    acceptance class and first path), scored against the committed tokens in ``observe``."""

    sources: list[Guarded]
    untimed: set[str] = field(default_factory=set)
    proposals: list[tuple[tuple[AcceptanceKey, ...], tuple[int, ...]]] = field(default_factory=list)
    # Every pair of consecutive tokens of the context, and how many of its tokens they cover.
    pairs: set[tuple[int, int]] = field(default_factory=set)
    paired: int = 0


class DrafterChain:
    """Picks, per step, among several drafters' proposals by expected tokens per second.

    Args:
        drafters: in priority order (ties go to the earlier one).
        cost: the target's measured forward cost.
        trees: False flattens tree drafts to their best chain (targets without tree masks).
        max_depth: no draft goes deeper than this.
    """

    name = "chain"

    def __init__(self, drafters: Sequence[Drafter], *, cost: CostModel = DEFAULT_COST,
                 trees: bool = True, max_depth: int = 64) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.drafters = list(drafters)
        self.max_depth = max_depth
        self.cost = cost
        self.trees = trees
        self.acceptance = {AcceptanceKey(d.name): Acceptance(PRIORS.get(d.name, 0.5))
                           for d in self.drafters}
        # Per source: how often a tree's alternative branch was right where its first was wrong.
        self.alternatives = {d.name: Acceptance(ALTERNATIVE_PRIOR) for d in self.drafters}
        # Seconds a drafter takes to propose (running mean: a lookup costs far less than a
        # model drafter, whose proposal is forwards of its own).
        self.propose_seconds = {d.name: 0.0 for d in self.drafters}
        self._skipped = {d.name: 0 for d in self.drafters}

    def _request(self, context: DraftContext) -> _Request:
        return context.state(self, lambda: _Request([Guarded(d) for d in self.drafters]))

    def begin(self, context: DraftContext) -> None:
        req = self._request(context)
        # A request's first proposal does lazy per-request work (indexing the prompt, a draft
        # model's prefill): it is not timed as the drafter's cost.
        req.untimed = {d.name for d in req.sources}
        for d in req.sources:
            d.begin(context)

    @property
    def wants_hidden(self) -> bool:
        """Whether a source reads the target's final hidden rows (the draft head)."""
        return any(wants_hidden(d) for d in self.drafters)

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        """The best proposal by expected tokens per second, the request alone in its step."""
        return self.propose_sized(context, max_tokens=max_tokens, share=None).draft

    def propose_sized(self, context: DraftContext, *, max_tokens: int,
                      share: StepShare | None) -> Proposal:
        """The best proposal by expected tokens per second; in a batched step (``share``: what
        the step's other rows cost and yield) by the whole step's, each node against its
        marginal row. With the tokens it is expected to yield, the scheduler's to weigh."""
        req = self._request(context)
        cost: CostModel | SharedCost = self.cost if share is None else SharedCost(
            self.cost, share.rows, share.seconds)
        base = 0.0 if share is None else share.tokens
        best, best_rate = EMPTY_DRAFT, (1.0 + base) / cost.seconds(0)
        best_expected = 1.0
        req.proposals = []
        tokens = context.tokens
        start = max(req.paired, 1)  # add the pairs that end at tokens not covered yet
        req.pairs.update(zip(tokens[start - 1 : -1], tokens[start:], strict=True))
        req.paired = len(tokens)
        max_tokens = min(max_tokens, self.max_depth)
        for drafter in req.sources:
            if drafter.failed:
                continue
            # A source whose best possible draft would lose is not asked, until the skipped
            # steps' time reaches PROBE_RATIO times its own cost: re-probing then costs at
            # most ~1/PROBE_RATIO of the time, and a source cheaper than 1/PROBE_RATIO of a
            # forward is asked every step (the bound is not even computed for it).
            skipped = self._skipped[drafter.name] + 1
            if (skipped * self.cost.seconds(0) < PROBE_RATIO * self.propose_seconds[drafter.name]
                    and self._best_rate(drafter.name, max_tokens,
                                        self.propose_seconds[drafter.name], cost, base) <= best_rate):
                self._skipped[drafter.name] = skipped
                continue
            self._skipped[drafter.name] = 0
            started = time.perf_counter()
            draft = drafter.propose(context, max_tokens=max_tokens, share=share).draft  # sanitised
            spent = self._timed(req, drafter.name, time.perf_counter() - started)
            if draft.num_nodes == 0:
                continue
            # A drafter may name a finer acceptance class for this proposal (the memory: a
            # candidate that has matched every generated token so far); the chain refines it
            # per node (:meth:`_node_keys`).
            key = AcceptanceKey(draft.acceptance or drafter.name)
            if not self.trees and not draft.is_chain:
                draft = first_path(draft)
            keys = self._node_keys(req.pairs, context, key, draft)
            spine = spine_length(draft.parents)
            req.proposals.append((keys[:spine], draft.token_ids[:spine]))
            rates = {k: self.rate(k) for k in set(keys)}
            alphas = [rates[k] for k in keys]
            alternative = self.alternatives[drafter.name].alpha
            keep, rate = best_subtree(draft.parents, alphas, cost, spent, alternative, base=base)
            if keep and rate > best_rate:
                best, best_rate = sub_draft(draft, keep), rate
                probs = node_probabilities(draft.parents, alphas, alternative)
                best_expected = 1.0 + sum(probs[i] for i in keep)
        return Proposal(best, best_expected)

    @staticmethod
    def _node_keys(pairs: set[tuple[int, int]], context: DraftContext, key: AcceptanceKey,
                   draft: Draft) -> tuple[AcceptanceKey, ...]:
        """Each node's acceptance class: the proposal's ``key`` refined by whether the
        request's context (its consecutive token ``pairs``) holds the node's token right after
        its parent's (``key|seen``) or not (``key|new``), and, for a draft that carries its
        nodes' support (:attr:`~agentspec.types.Draft.support`), refined again by how many of
        the drafter's candidates back the node (``|s1``: one, ``|s2``: two or three,
        ``|s4``: four or more).

        A copy goes wrong where its source differed from this request: a remembered call's
        argument value came from its own request, and is a pair of tokens this one does not
        hold. Where several remembered completions agree, the token is what this kind of
        request produces, not one request's own; where they part, the draft is a guess between
        them. Each refinement starts from the rate of the class it refines and learns its
        own (:meth:`rate`).
        """
        last = context.tokens[-1] if context.tokens else -1
        ids = draft.token_ids
        seen, new = AcceptanceKey(key.source, True), AcceptanceKey(key.source, False)
        keys = (seen if (ids[p] if p >= 0 else last, t) in pairs else new
                for t, p in zip(ids, draft.parents, strict=True))
        if draft.support is None:  # a sanitized draft's support fits its nodes
            return tuple(keys)
        top = len(SUPPORT_CLASSES) - 1
        return tuple(_make_key(AcceptanceKey, (k.source, k.seen, SUPPORT_CLASSES[min(c, top)]))
                     for k, c in zip(keys, draft.support, strict=True))

    def _acceptance(self, key: AcceptanceKey) -> Acceptance:
        if key not in self.acceptance:
            self.acceptance[key] = (Acceptance.refining() if key.coarser is not None else
                                    Acceptance(PRIORS.get(key.source, PRIORS.get(key.name, 0.5))))
        return self.acceptance[key]

    def rate(self, key: AcceptanceKey) -> float:
        """The acceptance rate of class ``key``; a refinement over the rate of the class it
        refines (:attr:`AcceptanceKey.coarser`, :meth:`Acceptance.alpha_over`)."""
        coarser = key.coarser
        acc = self._acceptance(key)
        return acc.alpha_over(self.rate(coarser)) if coarser is not None else acc.alpha

    def _best_rate(self, name: str, max_tokens: int, spent: float,
                   cost: CostModel | SharedCost, base: float) -> float:
        """The best rate any draft from source ``name`` could reach, chain or tree, by the
        best of its acceptance classes (``memory`` and ``memory/follow``: which one a
        proposal gets is known only once it is made)."""
        alpha = max(self.rate(key) for key in list(self.acceptance) if key.of(name))
        return best_tree_rate(alpha, cost, spent, max_depth=max_tokens, base=base,
                              alternative=self.alternatives[name].alpha if self.trees else 0.0)

    def _timed(self, req: _Request, name: str, seconds: float) -> float:
        if name in req.untimed:
            req.untimed.discard(name)
            return self.propose_seconds[name]
        old = self.propose_seconds[name]
        # A running mean; a re-probe replaces a larger estimate outright (it was a hiccup, or
        # the drafter got faster), so one slow call cannot keep a drafter out for long.
        self.propose_seconds[name] = seconds if old == 0.0 or seconds < old / 2 else (
            0.8 * old + 0.2 * seconds)
        return self.propose_seconds[name]

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        req = self._request(context)
        committed = verdict.new_tokens
        for keys, spine in req.proposals:  # every source that proposed, chosen or not
            accepted = common_prefix_len(spine, committed)
            rejected = accepted < min(len(spine), len(committed))
            # Each class met on the way, and each coarser class it refines: its accepted nodes,
            # and the rejection where it fell.
            counts: dict[AcceptanceKey, list[int]] = {}
            for i, node_key in enumerate(keys[: accepted + rejected]):
                key: AcceptanceKey | None = node_key
                while key is not None:
                    counts.setdefault(key, [0, 0])[i >= accepted] += 1
                    key = key.coarser
            for key, (hits, misses) in counts.items():
                self._acceptance(key).add(hits, misses)
        req.proposals = []
        if draft.num_nodes:
            name = draft.source_of(0)
            if name in self.alternatives:
                tried, right = alternatives_tried(draft.parents, verdict.path)
                if tried:
                    self.alternatives[name].update(tried, right)
        for d in req.sources:
            d.observe(context, draft, verdict)

    def proposals(self, context: DraftContext) -> list[tuple[str, tuple[int, ...]]]:
        """Every proposal of the request's last ``propose``, chosen or not: its first node's
        acceptance class (as printed, :class:`AcceptanceKey`) and its first path (what the
        replays' hindsight ceilings choose among)."""
        return [(str(keys[0]) if keys else "", spine)
                for keys, spine in self._request(context).proposals]

    def end(self, context: DraftContext) -> None:
        for d in self._request(context).sources:
            d.end(context)

    def credits(self, context: DraftContext) -> Credits:
        """The request's credits, its sources' together (the memory drafter's)."""
        total: Credits = Counter()
        for d in self._request(context).sources:
            total.update(d.credits(context))
        return total

