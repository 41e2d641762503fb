"""Tool-call formats: the text a model writes to call a tool, one entry per model family.

Models are trained to call tools in their own layout, and a chat template that renders tools
teaches that layout. A :class:`ToolFormat` is one such layout: the text around a call's JSON
(its wrapper), the key of the arguments, and whether parallel calls are one JSON list or
repeated wrappers. Each format renders calls as the model would write them (its answers, and
the assistant turns of earlier calls in a prompt), parses text back into calls without ever
raising, and gives :meth:`agentspec.grammar.Grammar.tool_calls` the grammar around the JSON
and the first characters of plain text under ``choice="auto"``.

The registry (:data:`FORMATS`):

- ``json``: a bare ``{"name": ..., "arguments": {...}}`` (agentspec's own system block teaches
  it when the template renders no tools);
- ``hermes``: Hermes, Qwen2.5 and Qwen3, ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
  blocks, one per call, joined by a newline;
- ``llama3``: Llama 3.1 and 3.2, a bare ``{"name": ..., "parameters": {...}}`` (one call);
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]``;
- ``mistral_v11``: Mistral's tokenizers from v11 (Mistral Small 3.1 and later, Devstral,
  Magistral), ``[TOOL_CALLS]name[ARGS]{...}`` per call, calls written one after the other;
- ``phi``: Phi-4-mini, ``<|tool_call|>[{"name": ..., "arguments": ...}, ...]<|/tool_call|>``;
- ``granite``: Granite 3, ``<|tool_call|>[{"name": ..., "arguments": ...}, ...]``.

Where a model's tokenizer holds a wrapper as one special token (Mistral's ``[TOOL_CALLS]``,
Phi's and Granite's ``<|tool_call|>``), :meth:`ToolFormat.on` binds the format to those tokens:
its grammar then admits the wrapper as that token only, the one the model was trained to
emit, never spelled out in pieces; and the grammar keeps the token in the output's text
(:attr:`agentspec.grammar.Grammar.keep`), which is otherwise decoded without special tokens,
so the parse reads the wrapper where the model wrote it. Unbound (a tokenizer without such a
token, or a format named without one), a wrapper is text like any other.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agentspec.text import special_token_ids

ARGUMENT_KEYS = ("arguments", "parameters", "args")
# Text the lenient JSON parse drops from the content around its calls (fences, stray tags).
_JUNK = ("```json", "```", "<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class Call:
    """A parsed call: the tool's name and its arguments (an object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class BadCall:
    """Text that was meant as a call but is not a valid one: the name when one was read, the
    raw text of the call or of its arguments, and why it is refused."""

    name: str | None
    raw: str
    error: str


@dataclass(frozen=True)
class Parsed:
    """Model output split into its plain text, its valid calls and its invalid ones."""

    content: str
    calls: tuple[Call, ...]
    invalid: tuple[BadCall, ...]


