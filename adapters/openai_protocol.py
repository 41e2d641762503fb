"""OpenAI's chat-completions requests, read without a web framework.

The server (:mod:`agentspec.adapters.openai_server`) only moves bytes; this module decides
what a request means, so it can be tested without a socket:

- :func:`parse_chat_request` checks a decoded JSON body field by field and returns a
  :class:`ChatRequest`, or raises :class:`ApiError` naming the field (OpenAI's ``param``);
  fields OpenAI defines that change an output in ways agentspec cannot honour exactly
  (``n`` > 1, penalties, logit biases) are refused rather than ignored (``logprobs`` and
  ``top_logprobs``: :func:`~agentspec.adapters.openai_logprobs.chat_logprobs`);
- :func:`render` turns it into what ``Speculator.stream`` takes (the prompt and the sampling
  parameters, a grammar included) through :mod:`agentspec.adapters.chat`, the code the
  LangChain models use.

What an answer looks like is :mod:`.openai_answers`' (:func:`completion_body`,
:func:`chunk_body`, :func:`sse`; importable from here too), the errors :mod:`.openai_errors`'.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentspec.adapters.chat import (
    build_prompt,
    call_grammar,
    calls_text,
    resolve_tool_format,
    schema_grammar,
    tool_choice_mode,
)
from agentspec.adapters.json_text import lone_surrogate
from agentspec.adapters.openai_answers import (
    SSE_DONE,
    chunk_body,
    completion_body,
    openai_calls,
    sse,
)
from agentspec.adapters.openai_errors import ApiError, bad
from agentspec.config import SamplingParams
from agentspec.grammar import Grammar
from agentspec.grammar.tool_formats import ToolFormat

# The answers and errors are their own modules' (above); importable from here as before.
__all__ = ["SSE_DONE", "ApiError", "ChatRequest", "Rendered", "bad", "check_scope", "chunk_body",
           "completion_body", "openai_calls", "parse_chat_request", "render", "sse"]

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}
# Request fields: those acted on, those accepted only at their neutral value (anything else
# would change the output in a way this server does not do), and those read and ignored.
SUPPORTED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
             "top_k", "seed", "stop", "stream", "stream_options", "tools", "tool_choice",
             "parallel_tool_calls", "response_format", "user", "n", "logprobs", "top_logprobs"}
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},)}
IGNORED = {"metadata": dict, "store": bool, "service_tier": str, "safety_identifier": str,
           "prompt_cache_key": str}
SCOPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_STOPS = 4
MAX_TOOLS = 128


def check_scope(name: Any, param: str) -> str:
    """A memory scope's name (:data:`SCOPE_NAME`: letters, digits and ``_.:@-``, starting
    with a letter or digit, not too long); anything else is a 400 naming where it came from."""
    if not isinstance(name, str) or not SCOPE_NAME.fullmatch(name):
        raise bad(f"{param} must be a scope name (1-128 characters: letters, digits, "
                  f"'_.:@-', starting with a letter or digit), got {name!r:.80}", param,
                  "invalid_scope")
    return name


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request.

    ``messages`` are agentspec's ``{"role", "content"}`` dicts (tool calls of assistant turns
    rendered in the ``json`` format); ``tool_turns`` keeps those turns' text and calls
    (``(index, text, ((name, arguments), ...))``), which :func:`render` writes again in the
    model's tool-call format; ``json_schema`` is the schema of a ``json_schema`` or
    ``json_object`` response format, None for text.
    """

    model: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = None
    json_schema: dict[str, Any] | None = None
    user: str | None = None
    tool_turns: tuple[tuple[int, str, tuple[tuple[str, Any], ...]], ...] = ()


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _typed(body: Mapping[str, Any], name: str, want: str, param: str | None = None) -> Any:
    """``body[name]`` (None when absent or null) if it is of type ``want``: ``str``, ``bool``,
    ``int``, ``number``, ``object`` or ``array``."""
    value = body.get(name)
    if value is None:
        return None
    ok = {"str": isinstance(value, str), "bool": isinstance(value, bool),
          "int": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value),
          "object": isinstance(value, dict), "array": isinstance(value, list)}[want]
    if not ok:
        article = "an" if want[0] in "aeiou" else "a"
        raise bad(f"{param or name} must be {article} {want}, got {_kind(value)}: {value!r:.60}",
                  param or name, "invalid_type")
    return value


