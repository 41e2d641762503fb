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
        self._check()
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

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"the {self.grammar.kind} grammar failed: {self.matcher.get_error()}")

    def _initial(self, shared: SharedGrammar) -> torch.Tensor:
        """The mask of a grammar's empty output (computed once per grammar and tokenizer)."""
        if shared.root[0] is None:
            matcher = shared.take()
            if not cache_mask(shared, matcher, shared.root, self._words):
                raise GrammarError(f"the {self.grammar.kind} grammar failed: {matcher.get_error()}")
        return shared.root[0]

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
            self._check()
            if node is not None:
                keep_mask(self._shared, node, v.clone())
        if (row == 0 if first is None else first) and self.mode == "undecided" \
                and self._text_start is not None:
            v.bitwise_or_(self._text_start)  # or a text start

    def _valid(self, token: int, node: list[Any] | None, first: bool) -> bool:
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

    def _allows(self, row: int, token: int) -> bool:
        if not 0 <= token < self.vocab_size:
            return False
        return bool((int(self._bits[row, token >> 5]) >> (token & 31)) & 1)

    def _starts_text(self, token: int) -> bool:
        """An or_text grammar's first token that begins free text (never the grammar's: text
        may not start like JSON, and JSON starts with ``{`` or ``[``)."""
        bits = self._text_start
        return self.mode == "undecided" and bits is not None and 0 <= token < self.vocab_size \
            and bool((int(bits[token >> 5]) >> (token & 31)) & 1)

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
        # Alternatives (off-spine nodes) by the row of their parent: each is checked at that
        # row's state, while the matcher passes it.
        by_row: dict[int, list[int]] = {}
        for i in range(first_alt, draft.num_nodes):
            by_row.setdefault(draft.parents[i] + 1, []).append(i)
        allowed_alts: set[int] = set()
        trie = self._path[-1]  # the trie node of the matcher's state

        def allows(row: int, token: int) -> bool:  # at row ``row``'s state, the matcher's now
            return self._valid(token, trie, row == 0) if lazy else self._allows(row, token)

        def reach(row: int) -> None:  # the matcher is at row ``row``'s state
            if not lazy:
                self.fill_row(row, trie)
            for i in by_row.get(row, ()):
                if allows(row, draft.token_ids[i]):
                    allowed_alts.add(i)

        reach(0)
        consumed = 0  # spine nodes kept; the matcher holds all of them but a final stop token
        ended = False
        free = False  # the spine's first token starts free text: nothing after it is masked
        for node in range(spine):
            token = draft.token_ids[node]
            if not (free or allows(node, token)):
                break
            if token in self.eos:  # kept as the spine's last node; its row decides nothing
                consumed, ended = consumed + 1, True
                break
            if free or (node == 0 and self._starts_text(token)):
                consumed, free = consumed + 1, True
                continue
            if not self.matcher.consume_token(token):
                break
            consumed += 1
            trie = trie_child(trie, token)
            reach(consumed)
        forced: list[int] = []
        if force and not ended and not free and not self.matcher.is_stopped():
            limit = min(room, max_nodes) - consumed
            for token in self.matcher.compute_ff_tokens()[:max(limit, 0)]:
                # llguidance tokenizes forced text without its grammar: text spelling a special
                # token (a format's wrapper named as text) can come back as that token, which
                # the grammar refuses and a refused consume would leave the matcher failed.
                if not allows(consumed + len(forced), token) \
                        or self.matcher.validate_tokens([token]) != 1 \
                        or not self.matcher.consume_token(token):
                    break
                forced.append(token)
                trie = trie_child(trie, token)
                if not lazy:
                    self.fill_row(consumed + len(forced), trie)
        spine_ids = [*draft.token_ids[:consumed], *forced]
        sources = [draft.source_of(i) for i in range(consumed)] + [GRAMMAR_SOURCE] * len(forced)
        # Alternatives: children of the root or of a kept spine node that the parent's mask
        # allows (after a free-text start every mask allows everything).
        alternatives = [i for i in range(first_alt, draft.num_nodes)
                        if draft.parents[i] < consumed - ended
                        and ((free and draft.parents[i] >= 0) or i in allowed_alts)]
        alternatives = [i for i in alternatives if not (draft.parents[i] == consumed - 1
                                                        and forced and draft.token_ids[i] == forced[0])]
        alternatives = alternatives[:max(max_nodes - len(spine_ids), 0)]
        walked = 0 if free else consumed - ended + len(forced)  # tokens the matcher consumed
        rows = 1 + walked  # rows with their own mask (after a stop token or free text: all allowed)
        walk = [] if free else [*draft.token_ids[:consumed - ended], *forced]  # those tokens
        if not forced and not ended and not free and alternatives \
                and draft.parents[alternatives[0]] == consumed - 1 \
                and draft.token_ids[alternatives[0]] not in self.eos \
                and not (consumed == 0 and self._starts_text(draft.token_ids[alternatives[0]])):
            # The first alternative now continues the spine (its node follows the spine's
            # end): its row decides the step's next token, so it gets its own mask too.
            token = draft.token_ids[alternatives[0]]
            if self.matcher.consume_token(token):
                walked += 1
                rows += 1
                walk.append(token)
                if not lazy:
                    self.fill_row(walked, trie_child(trie, token))
        self.matcher.rollback(walked)
        self._check()
        if consumed == draft.num_nodes and not forced:
            out = draft
        else:
            ids = spine_ids + [draft.token_ids[i] for i in alternatives]
            parents = list(range(-1, len(spine_ids) - 1)) + [draft.parents[i] for i in alternatives]
            sources += [draft.source_of(i) for i in alternatives]
            q = None
            if draft.draft_probs is not None and ids:  # a model's chain: forced rows are point masses
                q = torch.cat([draft.draft_probs[:consumed], torch.nn.functional.one_hot(
                    torch.tensor(forced, dtype=torch.long), draft.draft_probs.shape[-1]
                ).to(draft.draft_probs)])
            out = Draft(tuple(ids), tuple(parents), tuple(sources), q) if ids else Draft()
        allowed: torch.Tensor | LazyMasks
        if lazy:
            allowed = LazyMasks(self, walk, out.num_nodes + 1)
        else:
            allowed = torch.ones((out.num_nodes + 1, self.vocab_size), dtype=torch.bool,
                                 device=self.device)
            allowed[:rows] = unpack_bits(self._bits[:rows].to(self.device), self.vocab_size)
            self._nonempty(self._bits[:rows])
        return out, allowed

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
                self._check()
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
            self._check()
            self._committed -= count
            del self._path[len(self._path) - count:]
            if self._committed == 0 and self.grammar.or_text:
                self.mode = "undecided"

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more but a stop token."""
        return self.mode != "text" and self.matcher.is_stopped()


class LazyMasks:
    """The grammar's masks of one step's rows, computed only where greedy verification needs
    one (:func:`agentspec.decoding.sampling.greedy_tokens`).

    A row's masked argmax is its unmasked argmax wherever the grammar allows that token (the
    first maximum overall is the first maximum among any set that contains it), so a row
    needs its mask only when its argmax is a token the grammar forbids. The draft's own tokens
    were checked by :meth:`GrammarState.constrain`, so a row whose argmax is the next walked
    token needs nothing; any other row's argmax is checked at the row's state (a cached
    mask's bit or llguidance's check of that token), and its mask computed only if that
    fails. Valid until the grammar state moves on (the step's ``advance``).

    Args:
        state: the request's grammar state, at the step's committed tokens.
        walk: the tokens the matcher walked for the step's rows: row ``r + 1`` is the state
            after ``walk[:r + 1]``; rows past ``len(walk)`` allow everything.
        num_rows: rows scored (``num_nodes + 1``).
    """

    def __init__(self, state: GrammarState, walk: Sequence[int], num_rows: int) -> None:
        self.state, self.walk, self.num_rows = state, list(walk), num_rows
        self.rows = 1 + len(self.walk)  # rows with a mask of their own
        self.version = state._version

    def forbidding(self, tokens: Sequence[int]) -> dict[int, torch.Tensor]:
        """``{row: bool [vocab_size] mask on the device}`` for each row whose token in
        ``tokens`` (one per row, at least :attr:`rows`) the grammar forbids there."""
        st = self.state
        if st._version != self.version or st.matcher is None:
            raise GrammarError("these masks belong to a step the grammar state has moved past")
        check = [r for r in range(min(self.rows, len(tokens)))
                 if not (r < len(self.walk) and tokens[r] == self.walk[r])]
        out: dict[int, torch.Tensor] = {}
        node = st._path[-1]
        at = 0  # walk tokens the matcher consumed
        try:
            for r in check:
                while at < r:
                    if not st.matcher.consume_token(self.walk[at]):
                        st._check()
                    node = trie_child(node, self.walk[at])
                    at += 1
                if not st._valid(int(tokens[r]), node, r == 0):
                    out[r] = self._mask(node, r == 0)
        finally:
            st.matcher.rollback(at)
        st._check()
        return out

    def _mask(self, node: list[Any] | None, first: bool) -> torch.Tensor:
        st = self.state
        st._grow(1)
        st.fill_row(0, node, first)
        st._nonempty(st._bits[:1])
        return unpack_bits(st._bits[:1].to(st.device), st.vocab_size)[0]

    def full(self) -> torch.Tensor:
        """Every row's mask: bool ``[num_rows, vocab_size]`` on the device (what
        ``constrain`` returns without ``lazy``)."""
        st = self.state
        if st._version != self.version or st.matcher is None:
            raise GrammarError("these masks belong to a step the grammar state has moved past")
        out = torch.ones((self.num_rows, st.vocab_size), dtype=torch.bool, device=st.device)
        node = st._path[-1]
        at = 0
        try:
            for r in range(self.rows):
                out[r] = self._mask(node, r == 0)
                if r < len(self.walk):
                    if not st.matcher.consume_token(self.walk[r]):
                        st._check()
                    node = trie_child(node, self.walk[r])
                    at += 1
        finally:
            st.matcher.rollback(at)
        st._check()
        return out