@dataclass(frozen=True)
class ToolFormat:
    """One layout of tool calls as text.

    Attributes:
        name: the registry's name (``--tool-format``, ``tool_format=``).
        open: the text before a call's JSON (``listed=False``) or before the list of calls.
        close: the text after it.
        args_key: the key of a call's arguments (``"arguments"`` or ``"parameters"``).
        listed: parallel calls are one JSON list inside one wrapper.
        between: what separates two calls written one after the other (unlisted formats);
            None: one call only.
        first: the characters a call may start with; plain text under ``choice="auto"``
            starts with none of them (nor with whitespace), so its first token decides.
        tokens: the wrapper's parts that are one special token in the model's tokenizer,
            with their ids (set by :meth:`on`): the grammar writes each as that token.
        named: with a value, a call is its tool's name, this text, then its arguments' JSON
            (``open`` + name + ``named`` + arguments), not one JSON object.
    """

    name: str
    open: str = ""
    close: str = ""
    args_key: str = "arguments"
    listed: bool = False
    between: str | None = None
    first: str = "{"
    tokens: tuple[tuple[str, int], ...] = ()
    named: str = ""

    def on(self, tokenizer: Any) -> ToolFormat:
        """This format bound to ``tokenizer``'s special tokens: each wrapper part (:meth:`parts`)
        that the tokenizer holds as one special token (one it drops from decoded text). Parts that are plain text or ordinary added
        tokens stay text: the grammar admits an added token through its text."""
        if not hasattr(tokenizer, "convert_tokens_to_ids"):
            return self
        special = special_token_ids(tokenizer)
        found: list[tuple[str, int]] = []
        for part in self.parts():
            token = tokenizer.convert_tokens_to_ids(part)
            # An unknown part maps to the unknown token (itself special): checked both ways.
            if isinstance(token, int) and token in special \
                    and tokenizer.convert_ids_to_tokens(token) == part:
                found.append((part, token))
        return replace(self, tokens=tuple(found))

    def parts(self) -> tuple[str, ...]:
        """The wrapper's parts: ``open``, ``close`` and ``named`` without surrounding
        whitespace."""
        return tuple(p for p in (self.open.strip(), self.close.strip(), self.named.strip()) if p)

    def bound(self, tokens: Mapping[str, int]) -> ToolFormat:
        """This format with ``tokens`` (wrapper part -> special token id) as its
        :attr:`tokens`, as :meth:`on` would find them (a grammar spec carries them as such).

        Raises:
            ValueError: a key is no wrapper part of this format, or an id is no token id.
        """
        for part, token in tokens.items():
            if part not in self.parts():
                raise ValueError(f"{part!r} is no wrapper part of the {self.name} format "
                                 f"(its parts: {list(self.parts())})")
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"the token id of {part!r} must be a non-negative int, "
                                 f"got {token!r}")
        return replace(self, tokens=tuple(tokens.items()))

    @property
    def keep(self) -> tuple[int, ...]:
        """The special tokens this format writes, kept in the output's text."""
        return tuple(token for _, token in self.tokens)

    # -- text out ---------------------------------------------------------------------------

    def render(self, calls: Sequence[tuple[str, Any]]) -> str:
        """``(name, arguments)`` calls as the model writes them in this format (compact JSON,
        the grammars' layout)."""
        if self.named:
            return self._wrap([f"{name}{self.named}{json.dumps(args, ensure_ascii=False)}"
                               for name, args in calls])
        return self._wrap([json.dumps({"name": name, self.args_key: args}, ensure_ascii=False)
                           for name, args in calls])

    def shape(self) -> str:
        """The format's layout with placeholders, for a system prompt that teaches it."""
        if self.named:
            return self._wrap([f"<tool name>{self.named}{{<argument>: <value>}}"])
        return self._wrap(['{"name": "<tool name>", "' + self.args_key
                           + '": {<argument>: <value>}}'])

    def _wrap(self, bodies: list[str]) -> str:
        if not bodies:
            return ""
        if self.listed:
            return f"{self.open}[{', '.join(bodies)}]{self.close}"
        between = "\n" if self.between is None else self.between
        return between.join(f"{self.open}{b}{self.close}" for b in bodies)

    # -- the grammar's parts ----------------------------------------------------------------

    @property
    def wrapped(self) -> bool:
        """Calls sit inside text of their own (else a call is a bare JSON value)."""
        return bool(self.open or self.close)

    def lark(self, call_schema: Mapping[str, Any], layout: Mapping[str, Any]) -> str:
        """A Lark grammar (llguidance's dialect) of one answer of calls in this format, each
        call valid under ``call_schema`` (a JSON schema of one call object) and written in
        ``layout`` (llguidance's ``x-guidance`` JSON options). Only for :attr:`wrapped`
        formats: a bare one is its JSON schema alone."""
        if not self.wrapped:
            raise ValueError(f"the {self.name} format has no wrapper: use its JSON schema")
        close = f" {self._lark_part(self.close)}" if self.close else ""
        opening = self._lark_part(self.open)
        if self.listed:
            items = {"type": "array", "items": dict(call_schema), "minItems": 1,
                     "x-guidance": dict(layout)}
            return (f"start: {opening} calls{close}\n"
                    f"calls: %json {json.dumps(items)}\n")
        more = "" if self.between is None else \
            " call*" if not self.between else f" ({_lark_str(self.between)} call)*"
        if self.named:  # the name outside the JSON: one alternative per tool
            options = call_schema.get("anyOf", [call_schema])
            rules = [f"call: {opening} (" + " | ".join(f"t{i}" for i in range(len(options)))
                     + f"){close}"]
            for i, option in enumerate(options):
                props = option["properties"]
                args = {**props[self.args_key], "x-guidance": dict(layout)}
                rules.append(f"t{i}: {_lark_str(props['name']['const'])} "
                             f"{self._lark_part(self.named)} a{i}")
                rules.append(f"a{i}: %json {json.dumps(args)}")
            return f"start: call{more}\n" + "\n".join(rules) + "\n"
        return (f"start: call{more}\n"
                f"call: {opening} body{close}\n"
                f"body: %json {json.dumps({**call_schema, 'x-guidance': dict(layout)})}\n")

    def _lark_part(self, text: str) -> str:
        """``text`` (an opening or closing) in Lark: a bound special token as that token
        (``<[id]>``, llguidance's token syntax), the whitespace around it as text."""
        core = text.strip()
        token = dict(self.tokens).get(core)
        if not core or token is None:
            return _lark_str(text)
        head, tail = text[: text.index(core)], text[text.index(core) + len(core):]
        return " ".join([*([_lark_str(head)] if head else []), f"<[{token}]>",
                         *([_lark_str(tail)] if tail else [])])

    def text_start_lark(self) -> str:
        """A Lark grammar of plain text that does not start like a call of this format."""
        chars = "".join(re.escape(c) for c in self.first)
        return f"start: TEXT\nTEXT: /[^{chars}\\s][\\s\\S]*/\n"

    # -- text in ----------------------------------------------------------------------------

    def starts_call(self, text: str) -> bool:
        """Whether output starting with ``text`` may still turn out to be a call."""
        head = text.lstrip()
        if not head:
            return True
        if self.name == "json":  # the lenient parse also reads fenced and tagged calls
            return head.startswith(("{", "```", "<tool_call>", "["))
        if not self.wrapped:
            return head.startswith("{")
        tag = self.open.strip()
        return head.startswith(tag) or tag.startswith(head)

    def parse(self, text: str) -> Parsed:
        """Split ``text`` into its content, its valid calls and its invalid ones; never
        raises. A wrapper whose JSON does not parse is an invalid call carrying the wrapper's
        text; output that starts like a call but holds none (cut off by a token limit inside
        the opening, or a bare format's malformed JSON) is one invalid call carrying the whole
        text."""
        if self.named:
            return self._parse_named(text)
        if self.wrapped:
            return self._parse_wrapped(text)
        return _parse_bare(text, self)

    def _parse_named(self, text: str) -> Parsed:
        """Calls written ``open`` + name + ``named`` + arguments, one after the other."""
        tag, sep = self.open.strip(), self.named.strip()

        def block(start: int, calls: list[Call], invalid: list[BadCall]) -> int:
            at = start + len(tag)
            following = text.find(tag, at)
            block_end = following if following >= 0 else len(text)
            mid = text.find(sep, at, block_end)
            name = text[at:mid if mid >= 0 else block_end].strip()
            if mid < 0 or not name:
                why = f"no {sep} after the tool's name" if mid < 0 else "a call without a name"
                invalid.append(BadCall(name or None, text[at:block_end].strip(), why))
                return block_end
            try:
                value, end = _DECODER.raw_decode(text, _skip_space(text, mid + len(sep)))
            except json.JSONDecodeError as exc:
                invalid.append(BadCall(name, text[mid + len(sep):block_end].strip(),
                                       f"arguments are not JSON: {exc}"))
                return block_end
            _read_call({"name": name, self.args_key: value}, calls, invalid, require_name=True)
            return end

        return _scan_tagged(text, tag, block)

    def _parse_wrapped(self, text: str) -> Parsed:
        tag, end_tag = self.open.strip(), self.close.strip()

        def block(start: int, calls: list[Call], invalid: list[BadCall]) -> int:
            body = start + len(tag)
            stop = text.find(end_tag, body) if end_tag else -1
            try:
                value, end = _DECODER.raw_decode(text, _skip_space(text, body))
            except json.JSONDecodeError as exc:
                raw = text[body:stop if stop >= 0 else len(text)].strip()
                invalid.append(BadCall(None, raw, f"no parseable call JSON after {tag}: {exc}"))
                return stop + len(end_tag) if stop >= 0 else len(text)
            after = _skip_space(text, end)
            rest = text[after:].rstrip()
            if end_tag and text.startswith(end_tag, after):
                end = after + len(end_tag)
            elif end_tag and rest and end_tag.startswith(rest):  # the closing tag cut off
                end = len(text)
            for item in value if isinstance(value, list) else [value]:
                _read_call(item, calls, invalid, require_name=True)
            return end

        return _scan_tagged(text, tag, block)