def parse_chat_request(body: Any, *, models: Sequence[str], max_tokens: int) -> ChatRequest:
    """Check a decoded request body; ``models`` are the names served, ``max_tokens`` the
    server's bound (also the default).

    Raises:
        ApiError: 400 naming the first bad field, 404 for a model not served.
    """
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_kind(body)}", None, "invalid_body")
    for name in body:
        if name in SUPPORTED or name in IGNORED:
            continue
        if name not in NEUTRAL:
            raise bad(f"unrecognized request argument supplied: {name!r:.60}", str(name)[:60],
                      "unknown_parameter")
        if body[name] is not None and body[name] not in NEUTRAL[name]:
            raise bad(f"{name} is not supported (only {NEUTRAL[name][0]!r}), got {body[name]!r:.60}",
                      name, "unsupported_parameter")
    for name, kind in IGNORED.items():
        _typed(body, name, {dict: "object", bool: "bool", str: "str"}[kind])
    model = _typed(body, "model", "str")
    if not model:
        raise bad("model is required", "model", "missing_parameter")
    if model not in models:
        raise ApiError(404, f"the model {model!r:.80} does not exist; served: {list(models)}",
                       param="model", code="model_not_found")
    n = _typed(body, "n", "int")
    if n not in (None, 1):
        raise bad(f"n must be 1 (one choice per request), got {n}", "n", "unsupported_parameter")
    stream = bool(_typed(body, "stream", "bool"))
    options = _typed(body, "stream_options", "object")
    if options is not None and not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    include_usage = bool(_typed(options or {}, "include_usage", "bool",
                                "stream_options.include_usage"))
    _typed(body, "parallel_tool_calls", "bool")
    tools = _tools(body)
    tool_choice = _tool_choice(body, tools)
    schema = _response_format(body)
    if schema is not None and tool_choice_mode(tools, tool_choice) is not None:
        raise bad("give either tools (with a tool_choice other than 'none') or a JSON "
                  "response_format, not both", "response_format")
    messages, tool_turns = _messages(body)
    return ChatRequest(
        model=model, messages=messages, tool_turns=tool_turns,
        max_tokens=_max_tokens(body, max_tokens),
        temperature=_bounded(body, "temperature", 1.0, 0.0, 2.0, low_open=False),
        top_p=_bounded(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_positive(body, "top_k"), seed=_seed(body), stop=_stops(body), stream=stream,
        include_usage=include_usage, tools=tools, tool_choice=tool_choice, json_schema=schema,
        user=_typed(body, "user", "str"))


def _bounded(body: Mapping[str, Any], name: str, default: float, low: float, high: float, *,
             low_open: bool) -> float:
    value = _typed(body, name, "number")
    if value is None:
        return default
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise bad(f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}", name, "invalid_value")
    return float(value)


def _positive(body: Mapping[str, Any], name: str) -> int | None:
    value = _typed(body, name, "int")
    if value is not None and value < 1:
        raise bad(f"{name} must be at least 1, got {value}", name, "invalid_value")
    return value  # type: ignore[no-any-return]


def _seed(body: Mapping[str, Any]) -> int | None:
    seed = _typed(body, "seed", "int")
    if seed is not None and not 0 <= seed < 2 ** 63:
        raise bad(f"seed must be in [0, 2**63), got {seed}", "seed", "invalid_value")
    return seed  # type: ignore[no-any-return]


def _max_tokens(body: Mapping[str, Any], limit: int) -> int:
    given = {name: _positive(body, name) for name in ("max_completion_tokens", "max_tokens")}
    values = {v for v in given.values() if v is not None}
    if len(values) > 1:
        raise bad(f"max_tokens and max_completion_tokens differ ({given}); give one",
                  "max_tokens", "invalid_value")
    value = values.pop() if values else limit
    if value > limit:
        name = "max_completion_tokens" if given["max_completion_tokens"] else "max_tokens"
        raise bad(f"{name} is {value}, more than this server's limit of {limit}", name,
                  "max_tokens_exceeded")
    return value


def _stops(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"stop must be a non-empty string or an array of them, got {stop!r:.60}",
                  "stop", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise bad(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop", "invalid_value")
    return stops


def _text(content: Any, param: str) -> str | None:
    """A message's content as text: a string, or an array of text parts (joined by newlines)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{param} must be a string or an array of text parts, got {_kind(content)}",
                  param, "invalid_type")
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in ("text", "refusal"):
            kind = part.get("type") if isinstance(part, dict) else _kind(part)
            raise bad(f"{where} must be a text part ({{'type': 'text', 'text': ...}}); this "
                      f"server takes text only, got {kind!r:.40}", where, "invalid_content")
        text = part.get(part["type"])
        if not isinstance(text, str):
            raise bad(f"{where}.{part['type']} must be a string, got {_kind(text)}",
                      f"{where}.{part['type']}", "invalid_type")
        texts.append(text)
    return "\n".join(texts)


def _messages(body: Mapping[str, Any]) -> tuple[list[dict[str, str]], tuple[Any, ...]]:
    """The messages, and the assistant turns with tool calls (``ChatRequest.tool_turns``)."""
    messages = _typed(body, "messages", "array")
    if not messages:
        raise bad("messages must be a non-empty array", "messages", "missing_parameter")
    out, turns = [], []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"{where} must be an object, got {_kind(msg)}", where, "invalid_type")
        unknown = sorted(set(msg) - MESSAGE_FIELDS)
        if unknown:
            raise bad(f"{where} has unknown fields {unknown!r:.80}", f"{where}.{unknown[0]:.40}",
                      "unknown_parameter")
        role = msg.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {sorted(ROLES)}, got {role!r:.40}",
                      f"{where}.role", "invalid_value")
        _typed(msg, "name", "str", f"{where}.name")
        content = _text(msg.get("content"), f"{where}.content")
        calls = _message_calls(msg, f"{where}.tool_calls") if role == "assistant" else []
        if role != "assistant" and msg.get("tool_calls") is not None:
            raise bad(f"{where}.tool_calls is only allowed on assistant messages",
                      f"{where}.tool_calls")
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise bad(f"{where}.tool_call_id must be a string on a tool message",
                      f"{where}.tool_call_id", "missing_parameter")
        if content is None and not (role == "assistant" and (calls or msg.get("refusal"))):
            raise bad(f"{where}.content is required", f"{where}.content", "missing_parameter")
        out.append({"role": ROLES[role], "content": calls_text(content or "", calls)})
        if calls:
            turns.append((i, content or "", tuple(calls)))
    return out, tuple(turns)


def _message_calls(msg: Mapping[str, Any], where: str) -> list[tuple[str, Any]]:
    """An assistant message's ``tool_calls`` as ``(name, arguments)``."""
    calls = _typed(msg, "tool_calls", "array", where) or []
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not isinstance(args, str):
            raise bad(f"{where}[{j}] must be {{'type': 'function', 'function': {{'name': str, "
                      f"'arguments': str}}}}", f"{where}[{j}]", "invalid_type")
        try:
            value = json.loads(args or "{}")
        except json.JSONDecodeError:
            raise bad(f"{where}[{j}].function.arguments must be JSON text", f"{where}[{j}]",
                      "invalid_value") from None
        if (not_text := lone_surrogate(value, f"{where}[{j}].function.arguments")) is not None:
            raise bad(not_text[1], not_text[0], "invalid_text")
        out.append((name, value))
    return out


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    tools = _typed(body, "tools", "array") or []
    if len(tools) > MAX_TOOLS:
        raise bad(f"tools takes at most {MAX_TOOLS} tools, got {len(tools)}", "tools", "invalid_value")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise bad(f"{where} must be {{'type': 'function', 'function': {{'name', "
                      f"'description', 'parameters'}}}}", where, "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got "
                      f"{name!r:.60}", f"{where}.function.name", "invalid_value")
        if name in names:
            raise bad(f"{where}.function.name {name!r} is given twice", f"{where}.function.name",
                      "invalid_value")
        names.add(name)
        _typed(fn, "description", "str", f"{where}.function.description")
        _typed(fn, "parameters", "object", f"{where}.function.parameters")
        _typed(fn, "strict", "bool", f"{where}.function.strict")
    return list(tools)


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]]) -> Any:
    choice = body.get("tool_choice")
    if choice is None or choice in ("none", "auto"):
        return choice
    if choice == "required":
        named = None
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        named = choice["function"]["name"]
    else:
        raise bad(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', "
                  f"'function': {{'name': ...}}}}, got {choice!r:.80}", "tool_choice", "invalid_type")
    if not tools:
        raise bad("tool_choice other than 'none'/'auto' needs tools", "tool_choice")
    if named is not None and named not in {t["function"]["name"] for t in tools}:
        raise bad(f"tool_choice names {named!r:.60}, which is not among the tools",
                  "tool_choice", "invalid_value")
    return choice


