"""Tolerant parsing of an LLM's tool calls (JSON, optionally fenced or in ``<tool_call>`` tags).

Small models format calls loosely; a malformed call must become an error message for the
model, never an exception in the agent loop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: a function name and its keyword arguments."""

    name: str
    arguments: Mapping[str, Any]


_TAGGED = re.compile(r"<(tool_?call|functions?)>(.*?)(?:</\1>|\Z)", re.S | re.I)
_FENCED = re.compile(r"```[a-zA-Z_]*\s*(.*?)(?:```|\Z)", re.S)
_OPENING = re.compile(r"[\[{]")
_CALL_KEY = re.compile(r'\{\s*"(?:name|function)"\s*:')


def _json_values(text: str) -> list[Any]:
    """Every JSON array/object embedded in ``text``, scanning left to right."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while (match := _OPENING.search(text, i)) is not None:
        try:
            value, end = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            i = match.start() + 1
            continue
        values.append(value)
        i = end
    return values


def _as_call(value: Any) -> ToolCall:
    """One call from ``{"name", "arguments"}`` (or OpenAI/BFCL spellings); ValueError if bad."""
    if not isinstance(value, dict):
        raise ValueError(f"a tool call must be a JSON object, got {value!r}")
    if isinstance(value.get("function"), dict):  # OpenAI: {"function": {"name", "arguments"}}
        value = value["function"]
    name = value.get("name", value.get("function"))
    arguments = value.get("arguments", value.get("parameters", value.get("args", {})))
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(f"arguments are not valid JSON: {arguments!r}") from None
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool call needs a non-empty string 'name', got {value!r}")
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments of {name!r} must be a JSON object, got {arguments!r}")
    return ToolCall(name, arguments)


def parse_tool_calls(completion: str) -> tuple[list[ToolCall], list[str]]:
    """Tolerantly parses a completion's tool calls; never raises.

    Accepts a JSON list or object of calls, bare or inside ``<tool_call>`` tags or a
    Markdown code fence; several objects in a row count as several calls.

    Returns:
        ``(calls, errors)``. A completion that does not look like a tool call at all (no
        tag, fence, leading ``[``/``{``, nor ``{"name":``/``{"function":``) is a plain answer: ``([], [])``.
        One that looks like a call but does not parse gives an error per malformed call.
    """
    text = completion.strip()
    segments = [m.group(2) for m in _TAGGED.finditer(text)] or _FENCED.findall(text)
    attempted = bool(segments) or text[:1] in ("[", "{") or _CALL_KEY.search(text) is not None
    if not attempted:
        return [], []
    values = [v for segment in (segments or [text]) for v in _json_values(segment)]
    calls, errors = [], []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            try:
                calls.append(_as_call(item))
            except ValueError as e:
                errors.append(f"Error: malformed tool call: {e}")
    if not calls and not errors:
        errors.append(f"Error: malformed tool call, no JSON call found in {text[:200]!r}")
    return calls, errors
