"""Drafts from the completion memory: replay the past completions of similar requests.

Once per request, ``begin`` fetches the top-k most similar past completions of the same scope
and model fingerprint. Every step, each candidate proposes what follows the generated text in
it: the candidate that has matched every generated token so far continues from that position;
the others re-align on the longest suffix n-gram of the context (the same tool call with other
arguments realigns after the argument). The candidates' continuations merge into one prefix
tree, best first, each node marked with how many candidates back it (``Draft.support``).
Accepted tokens are credited to the records they came from, in the request's own ledger
(:meth:`MemoryDrafter.credits`), which the memory hears when the request ends.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from agentspec.drafters.ngram import NgramIndex
from agentspec.memory.foreign import as_memory
from agentspec.protocols import Credits, DraftContext
from agentspec.tree import child_index, merge_chains, node_support
from agentspec.types import EMPTY_DRAFT, Draft, Verdict

# Match strength of a candidate that has matched every generated token so far (n-gram
# realignments score their match length, at most 8).
_FOLLOWING = 100
# Cosine similarity of a request's own earlier completion (identical key text, up to rounding).
_SAME_REQUEST = 0.999


@dataclass
class _Request:
    """One request's candidates, the owner of each node of its last draft, and the accepted
    tokens each record drafted in it (keyed ``(memory, record id)``, :data:`Credits`)."""

    cands: list[_Candidate] = field(default_factory=list)
    # The last draft's (parent node, token) -> node, and each node's candidate (into cands):
    # the verified draft may be a reordered subset of it, so accepted tokens are matched by path.
    children: dict[tuple[int, int], int] = field(default_factory=dict)
    owners: list[int] = field(default_factory=list)
    credits: Credits = field(default_factory=Counter)


@dataclass
class _Candidate:
    record_id: int | None  # None: a user's memory gave a record without an id (never credited)
    ids: list[int]
    similarity: float
    follow: int = 0  # position in ids that matched every generated token so far; -1 when not
    index: NgramIndex = field(default_factory=lambda: NgramIndex(2, 8))


class MemoryDrafter:
    """Top-k semantic neighbours' completions, aligned to the generated tail, as a draft tree.

    Args:
        memory: a :class:`~agentspec.memory.CompletionMemory` or a memory of the user's
            (:func:`~agentspec.memory.as_memory`).
        model: the target's fingerprint; entries of another model are never used.
        k: neighbours fetched per request.
        min_similarity: neighbours below this cosine similarity are ignored.
        max_nodes: node budget of the merged tree.
    """

    name = "memory"

    def __init__(self, memory: Any, model: str, *, k: int = 8, min_similarity: float = 0.3,
                 max_nodes: int = 64) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.memory, self.model, self.k = as_memory(memory), model, k
        self.min_similarity, self.max_nodes = min_similarity, max_nodes

    def _request(self, context: DraftContext) -> _Request:
        return context.state(self, _Request)

    def prefetch(self, key_text: str, scope: str) -> None:
        """Start the lookup a request of ``key_text`` in ``scope`` will ``begin`` with, on the
        memory's worker thread (:meth:`~agentspec.protocols.Memory.prefetch`)."""
        self.memory.prefetch(key_text, scope=scope, model=self.model, k=self.k,
                             min_similarity=self.min_similarity)

    def begin(self, context: DraftContext) -> None:
        req = self._request(context)
        if not context.key_text:
            return
        hits = self.memory.lookup(context.key_text, scope=context.scope, model=self.model,
                                  k=self.k, min_similarity=self.min_similarity)
        req.cands = [_Candidate(rec.id, list(rec.completion_ids), sim)
                     for rec, sim in hits if sim >= self.min_similarity and rec.completion_ids]

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        req = self._request(context)
        chains: list[tuple[tuple[int, float], list[int], int]] = []
        tail = context.tokens[-8:]
        for i, cand in enumerate(req.cands):
            if cand.follow >= 0:
                start, strength = cand.follow, _FOLLOWING
            else:
                strength, start = cand.index.match(cand.ids, tail)
            cont = cand.ids[start : start + max_tokens] if strength else []
            if cont:
                chains.append(((strength, cand.similarity), cont, i))
        if not chains:
            req.children, req.owners = {}, []
            return EMPTY_DRAFT
        chains.sort(key=lambda c: c[0], reverse=True)
        # "memory/follow": the best candidate has matched every generated token so far. Before
        # the first token every candidate trivially has, so only the request's own repeat
        # (similarity ~1) counts then: the neighbours' first steps, right for a few tokens of
        # a shared opening and wrong after, would drag the class down for the real followers.
        (strength, similarity), _, _ = chains[0]
        following = strength == _FOLLOWING and (
            len(context.tokens) > context.prompt_len or similarity >= _SAME_REQUEST)
        tokens, parents, owners = merge_chains([(c[1], str(c[2])) for c in chains],
                                               min(self.max_nodes, max(max_tokens, 1) * len(chains)))
        req.owners = [int(o) for o in owners]
        req.children = child_index(tokens, parents)
        # Per node, how many candidates continue this way: a token the neighbours agree on is
        # what such requests produce; where they part, one of them is right at best.
        support = node_support(tokens, parents, (c[1] for c in chains))
        return Draft(tuple(tokens), tuple(parents), self.name, support=support,
                     acceptance="memory/follow" if following else None)

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        req = self._request(context)
        if draft.source == self.name:
            node = -1
            for tok in verdict.accepted:
                node = req.children.get((node, tok), -1)
                if node < 0:
                    break
                record_id = req.cands[req.owners[node]].record_id
                if record_id is not None:
                    req.credits[(self.memory, record_id)] += 1
        new = verdict.new_tokens
        for cand in req.cands:
            if cand.follow >= 0:
                end = cand.follow + len(new)
                cand.follow = end if cand.ids[cand.follow : end] == list(new) else -1

    def end(self, context: DraftContext) -> None:
        pass

    def credits(self, context: DraftContext) -> Credits:
        """The accepted draft tokens each remembered completion drafted in this request, for
        the caller to hand to the memory when the request ends."""
        return self._request(context).credits