_DECODER = json.JSONDecoder()


def _scan_tagged(text: str, tag: str,
                 block: Callable[[int, list[Call], list[BadCall]], int]) -> Parsed:
    """A tagged format's parse: ``block`` reads the call (or calls) opened by ``tag`` at a
    start into the lists and returns where it ends; the rest of the text is the content. No
    block at all is plain text, or one invalid call where the output stops inside the opening
    tag (a token limit)."""
    calls: list[Call] = []
    invalid: list[BadCall] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    while (start := text.find(tag, pos)) >= 0:
        pos = block(start, calls, invalid)
        spans.append((start, pos))
    if not spans:
        head = text.strip()
        if head and tag.startswith(head):
            return Parsed("", (), (BadCall(None, text, f"the output stops inside {tag}"),))
        return Parsed(text, (), ())
    return Parsed(_cut(text, spans).strip(), tuple(calls), tuple(invalid))


def _parse_bare(text: str, fmt: ToolFormat) -> Parsed:
    """Every JSON object with a string ``"name"`` (and ``"arguments"``, ``"parameters"`` or
    ``"args"``) in the text is a call: bare, fenced, or in tags (lenient: the ``json``
    format's parse, and Llama 3's ``;``-separated calls)."""
    decoder = json.JSONDecoder()
    found: list[Any] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    while (start := text.find("{", pos)) >= 0:
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            pos = start + 1
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            found.append(obj)
            spans.append((start, end))
        pos = end
    calls: list[Call] = []
    invalid: list[BadCall] = []
    for obj in found:
        _read_call(obj, calls, invalid, require_name=False)
    if not found and fmt.starts_call(text) and text.strip():
        return Parsed("", (), (BadCall(None, text, "no parseable tool call JSON in the output"),))
    if not found:
        return Parsed(text, (), ())
    content = _cut(text, spans)
    for junk in _JUNK:
        content = content.replace(junk, "")
    return Parsed(content.strip(), tuple(calls), tuple(invalid))


