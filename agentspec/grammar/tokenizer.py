"""The tokenizer bridge and the grammars shared across requests.

llguidance's view of a tokenizer is built once per tokenizer; each distinct grammar on it is
compiled once (:class:`SharedGrammar`) and its masks are cached by token path in a trie, so
the calls of one tool set read the masks of their common skeleton instead of computing them.
All grammars' cached masks share one budget (:data:`MASK_CACHE_BYTES`).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from agentspec.grammar.spec import import_llguidance

_TOKENIZERS: dict[tuple[int, int, tuple[int, ...], bool], tuple[Any, Any]] = {}
_LOCK = threading.Lock()
# The first character of free text under ``or_text``: anything but what JSON starts with.
TEXT_START = "start: TEXT\nTEXT: /[^{\\[\\s][\\s\\S]*/\n"


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], *,
                 json_slices: bool = False) -> Any:
    """llguidance's view of a Hugging Face tokenizer (slow to build: built once, cached per
    tokenizer).

    ``vocab_size`` is the model's logit width; ``eos_ids`` are the tokens that end a
    generation, allowed exactly where the grammar is complete. ``json_slices``: llguidance's
    vocabulary slices tuned for JSON strings (a faster mask on tool calls; the slices are an
    optimisation and never change a mask)."""
    eos = tuple(sorted(eos_ids))
    key = (id(tokenizer), vocab_size, eos, json_slices)
    with _LOCK:
        hit = _TOKENIZERS.get(key)
    if hit is None or hit[0] is not tokenizer:
        llg = import_llguidance()
        made = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) or None)
        if json_slices:
            made = made.with_slices(llg.LLTokenizer.json_slices())
        with _LOCK:
            hit = _TOKENIZERS[key] = (tokenizer, made)
    return hit[1]


class SharedGrammar:
    """One grammar on one tokenizer, shared by the requests that use it: a pristine matcher
    that each request's is copied from (a copy costs a small part of a build) and the masks
    computed so far, by token path (the root's is the empty output's, which every request
    starts with).

    A used matcher is never reset for another request: in llguidance 1.9.1 a matcher that
    computed masks and rolled back, once ``reset()``, can compute wrong masks on a later path
    (inside a string value it allowed ``"}`` and refused ``",`` where the object had required
    keys left; tests/unit/test_grammar_reuse.py replays the operations that showed it). A
    wrong mask would be cached by token path and handed to every later request: it could
    fail a request or change its output, so the output would depend on earlier calls."""

    def __init__(self, ll_tok: Any, spec: str) -> None:
        self.ll_tok, self.spec = ll_tok, spec
        self._pristine: Any = None  # built on first use; never consumes a token
        # The masks of the outputs seen so far, by token path: [mask or None, children]. A
        # mask is a function of the grammar and the tokens consumed, and calls of one tool set
        # share their skeleton (``[{"name": "``, a tool's name, its keys), which costs the
        # most to mask (the choice points); so every call after the first reads them here.
        self.root: list[Any] = [None, {}]
        self.warmed = False  # the grammar's examples were walked (see ``warm``)
        self.cached_bytes = 0  # of the masks in its trie

    def forget(self) -> None:
        """Drop the cached masks (the cache's budget is spent); the next request warms again."""
        global _cached_bytes
        _cached_bytes -= self.cached_bytes
        self.cached_bytes = 0
        self.root = [None, {}]
        self.warmed = False

    def warm(self, token_lists: Sequence[Sequence[int]], words: int) -> None:
        """Walk texts valid under the grammar once (the first request does, before its
        prefill): every mask along them is computed into the token-path cache and the lexer
        states they pass through are built (copies of one pristine matcher share its lexer's
        cache, so the requests find them built). A walk stops at the first token the grammar
        refuses; nothing else depends on it."""
        with _LOCK:
            if self.warmed:
                return
            self.warmed = True
        for ids in token_lists:
            matcher = self.take()  # one copy per text: a used matcher is never reset (class doc)
            node: list[Any] | None = self.root
            for token in [*ids, None]:
                if node is not None and node[0] is None and not cache_mask(self, matcher, node, words):
                    return
                if token is None or matcher.is_stopped() or not matcher.consume_token(token):
                    break
                node = trie_child(node, token)

    def take(self) -> Any:
        """A matcher at the grammar's start, for one request (a copy of the pristine one)."""
        with _LOCK:
            if self._pristine is None:
                self._pristine = import_llguidance().LLMatcher(self.ll_tok, self.spec, log_level=0)
            return self._pristine.deep_copy()


# The grammars in use, least recently used first.
_SHARED: OrderedDict[tuple[int, str], SharedGrammar] = OrderedDict()
MAX_GRAMMARS = 256
# All grammars' cached masks together, at most; past 3/4 of it a new request drops the least
# recently used grammars' masks (most masks of a value's text are never read again).
MASK_CACHE_BYTES = 64 << 20
_cached_bytes = 0


def keep_mask(shared: SharedGrammar, node: list[Any], bits: torch.Tensor) -> None:
    """Cache ``bits`` as trie node ``node``'s mask, counted in the budget."""
    global _cached_bytes
    node[0] = bits
    _cached_bytes += bits.numel() * 4
    shared.cached_bytes += bits.numel() * 4


def cache_mask(shared: SharedGrammar, matcher: Any, node: list[Any], words: int) -> bool:
    """The matcher's current mask into trie node ``node`` of ``shared``; False when the
    matcher failed."""
    bits = torch.zeros(words, dtype=torch.int32)
    fill_mask(shared.ll_tok, matcher, bits)
    if matcher.is_error():
        return False
    keep_mask(shared, node, bits)
    return True


def fill_mask(ll_tok: Any, matcher: Any, bits: torch.Tensor) -> None:
    """The matcher's mask into ``bits`` (one row of int32 words, contiguous, on the CPU):
    llguidance's, less the special tokens the matcher would refuse to consume
    (:func:`settle_specials`). Every mask the engine computes is computed here; the caller
    checks ``matcher.is_error()``."""
    matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
    if not matcher.is_error():
        settle_specials(ll_tok, matcher, bits)


# Per llguidance tokenizer (by id: it lives in _TOKENIZERS, so its id is not reused): its
# special tokens but its stop tokens, with each one's word and bit in a mask row.
_SPECIALS: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _special_ids(ll_tok: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hit = _SPECIALS.get(id(ll_tok))
    if hit is None:
        eos = set(ll_tok.eos_tokens)
        ids = torch.tensor([t for t in range(ll_tok.vocab_size)
                            if ll_tok.is_special_token(t) and t not in eos], dtype=torch.long)
        hit = _SPECIALS[id(ll_tok)] = (ids, ids >> 5, (ids & 31).to(torch.int32))
    return hit


def settle_specials(ll_tok: Any, matcher: Any, bits: torch.Tensor) -> None:
    """Clear the bits of ``bits`` for special tokens the matcher refuses to consume.

    llguidance 1.9.1 masks a special token by its text where the grammar spells that text (a
    format's ``[TOOL_CALLS]`` written as text, on a tokenizer holding it as a special token)
    but consumes it only where the grammar names the token: a mask that allowed it would let
    the target commit a token that then fails the request. Checked one token at a time, only
    for the special tokens a mask allows, which is none in the usual case.

    Where the grammar forces that text, llguidance's mask holds the special token alone; once
    it is cleared, the row allows the first token of the forced text spelled in ordinary
    tokens (llguidance's greedy tokenization, which never yields a special token)."""
    ids, words, shifts = _special_ids(ll_tok)
    if not len(ids):
        return
    if int(ids[-1]) >= bits.shape[-1] * 32:  # a row narrower than the vocabulary
        inside = ids < bits.shape[-1] * 32
        ids, words, shifts = ids[inside], words[inside], shifts[inside]
    on = ((bits[words] >> shifts) & 1).bool()
    cleared = False
    for token in ids[on].tolist():
        if matcher.validate_tokens([token]) != 1:
            _set_bit(bits, token, False)
            cleared = True
    if cleared and not bool(bits.any()):
        forced = matcher.compute_ff_bytes().decode("utf-8", errors="ignore")
        spelled = ll_tok.greedy_tokenize(forced) if forced else []
        if spelled and matcher.validate_tokens(spelled[:1]) == 1:
            _set_bit(bits, spelled[0], True)


def _set_bit(bits: torch.Tensor, token: int, on: bool) -> None:
    bit = torch.tensor(1, dtype=torch.int32) << (token & 31)
    if on:
        bits[token >> 5] |= bit
    else:
        bits[token >> 5] &= ~bit


def trie_child(node: list[Any] | None, token: int) -> list[Any] | None:
    """The trie node after ``token`` (made on first use), or None past the cache's budget."""
    if node is None:
        return None
    hit = node[1].get(token)
    if hit is None and _cached_bytes < MASK_CACHE_BYTES:
        hit = node[1].setdefault(token, [None, {}])
    return hit


def shared_grammar(ll_tok: Any, spec: str) -> SharedGrammar:
    key = (id(ll_tok), spec)  # ll_tok lives in _TOKENIZERS, so its id is not reused
    with _LOCK:
        hit = _SHARED.get(key)
        if hit is None:
            while len(_SHARED) >= MAX_GRAMMARS:  # a process that builds grammars without end
                _SHARED.popitem(last=False)[1].forget()
            hit = _SHARED[key] = SharedGrammar(ll_tok, spec)
        _SHARED.move_to_end(key)
    trim_masks()
    return hit


def forget_masks() -> None:
    """Drop every grammar's cached masks (each grammar's next request computes them again)."""
    with _LOCK:
        for shared in _SHARED.values():
            shared.forget()


def trim_masks() -> None:
    """Past 3/4 of the budget, drop the least recently used grammars' masks (the one in use
    last)."""
    with _LOCK:
        for shared in list(_SHARED.values()):
            if _cached_bytes <= MASK_CACHE_BYTES * 3 // 4:
                break
            shared.forget()


def unpack_bits(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask ``[rows, ceil(vocab / 32)]`` int32 -> bool ``[rows, vocab_size]``
    (True = allowed), on the bitmask's device. Bit ``t & 31`` of word ``t >> 5`` is token t."""
    if bits.device.type == "cpu" and sys.byteorder == "little":
        # numpy unpacks bytes in one pass (far faster than the shift-and-mask below);
        # int32 words are little-endian here, so byte b of word w holds tokens 32w+8b..+7.
        flat = np.unpackbits(bits.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(flat[:, :vocab_size]).view(torch.bool)
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = (bits.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return allowed.view(bits.shape[0], -1)[:, :vocab_size].bool()


@functools.lru_cache(maxsize=1)
def text_start_spec() -> str:
    return import_llguidance().LLMatcher.grammar_from_lark(TEXT_START)
