"""One request's grammar state: the mask of every draft row, forced tokens, the committed state.

Under speculation each draft row gets the mask of its own path (:meth:`GrammarState.constrain`):
the matcher consumes the draft's spine token by token, computing the mask of every row, and
rolls back afterwards. A node its parent's mask forbids is pruned before scoring (the target
could never accept it). Where the grammar allows exactly one continuation (``{"name": "``, the
keys of a schema, an enum value once its first token is chosen), those forced tokens are
appended to the spine as free drafts (source ``"grammar"``): the masked target accepts them
with probability one, so each costs a row of the forward, never a step. Under greedy decoding
the rows' masks are computed on demand (:class:`LazyMasks`): only a row whose plain argmax the
grammar forbids needs its mask to pick the argmax among the allowed tokens. A grammar's first
use on a tokenizer walks its examples (one call of each tool; :attr:`Grammar.examples`), so the
first request of a new tool set finds the skeleton's masks cached and its lexer states built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentspec.grammar.spec import GRAMMAR_SOURCE, Grammar, GrammarError
from agentspec.grammar.tokenizer import (
    SharedGrammar,
    cache_mask,
    fill_mask,
    keep_mask,
    ll_tokenizer,
    shared_grammar,
    text_start_spec,
    trie_child,
    trim_masks,
    unpack_bits,
)
from agentspec.grammar.walk import LazyMasks, Walk
from agentspec.tree import spine_length
from agentspec.types import Draft


class GrammarState:
    """One request's grammar matcher: masks for draft rows, forced tokens, and the committed
    state (advanced by :meth:`advance` with each step's tokens). :meth:`close` hands the
    matcher back for the next request of the same grammar.

    Args:
        grammar: the constraint.
        tokenizer: the target's Hugging Face tokenizer.
        vocab_size: the target's logit width.
        eos_ids: the target's stop tokens.
        device: where masks go (the target's device).
    """

    def __init__(self, grammar: Grammar, tokenizer: Any, *, vocab_size: int,
                 eos_ids: Sequence[int], device: torch.device | str = "cpu") -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        ll_tok = ll_tokenizer(tokenizer, vocab_size, eos_ids,
                              json_slices=grammar.kind in ("json_schema", "tool_calls"))
        self._shared = shared_grammar(ll_tok, grammar.spec)
        if grammar.examples and not self._shared.warmed:
            self._shared.warm([tokenizer.encode(text, add_special_tokens=False)
                               for text in grammar.examples], (vocab_size + 31) // 32)
            trim_masks()
        self.matcher = self._shared.take()
        self.check()
        # Stop tokens are checked against masks but never consumed: llguidance cannot roll a
        # matcher back over the end of its grammar, and nothing follows a stop token anyway.
        self.eos = frozenset(int(t) for t in eos_ids)
        self._words = (vocab_size + 31) // 32
        # "grammar": the matcher decides; "undecided": an or_text grammar before its first
        # token (which may start text or the grammar's output); "text": free from here on.
        self.mode = "undecided" if grammar.or_text else "grammar"
        self._text_start = self._initial(shared_grammar(
            ll_tok, grammar.text_start or text_start_spec())) if grammar.or_text else None
        self._committed = 0  # committed tokens the matcher holds
        self._path: list[list[Any] | None] = [self._shared.root]  # trie node per committed prefix
        self._bits = torch.zeros((1, self._words), dtype=torch.int32)  # grown on demand
        self._version = 0  # bumped by every change of the committed state or the walk

    def close(self) -> None:
        """Drop the request's matcher (never reset for another request: see ``SharedGrammar``);
        the state is spent."""
        self.matcher = None

    def check(self) -> None:
        """Raise :class:`GrammarError` where the matcher has failed."""
        if self.matcher.is_error():
            raise GrammarError(f"the {self.grammar.kind} grammar failed: {self.matcher.get_error()}")

    def _initial(self, shared: SharedGrammar) -> torch.Tensor:
        """The mask of a grammar's empty output (computed once per grammar and tokenizer)."""
        if shared.root[0] is None:
            matcher = shared.take()
            if not cache_mask(shared, matcher, shared.root, self._words):
                raise GrammarError(f"the {self.grammar.kind} grammar failed: {matcher.get_error()}")
        return shared.root[0]

    # -- what a step's walk (Walk, LazyMasks) reads ---------------------------------------------

    @property
    def version(self) -> int:
        """Bumped by every change of the committed state and by every :meth:`constrain`: masks
        of a step (:class:`LazyMasks`) hold while it is the one they were made at."""
        return self._version

    @property
    def closed(self) -> bool:
        """:meth:`close` has handed the matcher back."""
        return self.matcher is None

    def walk(self, *, fill: bool = False) -> Walk:
        """A walk of the matcher from the committed state through a step's rows, rolled back
        when its ``with`` block ends (:class:`Walk`); ``fill``: each row's mask is filled into
        the state's packed rows as the walk reaches it."""
        return Walk(self, self._path[-1], fill=fill)

    def fill_row(self, row: int, node: list[Any] | None, first: bool | None = None) -> None:
        """Row ``row``'s mask: the matcher's current state, whose trie node is ``node``.
        ``first``: the state is the output's start (an or_text grammar also allows a text
        start there); by default, row 0 is.

        Every row mask :meth:`constrain` and :class:`LazyMasks` compute (or copy from the
        cache) is one call: public so that a subclass can time one row's mask (the bench's
        ``grammar_cost``)."""
        v = self._bits[row]
        cached = None if node is None else node[0]
        if cached is not None:
            v.copy_(cached)
        else:
            fill_mask(self._shared.ll_tok, self.matcher, v)
            self.check()
            if node is not None:
                keep_mask(self._shared, node, v.clone())
        if (row == 0 if first is None else first) and self.mode == "undecided" \
                and self._text_start is not None:
            v.bitwise_or_(self._text_start)  # or a text start

    def row_allows(self, row: int, token: int) -> bool:
        """Whether row ``row``'s mask, as :meth:`fill_row` left it, allows ``token``."""
        if not 0 <= token < self.vocab_size:
            return False
        return bool((int(self._bits[row, token >> 5]) >> (token & 31)) & 1)

    def row_mask(self, node: list[Any] | None, first: bool) -> torch.Tensor:
        """The mask of the matcher's current state (trie node ``node``; ``first``: the
        output's start), computed now: bool ``[vocab_size]`` on the device. Raises where it
        allows nothing."""
        self._grow(1)
        self.fill_row(0, node, first)
        self._nonempty(self._bits[:1])
        return unpack_bits(self._bits[:1].to(self.device), self.vocab_size)[0]

    def allows(self, token: int, node: list[Any] | None, first: bool) -> bool:
        """Whether the matcher's current state (trie node ``node``; ``first``: the output's
        start) allows ``token``, without computing its mask: a cached mask's bit, else
        llguidance's check of that one token (what its mask would say, without computing it)."""
        if not 0 <= token < self.vocab_size:
            return False
        if first and self._starts_text(token):
            return True
        bits = None if node is None else node[0]
        if bits is None:
            if token in self.eos:  # llguidance's masks allow a stop token where it may end
                return bool(self.matcher.is_accepting())
            if self.matcher.validate_tokens([token]) != 1:
                return False
            if not self.matcher.compute_ff_bytes():
                return True
            # Where the grammar forces bytes, llguidance's mask allows only the canonical
            # tokens of them (after ``"name`` only ``":``, not ``"``), which a token check
            # does not know: the mask decides.
            self._grow(1)
            self.fill_row(0, node, first)
            bits = self._bits[0]
        return bool((int(bits[token >> 5]) >> (token & 31)) & 1)

    def _starts_text(self, token: int) -> bool:
        """An or_text grammar's first token that begins free text (never the grammar's: text
        may not start like JSON, and JSON starts with ``{`` or ``[``)."""
        bits = self._text_start
        return self.mode == "undecided" and bits is not None and 0 <= token < self.vocab_size \
            and bool((int(bits[token >> 5]) >> (token & 31)) & 1)

    # -- a step's rows ------------------------------------------------------------------------

    def allowed_now(self) -> torch.Tensor | None:
        """Mask of the committed state: bool ``[1, vocab_size]`` on the device, or None where
        nothing is constrained any more (free text)."""
        allowed = self.constrain(Draft(), room=0, max_nodes=0, force=False)[1]
        return allowed.full() if isinstance(allowed, LazyMasks) else allowed

    def constrain(self, draft: Draft, *, room: int, max_nodes: int, force: bool = True,
                  lazy: bool = False) -> tuple[Draft, torch.Tensor | LazyMasks | None]:
        """The draft cut to what the grammar allows, extended by forced tokens, with the mask
        of every row to score.

        Only the spine (:func:`~agentspec.tree.spine_length`) decides more than one token per
        step, so the matcher walks the spine: it stops at the first token its parent's mask
        forbids. An alternative hanging off the spine is kept when its parent's mask allows it;
        deeper off-spine nodes could never be accepted and are dropped. Then, with ``force``,
        the tokens the grammar forces after the spine's end are appended to the spine.

        In steps: :meth:`_walk_spine` (what the grammar admits of the spine, and which
        alternatives), :meth:`_forced` (what it forces after), :meth:`_kept_alternatives`,
        :meth:`_continue_spine` (an alternative that now ends the spine gets a mask too),
        :meth:`_kept_draft`, then the masks: filled row by row as the walk goes
        (:meth:`_eager_masks`) or left to :class:`LazyMasks`.

        Args:
            draft: a sanitised draft.
            room: at most this many tokens along the spine (the generation's room).
            max_nodes: at most this many nodes in all.
            force: append forced tokens (off for plain decoding).
            lazy: return :class:`LazyMasks` instead of computing every row's mask: the draft's
                tokens are checked one by one (a cached mask's bit or llguidance's check of
                that token) and a row's mask is computed only when greedy verification finds
                the row's argmax forbidden. For greedy decoding; same outputs.

        Returns:
            ``(draft, allowed)``: ``allowed`` is bool ``[num_nodes + 1, vocab_size]`` on the
            device, row 0 the mask after the committed tokens, row ``i + 1`` after node ``i``
            (rows off the spine, whose samples never decide a token, allow everything), or
            with ``lazy`` the same masks as :class:`LazyMasks`; None once an or_text grammar's
            output has started as free text.
        """
        if self.mode == "text":
            return draft, None
        self._version += 1
        first_alt = spine_length(draft.parents)
        spine = min(first_alt, room, max_nodes)
        if not lazy:
            self._grow(max(spine, room if force else 0, max_nodes) + 1)
        with self.walk(fill=not lazy) as walk:
            kept = self._walk_spine(draft, spine, first_alt, walk)
            forced = (self._forced(walk, min(room, max_nodes) - kept.consumed)
                      if force and not kept.ended and not kept.free else [])
            alternatives = self._kept_alternatives(draft, first_alt, kept, forced, max_nodes)
            self._continue_spine(draft, kept, forced, alternatives, walk)
        out = self._kept_draft(draft, kept.consumed, forced, alternatives)
        if lazy:
            return out, LazyMasks(self, walk.tokens, out.num_nodes + 1)
        return out, self._eager_masks(out.num_nodes + 1, 1 + len(walk.tokens))

    def _walk_spine(self, draft: Draft, spine: int, first_alt: int, walk: Walk) -> _Spine:
        """The first ``spine`` nodes of the draft's spine that the grammar admits, walked: the
        matcher consumes them up to the first token its row forbids (or that it refuses), and
        at each row it passes notes the alternatives hanging there that the row allows (each
        is checked at its parent's state, while the matcher is in it).

        A stop token is kept as the spine's last node but not consumed (its row decides
        nothing; llguidance cannot roll a matcher back over the end of its grammar). An
        or_text grammar's first token that starts free text ends the walk:
        :meth:`_free_spine`."""
        hanging: dict[int, list[int]] = {}  # alternatives (off-spine nodes) by their parent's row
        for i in range(first_alt, draft.num_nodes):
            hanging.setdefault(draft.parents[i] + 1, []).append(i)
        allowed = self._allowed_here(draft, hanging.get(0, ()), walk)
        for node in range(spine):
            token = draft.token_ids[node]
            if not walk.allows(token):
                break
            if token in self.eos:
                return _Spine(node + 1, allowed, ended=True)
            if node == 0 and self._starts_text(token):
                return self._free_spine(draft, spine, allowed)
            if not walk.consume(token):
                break
            allowed |= self._allowed_here(draft, hanging.get(walk.row, ()), walk)
        return _Spine(walk.row, allowed)

    @staticmethod
    def _allowed_here(draft: Draft, nodes: Sequence[int], walk: Walk) -> set[int]:
        """Those of ``nodes`` (alternatives whose parent's row the walk is at) that the row
        allows."""
        return {i for i in nodes if walk.allows(draft.token_ids[i])}

    def _free_spine(self, draft: Draft, spine: int, allowed: set[int]) -> _Spine:
        """The spine after a first token that starts free text: nothing after a text start is
        masked, so its first ``spine`` nodes are kept unchecked, up to and including a stop
        token; the matcher consumes none of them."""
        for node in range(1, spine):
            if draft.token_ids[node] in self.eos:
                return _Spine(node + 1, allowed, ended=True, free=True)
        return _Spine(spine, allowed, free=True)

    def _forced(self, walk: Walk, limit: int) -> list[int]:
        """The tokens the grammar forces after the walk's end (at most ``limit``), consumed as
        the walk's next rows: the masked target accepts each with probability one, so each
        costs a row of the forward, never a step.

        llguidance tokenizes forced text without its grammar: text spelling a special token
        (a format's wrapper named as text) can come back as that token, which the grammar
        refuses, and a refused consume would leave the matcher failed; so each token is
        checked before it is consumed, and the first that fails ends them."""
        if self.matcher.is_stopped():
            return []
        forced: list[int] = []
        for token in self.matcher.compute_ff_tokens()[:max(limit, 0)]:
            if not walk.allows(token) or self.matcher.validate_tokens([token]) != 1 \
                    or not walk.consume(token):
                break
            forced.append(token)
        return forced

    @staticmethod
    def _kept_alternatives(draft: Draft, first_alt: int, kept: _Spine, forced: list[int],
                           max_nodes: int) -> list[int]:
        """The alternatives kept: children of the root or of a kept spine node (not a stop
        token) that their parent's mask allows (after a free-text start every mask but row
        0's allows everything), less one that repeats the first forced token (it is on the
        spine now), within what ``max_nodes`` leaves after the spine."""
        parents, ends = draft.parents, kept.consumed - kept.ended
        out = [i for i in range(first_alt, draft.num_nodes)
               if parents[i] < ends and ((kept.free and parents[i] >= 0) or i in kept.allowed)]
        out = [i for i in out if not (parents[i] == kept.consumed - 1 and forced
                                      and draft.token_ids[i] == forced[0])]
        return out[:max(max_nodes - kept.consumed - len(forced), 0)]

    def _continue_spine(self, draft: Draft, kept: _Spine, forced: list[int],
                        alternatives: list[int], walk: Walk) -> None:
        """Walk the first alternative where it now continues the spine: with nothing forced
        and the spine cut short, an alternative on its last kept node follows the spine's
        end, so its row decides the step's next token and gets its own mask too. Not a stop
        token, nor a first token that starts free text (neither is consumed)."""
        if forced or kept.ended or kept.free or not alternatives:
            return
        first = alternatives[0]
        token = draft.token_ids[first]
        if draft.parents[first] != kept.consumed - 1 or token in self.eos \
                or (kept.consumed == 0 and self._starts_text(token)):
            return
        walk.consume(token, last=True)

    @staticmethod
    def _kept_draft(draft: Draft, consumed: int, forced: list[int],
                    alternatives: list[int]) -> Draft:
        """The step's draft: the spine's first ``consumed`` nodes, the forced tokens after them
        (source ``"grammar"``; a model's chain gets point masses for them), then the kept
        alternatives; ``draft`` itself where nothing was cut or added."""
        if consumed == draft.num_nodes and not forced:
            return draft
        spine_ids = [*draft.token_ids[:consumed], *forced]
        ids = spine_ids + [draft.token_ids[i] for i in alternatives]
        if not ids:
            return Draft()
        parents = list(range(-1, len(spine_ids) - 1)) + [draft.parents[i] for i in alternatives]
        sources = [draft.source_of(i) for i in range(consumed)] + [GRAMMAR_SOURCE] * len(forced) \
            + [draft.source_of(i) for i in alternatives]
        q = None
        if draft.draft_probs is not None:  # a model's chain: forced rows are point masses
            q = torch.cat([draft.draft_probs[:consumed], torch.nn.functional.one_hot(
                torch.tensor(forced, dtype=torch.long), draft.draft_probs.shape[-1]
            ).to(draft.draft_probs)])
        return Draft(tuple(ids), tuple(parents), tuple(sources), q)

    def _eager_masks(self, num_rows: int, rows: int) -> torch.Tensor:
        """bool ``[num_rows, vocab_size]`` on the device: the first ``rows`` rows' masks as the
        walk filled them, every later row allowing everything (after a stop token, free text
        or off the spine, a row decides nothing)."""
        allowed = torch.ones((num_rows, self.vocab_size), dtype=torch.bool, device=self.device)
        allowed[:rows] = unpack_bits(self._bits[:rows].to(self.device), self.vocab_size)
        self._nonempty(self._bits[:rows])
        return allowed

    def _nonempty(self, bits: torch.Tensor) -> None:
        """Raise where a row's packed mask allows nothing (checked on the words: 32x less)."""
        if not bits.numpy().any(axis=-1).all():
            raise GrammarError(f"the {self.grammar.kind} grammar allows no token here "
                               "(its tokenizer does not match the model's vocabulary?)")

    def _grow(self, rows: int) -> None:
        if self._bits.shape[0] < rows:
            self._bits = torch.zeros((rows, self._words), dtype=torch.int32)

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit a step's tokens (each one allowed: they were drawn from masked rows)."""
        self._version += 1
        for token in tokens:
            token = int(token)
            if self.mode == "text":
                return
            if self.mode == "undecided":
                if self._starts_text(token):
                    self.mode = "text"
                    return
                self.mode = "grammar"
            if self.matcher.is_stopped() or token in self.eos:
                return  # the stop token that ends the output
            if not self.matcher.consume_token(token):
                self.check()
            self._committed += 1
            self._path.append(trie_child(self._path[-1], token))

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` committed tokens (ones the matcher holds: not a stop token,
        not free text)."""
        if not 0 <= count <= self._committed:
            raise ValueError(f"can roll back 0..{self._committed} committed tokens, got {count}")
        self._version += 1
        if count:
            self.matcher.rollback(count)
            self.check()
            self._committed -= count
            del self._path[len(self._path) - count:]
            if self._committed == 0 and self.grammar.or_text:
                self.mode = "undecided"

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more but a stop token."""
        return self.mode != "text" and self.matcher.is_stopped()


@dataclass(frozen=True)
class _Spine:
    """What :meth:`GrammarState._walk_spine` kept of a draft's spine: its first ``consumed``
    nodes, the alternatives (off-spine nodes) ``allowed`` at their parent's row, whether the
    last kept node is a stop token (``ended``, not consumed) and whether the first starts free
    text (``free``: the matcher consumed none of them)."""

    consumed: int
    allowed: set[int]
    ended: bool = False
    free: bool = False