def _read_call(item: Any, calls: list[Call], invalid: list[BadCall], *,
               require_name: bool) -> None:
    """One decoded call object into ``calls``, or ``invalid`` with the reason."""
    if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
        if require_name:
            invalid.append(BadCall(None, json.dumps(item, ensure_ascii=False),
                                   'a call must be an object with a string "name"'))
        return
    name = item["name"]
    args: Any = next((item[k] for k in ARGUMENT_KEYS if k in item), {})
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as exc:
            invalid.append(BadCall(name, args, f"arguments are not JSON: {exc}"))
            return
    if not isinstance(args, dict):
        invalid.append(BadCall(name, json.dumps(args), f"arguments must be an object, got {args!r}"))
        return
    calls.append(Call(name, args))


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
    for start, end in reversed(spans):
        text = text[:start] + text[end:]
    return text


def _lark_str(text: str | None) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text or "")


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("json", first="{["),
    ToolFormat("hermes", open="<tool_call>\n", close="\n</tool_call>", between="\n", first="<"),
    ToolFormat("llama3", args_key="parameters"),
    ToolFormat("mistral", open="[TOOL_CALLS] ", listed=True, first="["),
    ToolFormat("mistral_v11", open="[TOOL_CALLS]", named="[ARGS]", between="", first="["),
    ToolFormat("phi", open="<|tool_call|>", close="<|/tool_call|>", listed=True, first="<"),
    ToolFormat("granite", open="<|tool_call|>", listed=True, first="<"),
)}


def tool_format(name: str | ToolFormat) -> ToolFormat:
    """The registered format called ``name`` (a :class:`ToolFormat` is returned as is).

    Raises:
        ValueError: ``name`` is no registered format; the message lists the known ones.
    """
    if isinstance(name, ToolFormat):
        return name
    found = FORMATS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown tool format {name!r}; known formats: {', '.join(FORMATS)} "
                         "(or leave it unset to detect it from the chat template)")
    return found


def detect_tool_format(chat_template: str | None) -> str:
    """The format a chat template teaches, read from the markers it renders calls with:
    ``<tool_call>`` (hermes), ``[TOOL_CALLS]`` (mistral; mistral_v11 with ``[ARGS]``),
    ``<|/tool_call|>`` or ``<|tool|>``
    (phi), ``<|tool_call|>`` (granite), ``parameters`` beside ``<|python_tag|>`` or
    ``ipython`` (llama3); ``json`` for a template that renders no tools or none of these."""
    text = chat_template or ""
    if "tools" not in text:
        return "json"
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral_v11" if "[ARGS]" in text else "mistral"
    if "<|/tool_call|>" in text or "<|tool|>" in text:
        return "phi"
    if "<|tool_call|>" in text:
        return "granite"
    if "parameters" in text and ("<|python_tag|>" in text or "ipython" in text):
        return "llama3"
    return "json"
