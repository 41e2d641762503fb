"""What a grammar is: JSON schemas, tool calls, regexes and Lark grammars as :class:`Grammar`.

A :class:`Grammar` is part of the sampling parameters (``SamplingParams.grammar``): the target
distribution at each step is the model's, masked by the grammar after that step's prefix
(:mod:`agentspec.grammar.state`). The matcher is llguidance: forced-token sequences and
rollback are primitives of its API, which is what speculation needs.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentspec.grammar.tool_formats import ToolFormat
from agentspec.grammar.tool_formats import tool_format as find_tool_format

# One JSON layout: the one the prompts' examples use (and the one most tokens are merged for).
# A rigid layout also means more forced tokens: no whitespace choice for the model to make.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_SOURCE = "grammar"


def import_llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # noqa: F401 - the tokenizer bridge
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("grammar-constrained decoding needs llguidance: "
                          "pip install 'agentspec-llm[grammar]'") from exc
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
            start like it (see ``text_start``): the first token decides which, and after a
            text start nothing is constrained (``tool_calls`` with ``choice="auto"``).
        text_start: with ``or_text``, llguidance's grammar of that free text, whose first
            character is none that a call of the tool format starts with, nor whitespace;
            empty: text whose first character is none of ``{``, ``[`` or whitespace (the
            ``json`` format's).
        examples: texts valid under the grammar (one call of each tool, a value of the
            schema), walked once when the grammar is first used on a tokenizer, so that its
            skeleton's masks (the tool-name choice, keys, braces) are cached and its lexer
            states built before any request needs them (see :class:`GrammarState`). Never
            part of a mask's computation: they only fill caches.
        keep: special tokens the grammar writes as tokens (a tool format's wrapper bound to
            the model's tokenizer, :meth:`ToolFormat.on
            <agentspec.grammar.tool_formats.ToolFormat.on>`): the output's text keeps them,
            where it drops every other special token.
    """

    kind: str
    spec: str = field(repr=False)
    tools: tuple[str, ...] = ()
    or_text: bool = False
    text_start: str = field(default="", repr=False)
    examples: tuple[str, ...] = field(default=(), repr=False, compare=False)
    keep: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        llg = import_llguidance()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self.spec)
        if is_error:
            raise GrammarError(f"the {self.kind} grammar does not compile: {messages[0]}")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Grammar:
        """A grammar from its JSON description (the bench workload's ``grammar`` field):
        ``{"type": "json_schema", "schema": {...}}``, ``{"type": "tool_calls", "tools": [...],
        "choice": "auto", "as_list": false, "format": "json", "special_tokens": {}}``
        (``special_tokens``: the format's wrapper parts that are one special token of the
        model's tokenizer, by id: :meth:`ToolFormat.bound
        <agentspec.grammar.tool_formats.ToolFormat.bound>`), ``{"type": "regex",
        "pattern": "..."}`` or ``{"type": "lark", "grammar": "..."}``."""
        if not isinstance(spec, Mapping):
            raise GrammarError(f"a grammar spec must be an object, got {type(spec).__name__} {spec!r:.80}")
        kind = spec.get("type")
        fields = {"json_schema": {"schema"},
                  "tool_calls": {"tools", "choice", "as_list", "format", "special_tokens"},
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
            fmt: str | ToolFormat = spec.get("format", "json")
            special = spec.get("special_tokens") or {}
            if special:
                if not isinstance(special, Mapping):
                    raise GrammarError("special_tokens must map wrapper text to a token id, "
                                       f"got {special!r:.80}")
                try:
                    fmt = find_tool_format(fmt).bound(special)
                except ValueError as exc:
                    raise GrammarError(str(exc)) from None
            return cls.tool_calls(spec.get("tools", []), choice=spec.get("choice", "required"),
                                  as_list=bool(spec.get("as_list", False)), tool_format=fmt)
        if kind == "regex":
            return cls.regex(spec.get("pattern", ""))
        return cls.lark(spec.get("grammar", ""))

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        """Output one JSON value valid under ``schema`` (a dict or its JSON text), in the
        layout ``{"key": value, "other": 1}``."""
        obj = _schema_dict(schema, "schema")
        return cls("json_schema", import_llguidance().LLMatcher.grammar_from_json_schema(
            {**obj, "x-guidance": JSON_LAYOUT}), examples=_examples([example_value(obj)]))

    @classmethod
    def tool_calls(cls, tools: Sequence[Mapping[str, Any]], *, choice: str = "required",
                   as_list: bool = False, tool_format: str | ToolFormat = "json") -> Grammar:
        """Calls of ``tools`` in a tool-call format: each call names one of the tools and
        its arguments are valid under that tool's parameter schema (no undeclared arguments).

        Args:
            tools: OpenAI-style tools (``{"type": "function", "function": {"name",
                "parameters"}}``) or plain ``{"name", "parameters"}`` dicts.
            choice: ``"required"`` (or ``"any"``): calls, nothing else; ``"auto"``: either
                calls or plain text that does not start like one; or one tool's name: calls
                of that tool.
            as_list: (``json`` format only) calls as a JSON list of one or more calls
                (``[{"name": ..., "arguments": ...}]``) instead of one object.
            tool_format: the layout of the calls, a name in
                :data:`agentspec.grammar.tool_formats.FORMATS`: ``json``
                (``{"name": ..., "arguments": ...}``, one call), or a model family's own
                (``hermes``, ``llama3``, ``mistral``, ``phi``, ``granite``), parallel calls
                where that format has them; a :class:`ToolFormat` bound to a tokenizer
                (:meth:`ToolFormat.on`) writes its special-token wrapper as those tokens.
        """
        try:
            fmt = find_tool_format(tool_format)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        if as_list and fmt.name != "json":
            raise GrammarError(f"as_list applies to the json format only; the {fmt.name} "
                               f"format lays out its own parallel calls: {fmt.shape()}")
        specs = [_tool_spec(t, i) for i, t in enumerate(tools)]
        if not specs:
            raise GrammarError("tool_calls needs at least one tool, got none")
        names = [name for name, _ in specs]
        if choice not in ("required", "any", "auto"):
            if choice not in names:
                raise GrammarError(f"choice {choice!r} names no tool; tools: {names}")
            specs = [s for s in specs if s[0] == choice]
        key = fmt.args_key
        calls = [{"type": "object", "properties": {"name": {"const": name}, key: params},
                  "required": ["name", key], "additionalProperties": False}
                 for name, params in specs]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        llg = import_llguidance()
        examples = [(name, example_value(params)) for name, params in specs]
        # "auto": a call, or text that may not start like one (see ``or_text``). Not one Lark
        # grammar ``call | TEXT``: masking free text through a lexer walks the whole vocabulary
        # every token (a mask's cost many times over), for a mask that allows everything.
        auto = choice == "auto"
        text_start = llg.LLMatcher.grammar_from_lark(fmt.text_start_lark()) \
            if auto and fmt.name != "json" else ""
        if fmt.wrapped:
            return cls("tool_calls", llg.LLMatcher.grammar_from_lark(fmt.lark(one, JSON_LAYOUT)),
                       tuple(names), or_text=auto, text_start=text_start,
                       examples=tuple(fmt.render([e]) for e in examples), keep=fmt.keep)
        schema = {"type": "array", "items": one, "minItems": 1} if as_list else one
        schema = {**schema, "x-guidance": JSON_LAYOUT}
        values = [{"name": name, key: args} for name, args in examples]
        return cls("tool_calls", llg.LLMatcher.grammar_from_json_schema(schema), tuple(names),
                   or_text=auto, text_start=text_start,
                   examples=_examples([[v] for v in values] if as_list else values))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output text matching ``pattern`` in full (Rust regex syntax, like Python's)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"regex needs a non-empty pattern string, got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise GrammarError(f"regex {pattern!r} does not compile: {exc}") from exc
        return cls("regex", import_llguidance().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """A Lark grammar in llguidance's dialect (``start`` rule; ``%json {...}`` inlines a
        JSON schema)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError(f"lark needs a grammar text, got {grammar!r}")
        return cls("lark", import_llguidance().LLMatcher.grammar_from_lark(grammar))


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
