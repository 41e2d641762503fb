"""Grammar-constrained decoding: JSON schemas, tool calls, regexes and Lark grammars.

A :class:`Grammar` is part of the sampling parameters (``SamplingParams.grammar``). The target
distribution at each step is then the model's, masked by the grammar state after that step's
prefix: tokens the grammar forbids get probability zero (``-inf`` logits) before temperature,
top-k and top-p, in :mod:`agentspec.sampling` (the order of vLLM and SGLang).

Under speculation each draft row gets the mask of its own path (:meth:`GrammarState.constrain`):
the matcher consumes the draft's spine token by token, computing the mask of every row, and
rolls back afterwards. A node its parent's mask forbids is pruned before scoring (the target
could never accept it). Where the grammar allows exactly one continuation (``{"name": "``, the
keys of a schema, an enum value once its first token is chosen), those forced tokens are
appended to the spine as free drafts (source ``"grammar"``): the masked target accepts them
with probability one, so each costs a row of the forward, never a step. Under greedy decoding
the rows' masks are computed on demand (:class:`LazyMasks`): only a row whose plain argmax the
grammar forbids needs its mask to pick the argmax among the allowed tokens.

The matcher is llguidance (MIT, no dependencies): forced-token sequences and rollback are
primitives of its API, which is exactly what speculation needs. It is not the faster mask on
this CPU even with warm matchers and masks cached by token path (below): on held-out BFCL
calls ``python -m agentspec.bench.grammar_cost`` measured xgrammar's mask at p50 1.5 us / p99
30-33 us per draft node against llguidance's 9-10 us / 63-87 us (BENCHMARKS.md, "Engine
costs, tool-call traffic under a grammar"); with the LRU mask cache, on a faster machine of
the same kind, llguidance's p99 was 35-40 us (p50 2 us; "Mask cost on this machine").
Moving the masks to xgrammar (keeping llguidance's forced tokens) is open work. A grammar's
first use on a tokenizer walks its examples (one call of each tool; see
:attr:`Grammar.examples`), so the first request of a new tool set finds the skeleton's masks
cached and its lexer states built, as xgrammar's compile-time mask cache would have them
(without it llguidance's p99 was 187 us).
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from agentspec.tree import common_prefix_len, spine_length
from agentspec.types import Draft

# One JSON layout: the one the prompts' examples use (and the one most tokens are merged for).
# A rigid layout also means more forced tokens: no whitespace choice for the model to make.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_SOURCE = "grammar"


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # noqa: F401 - the tokenizer bridge
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("grammar-constrained decoding needs llguidance: "
                          "pip install 'agentspec[grammar]'") from exc
    return llguidance


class GrammarError(ValueError):
    """A grammar that does not compile, or a matcher that reached a state with no way on."""


@dataclass(frozen=True)
class Grammar:
    """A constraint on a generation's text.

    Build one with :meth:`json_schema`, :meth:`tool_calls`, :meth:`regex` or :meth:`lark`; pass
    it as ``SamplingParams(grammar=...)``. Immutable and hashable.

    Attributes:
        kind: ``"json_schema"``, ``"tool_calls"``, ``"regex"`` or ``"lark"``.
        spec: llguidance's grammar text (what the matcher compiles).
        tools: for ``tool_calls``, the names of the tools a call may name.
        or_text: the output is either text valid under ``spec`` or free text that does not
            start like JSON (its first character is none of ``{``, ``[`` or whitespace): the
            first token decides which, and after a text start nothing is constrained
            (``tool_calls`` with ``choice="auto"``).
        examples: texts valid under the grammar (one call of each tool, a value of the
            schema), walked once when the grammar is first used on a tokenizer, so that its
            skeleton's masks (the tool-name choice, keys, braces) are cached and its lexer
            states built before any request needs them (see :class:`GrammarState`). Never
            part of a mask's computation: they only fill caches.
    """

    kind: str
    spec: str = field(repr=False)
    tools: tuple[str, ...] = ()
    or_text: bool = False
    examples: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        llg = _llguidance()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self.spec)
        if is_error:
            raise GrammarError(f"the {self.kind} grammar does not compile: {messages[0]}")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Grammar:
        """A grammar from its JSON description (the bench workload's ``grammar`` field):
        ``{"type": "json_schema", "schema": {...}}``, ``{"type": "tool_calls", "tools": [...],
        "choice": "auto", "as_list": false}``, ``{"type": "regex", "pattern": "..."}`` or
        ``{"type": "lark", "grammar": "..."}``."""
        if not isinstance(spec, Mapping):
            raise GrammarError(f"a grammar spec must be an object, got {type(spec).__name__} {spec!r:.80}")
        kind = spec.get("type")
        fields = {"json_schema": {"schema"}, "tool_calls": {"tools", "choice", "as_list"},
                  "regex": {"pattern"}, "lark": {"grammar"}}
        if kind not in fields:
            raise GrammarError(f"grammar type must be one of {sorted(fields)}, got {kind!r}")
        unknown = set(spec) - fields[kind] - {"type"}
        if unknown:
            raise GrammarError(f"unknown {kind} grammar fields {sorted(unknown)}; known: "
                               f"{sorted(fields[kind])}")
        if kind == "json_schema":
            return cls.json_schema(spec.get("schema", {}))
        if kind == "tool_calls":
            return cls.tool_calls(spec.get("tools", []), choice=spec.get("choice", "required"),
                                  as_list=bool(spec.get("as_list", False)))
        if kind == "regex":
            return cls.regex(spec.get("pattern", ""))
        return cls.lark(spec.get("grammar", ""))

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        """Output one JSON value valid under ``schema`` (a dict or its JSON text), in the
        layout ``{"key": value, "other": 1}``."""
        obj = _schema_dict(schema, "schema")
        return cls("json_schema", _llguidance().LLMatcher.grammar_from_json_schema(
            {**obj, "x-guidance": JSON_LAYOUT}), examples=_examples([example_value(obj)]))

    @classmethod
    def tool_calls(cls, tools: Sequence[Mapping[str, Any]], *, choice: str = "required",
                   as_list: bool = False) -> Grammar:
        """A call of one of ``tools``: ``{"name": <tool>, "arguments": {...}}`` with the
        arguments valid under that tool's parameter schema (no undeclared arguments).

        Args:
            tools: OpenAI-style tools (``{"type": "function", "function": {"name",
                "parameters"}}``) or plain ``{"name", "parameters"}`` dicts.
            choice: ``"required"`` (or ``"any"``): a call, nothing else; ``"auto"``: either a
                call or plain text that does not start like JSON; or one tool's name: a call
                of that tool.
            as_list: calls as a JSON list of one or more calls
                (``[{"name": ..., "arguments": ...}]``) instead of one object.
        """
        specs = [_tool_spec(t, i) for i, t in enumerate(tools)]
        if not specs:
            raise GrammarError("tool_calls needs at least one tool, got none")
        names = [name for name, _ in specs]
        if choice not in ("required", "any", "auto"):
            if choice not in names:
                raise GrammarError(f"choice {choice!r} names no tool; tools: {names}")
            specs = [s for s in specs if s[0] == choice]
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, params in specs]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": one, "minItems": 1} if as_list else one
        schema = {**schema, "x-guidance": JSON_LAYOUT}
        llg = _llguidance()
        # "auto": a call, or text that may not start like one (see ``or_text``). Not one Lark
        # grammar ``call | TEXT``: masking free text through a lexer walks the whole vocabulary
        # every token (~0.1-0.3 ms each here), for a mask that allows everything.
        examples = [{"name": name, "arguments": example_value(params)} for name, params in specs]
        return cls("tool_calls", llg.LLMatcher.grammar_from_json_schema(schema), tuple(names),
                   or_text=choice == "auto",
                   examples=_examples([[e] for e in examples] if as_list else examples))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output text matching ``pattern`` in full (Rust regex syntax, like Python's)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"regex needs a non-empty pattern string, got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise GrammarError(f"regex {pattern!r} does not compile: {exc}") from exc
        return cls("regex", _llguidance().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """A Lark grammar in llguidance's dialect (``start`` rule; ``%json {...}`` inlines a
        JSON schema)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError(f"lark needs a grammar text, got {grammar!r}")
        return cls("lark", _llguidance().LLMatcher.grammar_from_lark(grammar))


def example_value(schema: Any, depth: int = 0) -> Any:
    """A plausible value of a JSON schema (every declared property, the first enum value or
    ``anyOf`` branch, one array item): a text to warm a grammar's caches with. Best effort: a
    value the schema refuses only warms less (the walk stops at its first refused token)."""
    if not isinstance(schema, Mapping) or depth > 8:
        return "a"
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return example_value(schema[key][0], depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and isinstance(schema.get("properties"), Mapping)):
        props = schema.get("properties")
        return {str(k): example_value(v, depth + 1)
                for k, v in (props.items() if isinstance(props, Mapping) else ())}
    if kind == "array":
        items = schema.get("items")
        return [example_value(items, depth + 1)] if isinstance(items, Mapping) else []
    return {"integer": 1, "number": 1, "boolean": True, "null": None}.get(str(kind), "example")


def _examples(values: Sequence[Any]) -> tuple[str, ...]:
    """The values as JSON text in the grammars' layout (``JSON_LAYOUT``)."""
    return tuple(json.dumps(v, ensure_ascii=False) for v in values)


def _schema_dict(schema: Any, what: str) -> dict[str, Any]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"{what} is not JSON: {exc}") from exc
    if not isinstance(schema, Mapping):
        raise GrammarError(f"{what} must be a JSON object, got {type(schema).__name__} {schema!r:.80}")
    return dict(schema)


def _tool_spec(tool: Any, index: int) -> tuple[str, dict[str, Any]]:
    """``(name, parameter schema)`` of an OpenAI-style or plain tool dict; strict objects."""
    if not isinstance(tool, Mapping):
        raise GrammarError(f"tools[{index}] must be a dict, got {type(tool).__name__} {tool!r:.80}")
    fn = tool.get("function", tool)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
        raise GrammarError(f"tools[{index}] has no name: {tool!r:.120}")
    params = _schema_dict(fn.get("parameters") or {"type": "object", "properties": {}},
                          f"tools[{index}] ({name}) parameters")
    if params.get("type", "object") == "object":
        params.setdefault("type", "object")
        params.setdefault("properties", {})
        params.setdefault("additionalProperties", False)  # a call names declared arguments only
    return name, params


def compiled(spec: Mapping[str, Any]) -> Grammar:
    """:meth:`Grammar.from_spec`, compiled once per distinct spec (a process-wide cache).

    The cache key keeps the spec's key order: a schema's ``properties`` order is the order the
    grammar writes them in (a key-sorted copy would put ``punchline`` before ``setup``)."""
    return _compiled(json.dumps(spec))


@functools.lru_cache(maxsize=256)
def _compiled(spec_json: str) -> Grammar:
    return Grammar.from_spec(json.loads(spec_json))


# -- the tokenizer bridge ----------------------------------------------------------------------

_TOKENIZERS: dict[tuple[int, int, tuple[int, ...], bool], tuple[Any, Any]] = {}
_LOCK = threading.Lock()
# The first character of free text under ``or_text``: anything but what JSON starts with.
TEXT_START = "start: TEXT\nTEXT: /[^{\\[\\s][\\s\\S]*/\n"


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], *,
                 json_slices: bool = False) -> Any:
    """llguidance's view of a Hugging Face tokenizer (built once, ~1 s; cached per tokenizer).

    ``vocab_size`` is the model's logit width; ``eos_ids`` are the tokens that end a
    generation, allowed exactly where the grammar is complete. ``json_slices``: llguidance's
    vocabulary slices tuned for JSON strings (its mask ~1.5x faster on tool calls here; the
    slices are an optimisation and never change a mask)."""
    eos = tuple(sorted(eos_ids))
    key = (id(tokenizer), vocab_size, eos, json_slices)
    with _LOCK:
        hit = _TOKENIZERS.get(key)
    if hit is None or hit[0] is not tokenizer:
        llg = _llguidance()
        made = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) or None)
        if json_slices:
            made = made.with_slices(llg.LLTokenizer.json_slices())
        with _LOCK:
            hit = _TOKENIZERS[key] = (tokenizer, made)
    return hit[1]


