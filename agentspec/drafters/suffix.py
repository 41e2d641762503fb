"""Suffix matching over every past completion of a scope, and over the request's own text
(after SuffixDecoding, Oliaro et al. 2024).

Where the semantic neighbours run out, any past completion of the scope may still contain the
current tail: a JSON shape, a tool name, a closing phrase; and the request's own prompt holds
the tool schemas and values a call copies. The drafter keeps, per scope, the concatenated
token ids of the scope's completions, and per request (``own_text``) its prompt and generated
tokens, each with an n-gram table of every occurrence (``n_min`` to ``n_max`` tokens). Given an
:class:`OutputIndex`, it also matches what every request of the process has generated, across
scopes and while those requests still run (as vLLM's ``suffix`` method does): a model repeats
its own phrasings (a refusal, a JSON layout) from one tool set to the next.

A proposal finds the occurrences of the longest matching n-gram, then extends each match
backwards as far as the request's tail agrees (up to ``max_match`` tokens): the longer the
shared context, the more specific the continuation (a parameter name after this tool's name,
not after any tool's). Only the occurrences with the longest context are kept, and the draft
follows, at each depth, the token most of them continue with (SuffixDecoding's frequency
walk); each node is marked with how many occurrences back it (``Draft.support``) and the
proposal with its context length's acceptance class (``suffix/<length class>``), so the
drafter chain learns how far each class of match is right.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentspec.memory.foreign import as_memory
from agentspec.protocols import DraftContext
from agentspec.tree import merge_chains, node_support
from agentspec.types import EMPTY_DRAFT, Draft, Verdict

_SEP = -1  # separates completions in the flat token list
_POS_BITS = 24  # an output index entry: its segment above these bits, its position below
# A match's context length by class: its acceptance is learned per class (the lower bounds).
MATCH_CLASSES = (1, 2, 3, 6, 12, 24)


def gram_lengths(n_min: int, n_max: int) -> tuple[int, ...]:
    """The n-gram lengths indexed: ``n_min``, ``n_max`` and the powers of two between. A
    match found at one is extended backwards to its full length anyway, so the lengths between
    are left out (half the table)."""
    powers = {1 << i for i in range(n_max.bit_length()) if n_min <= 1 << i <= n_max}
    return tuple(sorted(powers | {n_min, n_max}))


def match_class(length: int) -> int:
    """The class (lower bound of :data:`MATCH_CLASSES`) a context length falls in."""
    return max([c for c in MATCH_CLASSES if c <= length], default=MATCH_CLASSES[0])


@dataclass
class _Text:
    """A token list and where each n-gram of it occurs (the position right after it)."""

    tokens: list[int] = field(default_factory=list)
    table: dict[tuple[int, ...], list[int]] = field(default_factory=lambda: defaultdict(list))
    indexed: int = 0  # n-grams ending before this position are in the table
    watermark: int = 0  # the scope's: the highest completion id read


@dataclass
class _Request:
    """One request's texts (the scope's, its own), its own text, its output segment."""

    texts: list[_Text] = field(default_factory=list)
    own: _Text | None = None
    segment: int = 0
    begun: bool = False


class OutputIndex:
    """What every request of a process has generated, one segment per request, indexed as it
    grows; the oldest segments go first once ``max_tokens`` are held.

    Shared by the requests of one :class:`SuffixDrafter` (and so across scopes: give it only
    where requests may draft from each other's outputs). Thread-safe: requests begin and end
    on one thread while others draft on another. Compact, since it lives as long as the
    engine: an n-gram is keyed by its hash (a collision is caught where the occurrence is
    read back) and an occurrence is one int (segment and position); the table is rebuilt from
    the held segments once as many tokens have been evicted as are held.
    """

    def __init__(self, n_min: int = 3, n_max: int = 8, *, max_tokens: int = 100_000,
                 max_occurrences: int = 64) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.n_min, self.n_max = n_min, n_max
        self.lengths = gram_lengths(n_min, n_max)
        self.max_tokens, self.max_occurrences = max_tokens, max_occurrences
        self._segments: OrderedDict[int, list[int]] = OrderedDict()
        self._table: dict[int, list[int]] = defaultdict(list)
        self._held = self._evicted = 0
        self._next = 0
        self._lock = threading.Lock()

    def open(self) -> int:
        """A new (empty) segment; returns its id."""
        with self._lock:
            self._next += 1
            self._segments[self._next] = []
            return self._next

    def extend(self, segment: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to ``segment`` (gone already: ignored) and index its n-grams."""
        with self._lock:
            seg = self._segments.get(segment)
            if seg is None:
                return
            start = len(seg)
            seg.extend(int(t) for t in tokens)
            self._index(segment, seg, start)
            self._held += len(seg) - start
            while self._held > self.max_tokens and len(self._segments) > 1:
                _, old = self._segments.popitem(last=False)
                self._held -= len(old)
                self._evicted += len(old)
            if self._evicted > self._held:  # most entries point at evicted segments
                self._table = defaultdict(list)
                self._evicted = 0
                for sid, held in self._segments.items():
                    self._index(sid, held, 0)

    def _index(self, segment: int, seg: list[int], start: int) -> None:
        """Index the n-grams of ``seg`` that continue with a token from ``start`` on."""
        table, base = self._table, segment << _POS_BITS
        for stop, gram in _grams(seg, max(start, 1), len(seg), self.lengths):
            _add(table[hash(gram)], base + stop, self.max_occurrences)

    def find(self, gram: tuple[int, ...], exclude: int = 0) -> list[tuple[list[int], int]]:
        """``(segment tokens, stop)`` of each held occurrence of ``gram`` with a
        continuation, outside segment ``exclude``."""
        n, mask = len(gram), (1 << _POS_BITS) - 1
        with self._lock:
            segments, out = self._segments, []
            for entry in self._table.get(hash(gram), ()):
                sid, stop = entry >> _POS_BITS, entry & mask
                seg = segments.get(sid)
                if seg is not None and sid != exclude and stop < len(seg) \
                        and tuple(seg[stop - n : stop]) == gram:
                    out.append((seg, stop))
            return out


class SuffixDrafter:
    """Frequency-walked continuations of the longest context match, over a scope's completions,
    the request's own text and the outputs of every request (each where configured).

    Args:
        memory: a :class:`~agentspec.memory.CompletionMemory` or a memory of the user's
            (:func:`~agentspec.memory.as_memory`; read by id watermark through its
            ``completions``); None: the request's own text only.
        model: the target's fingerprint.
        n_min / n_max: the shortest and longest n-gram indexed (:func:`gram_lengths`: the powers
            of two between too); a match starts from the longest that occurs.
        max_match: how far back a match is extended to rank occurrences.
        own_text: also match the request's own prompt and generated tokens.
        outputs: match what every request of the drafter has generated, across scopes
            (:class:`OutputIndex`); each request's tokens are added as it runs.
        max_occurrences: occurrences kept per n-gram (the most recent).
        max_branches: distinct continuations merged into the draft tree.
        max_scope_tokens: per-scope bound on indexed tokens.
    """

    name = "suffix"

    def __init__(self, memory: Any, model: str, *, n_min: int = 3, n_max: int = 8,
                 max_match: int = 24, own_text: bool = False,
                 outputs: OutputIndex | None = None, max_occurrences: int = 32,
                 max_branches: int = 3, max_scope_tokens: int = 400_000) -> None:
        if not 1 <= n_min <= n_max <= max_match:
            raise ValueError(f"need 1 <= n_min <= n_max <= max_match, got n_min={n_min}, "
                             f"n_max={n_max}, max_match={max_match}")
        self.memory = None if memory is None else as_memory(memory)
        self.model = model
        self.n_min, self.n_max, self.max_match = n_min, n_max, max_match
        self.lengths = gram_lengths(n_min, n_max)
        self.own_text, self.outputs = own_text, outputs
        self.max_occurrences, self.max_branches = max_occurrences, max_branches
        self.max_scope_tokens = max_scope_tokens
        self._scopes: dict[str, _Text] = {}  # shared by all requests of a scope

    def begin(self, context: DraftContext) -> None:
        req = self._request(context)
        req.texts = [self._scope(context.scope)] if self.memory is not None else []
        if self.own_text:
            req.own = _Text(tokens=context.tokens)  # the context's own list: it grows with it
            self._index(req.own, len(req.own.tokens))
            req.texts.append(req.own)
        if self.outputs is not None:
            # The prompt's last tokens (a chat template's opening of the reply) lead the
            # segment, so a reply's first tokens match other replies' openings; the rest is
            # filled by ``observe``.
            req.segment = self.outputs.open()
            prompt = context.tokens[: context.prompt_len]
            self.outputs.extend(req.segment, prompt[-self.n_max :])
        req.begun = True

    def _scope(self, scope: str) -> _Text:
        assert self.memory is not None
        state = self._scopes.setdefault(scope, _Text())
        # ends early (never raises) while the memory's store fails
        for rec in self.memory.completions(scope=scope, model=self.model,
                                           after_id=state.watermark):
            state.tokens.extend(rec.completion_ids)
            state.tokens.append(_SEP)
            state.watermark = max(state.watermark, rec.id or 0)
        if len(state.tokens) > self.max_scope_tokens:  # keep the most recent completions
            kept = state.tokens[-self.max_scope_tokens // 2 :]
            fresh = _Text(tokens=kept[kept.index(_SEP) + 1 :] if _SEP in kept else [],
                          watermark=state.watermark)
            state = self._scopes[scope] = fresh
        self._index(state, len(state.tokens))
        return state

    def _index(self, text: _Text, end: int) -> None:
        """Index every n-gram that ends before ``end`` (none across a separator)."""
        for stop, gram in _grams(text.tokens, max(text.indexed, self.n_min), end, self.lengths):
            if _SEP not in gram:
                _add(text.table[gram], stop, self.max_occurrences)
        text.indexed = max(text.indexed, end)

    def _request(self, context: DraftContext) -> _Request:
        return context.state(self, _Request)

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        req = self._request(context)
        tail = context.tokens
        if not req.begun or max_tokens <= 0 or len(tail) < self.n_min:
            return EMPTY_DRAFT
        if req.own is not None:  # the request's own n-grams up to (not including) its tail
            self._index(req.own, len(tail))
        # the request's own segment is matched in its own text (or, without one, here)
        exclude = req.segment if req.own is not None else 0
        for n in reversed(self.lengths):
            if n > len(tail):
                continue
            gram = tuple(tail[-n:])
            found = [(text.tokens, stop) for text in req.texts for stop in text.table.get(gram, ())
                     if stop < len(text.tokens)]
            if self.outputs is not None:
                found += self.outputs.find(gram, exclude)
            if found:
                return self._draft(tail, found, n, max_tokens)
        return EMPTY_DRAFT

    def _draft(self, tail: Sequence[int], found: list[tuple[list[int], int]], n: int,
               max_tokens: int) -> Draft:
        # Extend each occurrence's match backwards; keep the occurrences with the longest.
        scored = [(_context_length(tokens, stop, tail, n, self.max_match), tokens, stop)
                  for tokens, stop in found]
        longest = max(m for m, _, _ in scored)
        conts: list[list[int]] = []
        for m, tokens, stop in reversed(scored):  # most recent first breaks frequency ties
            if m == longest:
                end = min(len(tokens), stop + max_tokens)
                cont = tokens[stop:end]
                if _SEP in cont:
                    cont = cont[: cont.index(_SEP)]
                if cont:
                    conts.append(cont)
        if not conts:
            return EMPTY_DRAFT
        chains = [(_frequency_walk(conts), self.name)]
        seen = {tuple(chains[0][0][:4])}
        freq = Counter(tuple(c[:4]) for c in conts)
        for c in sorted(conts, key=lambda c: freq[tuple(c[:4])], reverse=True):
            if len(chains) == self.max_branches:
                break
            if tuple(c[:4]) not in seen:
                seen.add(tuple(c[:4]))
                chains.append((c, self.name))
        ids, parents, _ = merge_chains(chains, max_nodes=max_tokens * len(chains))
        # Per node, how many of the occurrences continue this way (SuffixDecoding scores its
        # tree's nodes by these frequencies; the drafter chain learns a rate per level).
        return Draft(tuple(ids), tuple(parents), self.name,
                     support=node_support(ids, parents, conts),
                     acceptance=f"{self.name}/{match_class(longest)}")

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        req = self._request(context)
        if self.outputs is not None and req.segment:
            self.outputs.extend(req.segment, verdict.new_tokens)

    def end(self, context: DraftContext) -> None:
        req = self._request(context)
        req.texts, req.own, req.begun = [], None, False  # its segment stays for the others


def _grams(tokens: Sequence[int], start: int, end: int,
           lengths: tuple[int, ...]) -> Iterator[tuple[int, tuple[int, ...]]]:
    """``(stop, gram)`` for every n-gram of the ``lengths`` that ends right before a ``stop``
    in ``[start, end)``: the n-grams whose continuation starts there."""
    for stop in range(start, end):
        for n in lengths:
            if n > stop:
                break
            yield stop, tuple(tokens[stop - n : stop])


def _add(occurrences: list[int], entry: int, cap: int) -> None:
    """Append ``entry``, keeping the most recent ``cap``."""
    occurrences.append(entry)
    if len(occurrences) > cap:
        del occurrences[0]


def _context_length(tokens: list[int], stop: int, tail: Sequence[int], n: int,
                    limit: int) -> int:
    """How many tokens before ``stop`` agree with the end of ``tail`` (at least ``n``, which
    the n-gram table matched; at most ``limit``)."""
    m = n
    while m < limit and stop - m > 0 and m < len(tail) and tokens[stop - m - 1] == tail[-m - 1] \
            and tokens[stop - m - 1] != _SEP:
        m += 1
    return m


def _frequency_walk(conts: list[list[int]]) -> list[int]:
    """The path that takes, at each depth, the token most of the continuations still on the
    path take next (ties: the earlier continuation's)."""
    path: list[int] = []
    alive = conts
    depth = 0
    while alive:
        counts = Counter(c[depth] for c in alive if len(c) > depth)
        if not counts:
            break
        top = max(counts.values())
        tok = next(c[depth] for c in alive if len(c) > depth and counts[c[depth]] == top)
        path.append(tok)
        alive = [c for c in alive if len(c) > depth and c[depth] == tok]
        depth += 1
    return path