def _response_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    fmt = _typed(body, "response_format", "object")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") != "json_schema":
        raise bad(f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                  f"{fmt.get('type')!r:.40}", "response_format.type", "invalid_value")
    spec = _typed(fmt, "json_schema", "object", "response_format.json_schema")
    schema = _typed(spec or {}, "schema", "object", "response_format.json_schema.schema")
    if not schema:
        raise bad("response_format.json_schema.schema must be a non-empty object",
                  "response_format.json_schema.schema", "missing_parameter")
    return schema  # type: ignore[no-any-return]


# -- what the Speculator is asked -----------------------------------------------------------

@dataclass(frozen=True)
class Rendered:
    """A request as ``Speculator.stream`` takes it; ``calls``: parse the output for tool calls,
    written in ``tool_format``."""

    prompt: list[dict[str, str]] | str
    sampling: SamplingParams
    calls: bool
    tool_format: ToolFormat | str = "json"


def render(request: ChatRequest, tokenizer: Any, *,
           tool_format: str | ToolFormat | None = None) -> Rendered:
    """The prompt and sampling of a request, as :class:`ChatAgentSpec` builds them, tool calls
    in ``tool_format`` (None: the format the chat template teaches).

    Raises:
        ApiError: 400 when a tool's or the response format's schema does not compile.
    """
    fmt = resolve_tool_format(tokenizer, tool_format)
    grammar: Grammar | None
    param = "tools" if request.json_schema is None else "response_format"
    try:
        if request.json_schema is not None:
            grammar, system = schema_grammar(request.json_schema)
        else:
            grammar, system = call_grammar(request.tools, request.tool_choice, fmt), ""
    except ValueError as exc:  # GrammarError is one
        raise bad(f"the schema does not compile: {exc}", param, "invalid_schema") from None
    messages = list(request.messages)
    for i, text, calls in request.tool_turns:  # earlier calls as the model writes them
        messages[i] = {**messages[i], "content": calls_text(text, calls, fmt)}
    prompt = build_prompt(tokenizer, messages, tools=request.tools, system=system, tool_format=fmt,
                          constrained=grammar is not None)
    sampling = SamplingParams(temperature=request.temperature, top_p=request.top_p,
                              top_k=request.top_k, seed=request.seed, grammar=grammar)
    return Rendered(prompt, sampling, tool_choice_mode(request.tools, request.tool_choice) is not None,
                    fmt)