class _Compiled:
    """One grammar on one tokenizer, shared by the requests that use it: a pristine matcher
    that each request's is copied from (building one costs ~1 ms, a copy ~2 us) and the masks
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
                if node is not None and node[0] is None and not _cache_mask(self, matcher, node, words):
                    return
                if token is None or matcher.is_stopped() or not matcher.consume_token(token):
                    break
                node = _child(node, token)

    def take(self) -> Any:
        """A matcher at the grammar's start, for one request (a copy of the pristine one)."""
        with _LOCK:
            if self._pristine is None:
                self._pristine = _llguidance().LLMatcher(self.ll_tok, self.spec, log_level=0)
            return self._pristine.deep_copy()


# The grammars in use, least recently used first.
_SHARED: OrderedDict[tuple[int, str], _Compiled] = OrderedDict()
MAX_GRAMMARS = 256
# All grammars' cached masks together, at most; past 3/4 of it a new request drops the least
# recently used grammars' masks (most masks of a value's text are never read again).
MASK_CACHE_BYTES = 64 << 20
_cached_bytes = 0


def _keep(shared: _Compiled, node: list[Any], bits: torch.Tensor) -> None:
    """Cache ``bits`` as trie node ``node``'s mask, counted in the budget."""
    global _cached_bytes
    node[0] = bits
    _cached_bytes += bits.numel() * 4
    shared.cached_bytes += bits.numel() * 4


