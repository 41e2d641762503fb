"""Scope-wide suffix matching over every past completion (after SuffixDecoding, Oliaro et al. 2024).

Where the semantic neighbours run out, any past completion of the scope may still contain the
current tail: a JSON shape, a tool name, a closing phrase. The drafter keeps, per scope, the
concatenated token ids of the scope's completions and an n-gram table of every occurrence; a
proposal gathers the continuations of all occurrences of the longest matching suffix and
orders them by how often they occur (frequency-weighted, as SuffixDecoding's tree does), each
node marked with how many occurrences back it (``Draft.support``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from agentspec.memory.foreign import as_memory
from agentspec.protocols import DraftContext
from agentspec.tree import merge_chains, node_support
from agentspec.types import EMPTY_DRAFT, Draft, Verdict

_SEP = -1  # separates completions in the flat token list


@dataclass
class _ScopeText:
    tokens: list[int] = field(default_factory=list)
    table: dict[tuple[int, ...], list[int]] = field(default_factory=lambda: defaultdict(list))
    watermark: int = 0


class SuffixDrafter:
    """Frequency-ordered continuations of the longest suffix match over a scope's completions.

    Args:
        memory: a :class:`~agentspec.memory.CompletionMemory` or a memory of the user's
            (:func:`~agentspec.memory.as_memory`; read by id watermark through
            its ``completions``).
        model: the target's fingerprint.
        n_min / n_max: suffix match lengths.
        max_occurrences: continuations kept per n-gram (the most recent).
        max_branches: distinct continuations merged into the draft tree.
        max_scope_tokens: per-scope bound on indexed tokens.
    """

    name = "suffix"

    def __init__(self, memory: Any, model: str, *, n_min: int = 3, n_max: int = 8,
                 max_occurrences: int = 32, max_branches: int = 3,
                 max_scope_tokens: int = 400_000) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.memory, self.model = as_memory(memory), model
        self.n_min, self.n_max = n_min, n_max
        self.max_occurrences, self.max_branches = max_occurrences, max_branches
        self.max_scope_tokens = max_scope_tokens
        self._scopes: dict[str, _ScopeText] = {}  # shared by all requests of a scope

    def begin(self, context: DraftContext) -> None:
        state = self._scopes.setdefault(context.scope, _ScopeText())
        # ends early (never raises) while the memory's store fails
        for rec in self.memory.completions(scope=context.scope, model=self.model,
                                           after_id=state.watermark):
            self._append(state, list(rec.completion_ids))
            state.watermark = max(state.watermark, rec.id or 0)
        if len(state.tokens) > self.max_scope_tokens:  # keep the most recent completions
            fresh = _ScopeText(watermark=state.watermark)
            kept = state.tokens[-self.max_scope_tokens // 2 :]
            self._append(fresh, [t for t in kept if t != _SEP])
            state = self._scopes[context.scope] = fresh
        self._scope_text(context).append(state)  # this request's scope text

    def _append(self, state: _ScopeText, ids: list[int]) -> None:
        base = len(state.tokens)
        state.tokens.extend(ids)
        state.tokens.append(_SEP)
        for stop in range(base + self.n_min, base + len(ids)):
            for n in range(self.n_min, min(self.n_max, stop - base) + 1):
                occ = state.table[tuple(state.tokens[stop - n : stop])]
                occ.append(stop)
                if len(occ) > self.max_occurrences:
                    del occ[0]

    def _scope_text(self, context: DraftContext) -> list[_ScopeText]:
        """This request's scope text (a list of at most one: empty before ``begin``)."""
        return context.state(self, list[_ScopeText])

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        current = self._scope_text(context)
        state = current[-1] if current else None
        if state is None or not state.tokens:
            return EMPTY_DRAFT
        tail = context.tokens[-self.n_max :]
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            occ = state.table.get(tuple(tail[-n:]))
            if occ:
                return self._draft(state.tokens, occ, max_tokens)
        return EMPTY_DRAFT

    def _draft(self, tokens: list[int], occ: list[int], max_tokens: int) -> Draft:
        conts: list[list[int]] = []
        for start in reversed(occ):  # most recent first breaks frequency ties
            end = start
            while end < len(tokens) and end - start < max_tokens and tokens[end] != _SEP:
                end += 1
            if end > start:
                conts.append(tokens[start:end])
        if not conts:
            return EMPTY_DRAFT
        freq = Counter(tuple(c[:4]) for c in conts)
        seen: set[tuple[int, ...]] = set()
        chains: list[tuple[list[int], str]] = []
        for c in sorted(conts, key=lambda c: -freq[tuple(c[:4])]):
            if tuple(c[:4]) not in seen:
                seen.add(tuple(c[:4]))
                chains.append((c, self.name))
            if len(chains) == self.max_branches:
                break
        ids, parents, _ = merge_chains(chains, max_nodes=max_tokens * len(chains))
        # Per node, how many of the occurrences continue this way (SuffixDecoding scores its
        # tree's nodes by these frequencies; the drafter chain learns a rate per level).
        return Draft(tuple(ids), tuple(parents), self.name, support=node_support(ids, parents, conts))

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        pass

    def end(self, context: DraftContext) -> None:
        self._scope_text(context).clear()
