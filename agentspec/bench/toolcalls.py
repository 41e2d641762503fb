"""Tool calls of the BFCL agent: tolerant parsing of the model's calls, execution on BFCL's tools.

Small models format calls loosely, and call tools that do not exist or with bad arguments; all
of that must become an error message for the model, never an exception in the agent loop.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

_TOOLS_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
# Class -> tool module (its docs are "<module>.json"), as BFCL's CLASS_FILE_PATH_MAPPING.
TOOL_MODULES: dict[str, str] = {
    "GorillaFileSystem": "gorilla_file_system", "MathAPI": "math_api",
    "MessageAPI": "message_api", "TwitterAPI": "posting_api", "TicketAPI": "ticket_api",
    "TradingBot": "trading_bot", "TravelAPI": "travel_booking",
    "VehicleControlAPI": "vehicle_control",
}



class _Task(Protocol):
    """What the environment needs of a BFCL task (bfcl.Task has it)."""

    @property
    def involved_classes(self) -> tuple[str, ...]: ...

    @property
    def initial_config(self) -> Mapping[str, Any]: ...


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


def tool_module(class_name: str) -> str:
    """The BFCL module of a tool class; ValueError naming an unknown class."""
    if class_name not in TOOL_MODULES:
        raise ValueError(f"unknown BFCL tool class {class_name!r}; known: {sorted(TOOL_MODULES)}")
    return TOOL_MODULES[class_name]


class ToolEnvironment:
    """A task's tool instances, loaded with its initial state, that execute parsed calls.

    Raises:
        ImportError: a class's module cannot be imported (names the class and module).
    """

    def __init__(self, task: _Task, *, max_result_chars: int = 600) -> None:
        self.max_result_chars = max_result_chars
        self.instances: dict[str, Any] = {}
        for class_name in task.involved_classes:
            module_name = f"{_TOOLS_PACKAGE}.{tool_module(class_name)}"
            try:
                module = importlib.import_module(module_name)
            except ImportError as e:
                raise ImportError(f"BFCL class {class_name} ({module_name}): {e}") from e
            instance = getattr(module, class_name)()
            if hasattr(instance, "_load_scenario"):  # stateless classes (MathAPI) have none
                config = copy.deepcopy(dict(task.initial_config).get(class_name, {}))
                instance._load_scenario(config, long_context=False)
            self.instances[class_name] = instance

    def _method(self, name: str) -> Callable[..., Any] | None:
        if name.startswith("_"):
            return None
        for instance in self.instances.values():
            method = getattr(instance, name, None)
            if callable(method):
                return method
        return None

    def execute(self, call: ToolCall) -> str:
        """Runs one call; any failure comes back as an ``"Error: ..."`` string, never raised."""
        method = self._method(call.name)
        if method is None:
            return f"Error: no tool named {call.name!r}"
        try:
            result = method(**call.arguments)
        except Exception as e:  # the model's bad arguments are data, not our crash
            return f"Error during execution: {type(e).__name__}: {e}"
        # As BFCL's own executor does: dicts as JSON, anything else through str().
        text = json.dumps(result, default=str) if isinstance(result, dict) else str(result)
        if len(text) > self.max_result_chars:
            cut = len(text) - self.max_result_chars
            text = f"{text[: self.max_result_chars]}... [{cut} more characters]"
        return text or "(empty result)"