def _cache_mask(shared: _Compiled, matcher: Any, node: list[Any], words: int) -> bool:
    """The matcher's current mask into trie node ``node`` of ``shared``; False when the
    matcher failed."""
    bits = torch.zeros(words, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bits.data_ptr(), words * 4)
    if matcher.is_error():
        return False
    _keep(shared, node, bits)
    return True


def _child(node: list[Any] | None, token: int) -> list[Any] | None:
    """The trie node after ``token`` (made on first use), or None past the cache's budget."""
    if node is None:
        return None
    hit = node[1].get(token)
    if hit is None and _cached_bytes < MASK_CACHE_BYTES:
        hit = node[1].setdefault(token, [None, {}])
    return hit


def _shared(ll_tok: Any, spec: str) -> _Compiled:
    key = (id(ll_tok), spec)  # ll_tok lives in _TOKENIZERS, so its id is not reused
    with _LOCK:
        hit = _SHARED.get(key)
        if hit is None:
            while len(_SHARED) >= MAX_GRAMMARS:  # a process that builds grammars without end
                _SHARED.popitem(last=False)[1].forget()
            hit = _SHARED[key] = _Compiled(ll_tok, spec)
        _SHARED.move_to_end(key)
    _trim()
    return hit


def _trim() -> None:
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
        # numpy unpacks bytes in one pass (~10x the shift-and-mask below on a 49k vocabulary);
        # int32 words are little-endian here, so byte b of word w holds tokens 32w+8b..+7.
        flat = np.unpackbits(bits.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(flat[:, :vocab_size]).view(torch.bool)
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = (bits.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return allowed.view(bits.shape[0], -1)[:, :vocab_size].bool()


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
        self._shared = _shared(ll_tok, grammar.spec)
        if grammar.examples and not self._shared.warmed:
            self._shared.warm([tokenizer.encode(text, add_special_tokens=False)
                               for text in grammar.examples], (vocab_size + 31) // 32)
            _trim()
        self.matcher = self._shared.take()
        self._check()
        # Stop tokens are checked against masks but never consumed: llguidance cannot roll a
        # matcher back over the end of its grammar, and nothing follows a stop token anyway.
        self.eos = frozenset(int(t) for t in eos_ids)
        self._words = (vocab_size + 31) // 32
        # "grammar": the matcher decides; "undecided": an or_text grammar before its first
        # token (which may start text or the grammar's output); "text": free from here on.
        self.mode = "undecided" if grammar.or_text else "grammar"
        self._text_start = self._initial(_shared(ll_tok, _text_start_spec())) \
            if grammar.or_text else None
        self._committed = 0  # committed tokens the matcher holds
        self._path: list[list[Any] | None] = [self._shared.root]  # trie node per committed prefix
        self._bits = torch.zeros((1, self._words), dtype=torch.int32)  # grown on demand
        self.mask_seconds: list[float] = []  # per computed row, when timing (see the bench)
        # Per constrain call, when timing: [seconds in the grammar (constrain, then the lazy
        # masks' checks), rows scored].
        self.step_costs: list[list[float]] = []
        self.timing = False
        self._version = 0  # bumped by every change of the committed state or the walk

    def close(self) -> None:
        """Drop the request's matcher (never reset for another request: see ``_Compiled``);
        the state is spent."""
        self.matcher = None

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"the {self.grammar.kind} grammar failed: {self.matcher.get_error()}")

    def _initial(self, shared: _Compiled) -> torch.Tensor:
        """The mask of a grammar's empty output (computed once per grammar and tokenizer)."""
        if shared.root[0] is None:
            matcher = shared.take()
            if not _cache_mask(shared, matcher, shared.root, self._words):
                raise GrammarError(f"the {self.grammar.kind} grammar failed: {matcher.get_error()}")
        return shared.root[0]

    def _fill(self, row: int, node: list[Any] | None, first: bool | None = None) -> None:
        """Row ``row``'s mask: the matcher's current state, whose trie node is ``node``.
        ``first``: the state is the output's start (an or_text grammar also allows a text
        start there); by default, row 0 is."""
        v = self._bits[row]
        started = time.perf_counter() if self.timing else 0.0
        cached = None if node is None else node[0]
        if cached is not None:
            v.copy_(cached)
        else:
            self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), self._words * 4)
            self._check()
            if node is not None:
                _keep(self._shared, node, v.clone())
        if (row == 0 if first is None else first) and self.mode == "undecided" \
                and self._text_start is not None:
            v.bitwise_or_(self._text_start)  # or a text start
        if self.timing:
            self.mask_seconds.append(time.perf_counter() - started)

    def _valid(self, token: int, node: list[Any] | None, first: bool) -> bool:
        """Whether the matcher's current state (trie node ``node``; ``first``: the output's
        start) allows ``token``, without computing its mask: a cached mask's bit, else
        llguidance's check of that one token (what its mask would say, at a few us)."""
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
            self._fill(0, node, first)
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
        started = time.perf_counter() if self.timing else 0.0
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
                self._fill(row, trie)
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
            trie = _child(trie, token)
            reach(consumed)
        forced: list[int] = []
        if force and not ended and not free and not self.matcher.is_stopped():
            limit = min(room, max_nodes) - consumed
            for token in self.matcher.compute_ff_tokens()[:max(limit, 0)]:
                if not allows(consumed + len(forced), token) or not self.matcher.consume_token(token):
                    break
                forced.append(token)
                trie = _child(trie, token)
                if not lazy:
                    self._fill(consumed + len(forced), trie)
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
                    self._fill(walked, _child(trie, token))
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
        if self.timing:
            self.step_costs.append([time.perf_counter() - started, out.num_nodes + 1])
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
            self._path.append(_child(self._path[-1], token))

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
    one (:func:`agentspec.sampling.greedy_tokens`).

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
        started = time.perf_counter() if st.timing else 0.0
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
                    node = _child(node, self.walk[at])
                    at += 1
                if not st._valid(int(tokens[r]), node, r == 0):
                    out[r] = self._mask(node, r == 0)
        finally:
            st.matcher.rollback(at)
        st._check()
        if st.timing and st.step_costs:
            st.step_costs[-1][0] += time.perf_counter() - started
        return out

    def _mask(self, node: list[Any] | None, first: bool) -> torch.Tensor:
        st = self.state
        st._grow(1)
        st._fill(0, node, first)
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
                    node = _child(node, self.walk[r])
                    at += 1
        finally:
            st.matcher.rollback(at)
        st._check()
        return out


@functools.lru_cache(maxsize=1)
def _text_start_spec() -> str:
    return _llguidance().LLMatcher.grammar_from_lark(TEXT_START)


class GrammarLogitsProcessor:
    """The same constraint for ``transformers.generate`` (batch size 1): each call consumes
    the tokens generated since the last one and masks the scores. The reference plain
    decoding of the equivalence tests and the bench's ``hf-*`` baselines.

    Args:
        grammar, tokenizer, vocab_size, eos_ids: as :class:`GrammarState`.
        prompt_len: the prompt's length in ``input_ids``.
    """

    def __init__(self, grammar: Grammar, tokenizer: Any, *, vocab_size: int,
                 eos_ids: Sequence[int], prompt_len: int) -> None:
        self._args = (grammar, tokenizer, vocab_size, tuple(eos_ids))
        self.state = self._fresh()
        self.prompt_len = prompt_len
        self.consumed: list[int] = []

    def _fresh(self) -> GrammarState:
        grammar, tokenizer, vocab_size, eos_ids = self._args
        return GrammarState(grammar, tokenizer, vocab_size=vocab_size, eos_ids=eos_ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise ValueError(f"GrammarLogitsProcessor takes batch size 1, got {input_ids.shape[0]}")
        # Assisted generation (prompt lookup) calls with candidate prefixes it may reject: on
        # a rejected token start over from a fresh matcher and consume the kept prefix.
        generated = input_ids[0, self.prompt_len:].tolist()
        keep = common_prefix_len(self.consumed, generated)
        if keep < len(self.consumed):
            self.state.close()
            self.state, self.consumed, keep = self._fresh(), [], 0
        try:
            self.state.advance(generated[keep:])
        except GrammarError as exc:
            raise GrammarError(f"generate produced tokens the grammar forbids: {exc}") from exc
        self.consumed = generated
        allowed = self.state.allowed_now()  # [1, vocab_size] or None: free text
        if allowed is None:
            return scores
        allowed = allowed.to(scores.device)
        width = min(scores.shape[-1], allowed.shape[-1])
        out = scores.clone()
        out[:, :width] = scores[:, :width].masked_fill(~allowed[:, :width], float("-inf"))
        out[:, width:] = float("-inf")
        return out
