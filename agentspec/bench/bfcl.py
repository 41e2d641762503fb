"""A real tool-calling agent over BFCL's multi-turn suite, recorded as a bench workload.

BFCL (the Berkeley Function Calling Leaderboard, package ``bfcl-eval``, installed with
``--no-deps``) ships multi-turn tasks (user turns + initial state of stateful tool classes),
JSON docs of the tools and their Python implementations. The JSON files are read directly and
only the tool modules are imported, so none of the package's pinned dependencies is needed.

The agent lists the tools as JSON schemas in its system prompt, follows with a short example
dialogue, and asks for calls as ``[{"name": "cd", "arguments": {"folder": "document"}}]``.
Each call runs on BFCL's own implementation; its result goes back as a ``{"role": "tool"}``
message (``tool_role="user"`` sends ``"Tool result: ..."`` as a user message instead, for chat
templates that refuse the tool role; SmolLM2's ChatML template renders any role). A turn ends
when the model answers without a tool call, or after ``max_calls_per_turn`` calls. The model
is injected as ``generate(messages) -> completion``: this module never imports the engine.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from agentspec.bench.toolcalls import (
    ToolCall,
    ToolEnvironment,
    parse_tool_calls,
    tool_module,
)
from agentspec.bench.workload import WorkloadItem

# ``generate(messages, grammar) -> completion``; ``grammar`` is a grammar spec (see
# :meth:`agentspec.grammar.Grammar.from_spec`) the completion must follow, or None.
Generate = Callable[[list[dict[str, str]], Mapping[str, Any] | None], str]

SUITE_FILE = "BFCL_v4_multi_turn_base.json"
# Variants of the base suite (the same numbered tasks with parameters left out of the user's
# requests, or with a larger file system): more of one agent's traffic, e.g. to train on.
SUITES = {"base": SUITE_FILE, "miss_param": "BFCL_v4_multi_turn_miss_param.json",
          "long_context": "BFCL_v4_multi_turn_long_context.json"}
# The prompt budget (about 1500 tokens on 2 CPU cores) cannot hold a whole class: the file
# system's 18 docs alone are ~1800 SmolLM2 tokens. These subsets keep the real docs of the
# functions the default tasks need, and are the same for every task of a class, so one
# scope has one system prompt. Classes not listed here get all their functions.
DEFAULT_TOOL_SUBSETS: dict[str, tuple[str, ...]] = {
    "GorillaFileSystem": ("ls", "cd", "mkdir", "touch", "cat", "echo", "grep", "sort", "mv"),
    "TradingBot": (
        "get_symbol_by_name", "get_stock_info", "get_watchlist", "add_to_watchlist",
        "get_account_info", "fund_account", "place_order", "get_order_details", "cancel_order",
    ),
}

# A 135M model follows a worked example in the chat far better than any instruction, so a
# short example dialogue (hand-written, with the real tools' result formats) precedes the task.
_FS_EXAMPLE = ("Go to the 'notes' folder and show me 'todo.txt'.", "cd", '{"folder": "notes"}',
               '{"current_working_directory": "notes"}', "cat", '{"file_name": "todo.txt"}',
               '{"file_content": "buy milk"}', "todo.txt says: buy milk.")
_TRADING_EXAMPLE = ("What is Apple's stock price?", "get_symbol_by_name", '{"name": "Apple"}',
                    '{"symbol": "AAPL"}', "get_stock_info", '{"symbol": "AAPL"}',
                    '{"price": 227.16, "percent_change": 0.17}', "Apple (AAPL) is at 227.16.")
FEW_SHOT = {"GorillaFileSystem": _FS_EXAMPLE, "TradingBot": _TRADING_EXAMPLE}


def _few_shot(class_name: str, tool_role: str) -> list[dict[str, str]]:
    """The example dialogue of a class: request, two calls with results, plain answer."""
    if class_name not in FEW_SHOT:
        return []
    user, name1, args1, result1, name2, args2, result2, answer = FEW_SHOT[class_name]
    call = '[{{"name": "{}", "arguments": {}}}]'.format
    return [{"role": "user", "content": user}, {"role": "assistant", "content": call(name1, args1)},
            _result_message(result1, tool_role),
            {"role": "assistant", "content": call(name2, args2)},
            _result_message(result2, tool_role), {"role": "assistant", "content": answer}]


# Interleaved by class, so that a by-task warmup/measure split puts each scope in both phases.
DEFAULT_TASK_IDS: list[str] = [
    # File-system tasks only: one tool set, one scope, and prompts that stay near 1,100-1,500
    # tokens (TradingBot's error results grew past that). Warmup: the first half.
    "multi_turn_base_9", "multi_turn_base_26", "multi_turn_base_12",
    # measure: at most DEFAULT_MAX_CALLS_PER_TURN calls per user turn
    "multi_turn_base_38", "multi_turn_base_29", "multi_turn_base_3",
]
# SmolLM2 rarely ends a turn by itself; two calls per turn keep the default bench within budget.
DEFAULT_MAX_CALLS_PER_TURN = 2

INSTRUCTIONS = """\
You are an agent that does the user's requests by calling tools. {descriptions}

Tools, as JSON schemas:
{tools}

To call a tool, reply with only a JSON list of calls, like [{example}]
Then you get the tool's result. Call the next tool, or reply in plain text when done."""


@dataclass(frozen=True)
class Task:
    """One BFCL multi-turn task.

    Attributes:
        id: BFCL id, e.g. ``"multi_turn_base_9"``.
        turns: the user turns; each is a tuple of ``{"role", "content"}`` messages.
        involved_classes: tool classes the task may use.
        initial_config: initial state per class name (BFCL's scenario dicts).
        path: the reference solution's functions as ``"Class.function"``.
    """

    id: str
    turns: tuple[tuple[Mapping[str, str], ...], ...]
    involved_classes: tuple[str, ...]
    initial_config: Mapping[str, Any]
    path: tuple[str, ...] = ()


@dataclass(frozen=True)
class CallTrace:
    """One LLM call of the agent and what came of it.

    Attributes:
        task_id: the task.
        turn: 0-based user turn.
        call: 0-based call within the turn.
        messages: exactly the messages sent to the model.
        completion: the model's text.
        calls: the tool calls parsed from the completion.
        results: one string per executed call, then one per malformed call.
        errors: the parse errors (also among ``results``).
        grammar: the grammar spec the call was constrained by, or None.
    """

    task_id: str
    turn: int
    call: int
    messages: tuple[Mapping[str, str], ...]
    completion: str
    calls: tuple[ToolCall, ...]
    results: tuple[str, ...]
    errors: tuple[str, ...]
    grammar: Mapping[str, Any] | None = None


def _package_dir() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "bfcl_eval is not installed; run: pip install --no-deps bfcl-eval==2026.3.23"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@cache
def _suite(file: str = SUITE_FILE) -> dict[str, dict[str, Any]]:
    return {e["id"]: e for e in _read_jsonl(_package_dir() / "data" / file)}


def load_tasks(ids: Sequence[str] | None = None, *, suite: str = "base") -> list[Task]:
    """Loads tasks of one of BFCL's multi-turn suites (:data:`SUITES`; default
    ``multi_turn_base``).

    Args:
        ids: task ids in the wanted order; ``None`` loads all 200 in file order.
        suite: a key of :data:`SUITES`.

    Raises:
        KeyError: an id is not in the suite, or the suite is unknown (the message names it).
    """
    if suite not in SUITES:
        raise KeyError(f"unknown BFCL suite {suite!r}; known: {', '.join(SUITES)}")
    entries = _suite(SUITES[suite])
    missing = [i for i in (ids or ()) if i not in entries]
    if missing:
        raise KeyError(f"unknown BFCL task ids {missing} (not in {SUITES[suite]})")
    return [
        Task(
            id=e["id"],
            turns=tuple(tuple(dict(m) for m in turn) for turn in e["question"]),
            involved_classes=tuple(e["involved_classes"]),
            initial_config=e.get("initial_config", {}),
            path=tuple(e.get("path", ())),
        )
        for e in (entries[i] for i in (ids if ids is not None else list(entries)))
    ]


def default_tasks() -> list[Task]:
    """The tasks of the default ``agentspec bench`` workload (:data:`DEFAULT_TASK_IDS`)."""
    return load_tasks(DEFAULT_TASK_IDS)


def main_class(task: Task) -> str:
    """The class the reference solution calls most (ties: first in ``involved_classes``)."""
    counts = Counter(p.split(".", 1)[0] for p in task.path)
    return max(task.involved_classes, key=lambda c: (counts[c], -task.involved_classes.index(c)))


@cache
def load_tool_docs(class_name: str) -> tuple[str, tuple[dict[str, Any], ...]]:
    """A class's description and its function docs as JSON schemas.

    BFCL repeats the class description in front of every function's ("This tool belongs
    to ... Tool description: ..."); it is split off here and stated once. The ``response``
    schema is dropped: the model needs only how to call a tool.

    Returns:
        ``(class_description, docs)``, each doc ``{"name", "description", "parameters"}``.
    """
    doc_file = f"{tool_module(class_name)}.json"
    descriptions, docs = [], []
    for doc in _read_jsonl(_package_dir() / "data" / "multi_turn_func_doc" / doc_file):
        head, sep, own = doc["description"].partition("Tool description: ")
        if sep and head.strip() not in descriptions:
            descriptions.append(head.strip())
        docs.append({"name": doc["name"], "description": (own if sep else head).strip(),
                     "parameters": doc["parameters"]})
    return " ".join(descriptions), tuple(docs)


def _example_call(docs: Sequence[Mapping[str, Any]]) -> str:
    """A one-call example taken from the prompt's own tools (first with a string argument)."""
    for doc in docs:
        props = doc["parameters"].get("properties", {})
        for name in doc["parameters"].get("required", []):
            if props.get(name, {}).get("type") == "string":
                return json.dumps({"name": doc["name"], "arguments": {name: "..."}})
    return json.dumps({"name": docs[0]["name"], "arguments": {}}) if docs else ""


def task_tools(
    classes: Sequence[str], *, tool_subsets: Mapping[str, Sequence[str]] = DEFAULT_TOOL_SUBSETS,
) -> tuple[str, list[dict[str, Any]]]:
    """The classes' description and the docs of the functions the agent is shown.

    Args:
        classes: BFCL class names, e.g. ``["GorillaFileSystem"]``.
        tool_subsets: per class, the functions to document (in the docs' order); a class
            not listed gets all of its functions.
    """
    descriptions: list[str] = []
    docs: list[dict[str, Any]] = []
    for class_name in classes:
        description, class_docs = load_tool_docs(class_name)
        keep = tool_subsets.get(class_name)
        if keep is not None:
            unknown = set(keep) - {d["name"] for d in class_docs}
            if unknown:
                raise ValueError(f"{class_name} has no functions {sorted(unknown)}")
            class_docs = tuple(d for d in class_docs if d["name"] in keep)
        descriptions.append(description)
        docs.extend(class_docs)
    return " ".join(descriptions), docs


def system_prompt(
    classes: Sequence[str], *, tool_subsets: Mapping[str, Sequence[str]] = DEFAULT_TOOL_SUBSETS,
) -> str:
    """The agent's system prompt for a set of tool classes (arguments as :func:`task_tools`)."""
    descriptions, docs = task_tools(classes, tool_subsets=tool_subsets)
    return INSTRUCTIONS.format(
        descriptions=descriptions,
        tools="\n".join(json.dumps(d, ensure_ascii=False) for d in docs),
        example=_example_call(docs),
    )


def json_schema_of(bfcl_schema: Any) -> Any:
    """A BFCL parameter schema in standard JSON Schema: BFCL writes ``"dict"`` for object,
    ``"float"`` for number, ``"tuple"`` for array and ``"any"`` for no constraint."""
    if not isinstance(bfcl_schema, Mapping):
        return bfcl_schema
    out = dict(bfcl_schema)
    kind = out.get("type")
    if kind == "any":
        del out["type"]
    elif isinstance(kind, str):
        out["type"] = {"dict": "object", "float": "number", "tuple": "array"}.get(kind, kind)
    if isinstance(out.get("properties"), Mapping):
        out["properties"] = {k: json_schema_of(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), Mapping):
            out[key] = json_schema_of(out[key])
    return out


def task_grammar(
    task: Task, *, tool_subsets: Mapping[str, Sequence[str]] = DEFAULT_TOOL_SUBSETS,
) -> dict[str, Any]:
    """The grammar spec of the agent's replies on ``task``: a JSON list of calls of the tools
    it is shown (each with arguments valid under the tool's schema), or plain text."""
    _, docs = task_tools(task.involved_classes, tool_subsets=tool_subsets)
    tools = [{"name": d["name"], "parameters": json_schema_of(d["parameters"])} for d in docs]
    return {"type": "tool_calls", "tools": tools, "choice": "auto", "as_list": True}


def _result_message(result: str, tool_role: str) -> dict[str, str]:
    if tool_role == "tool":
        return {"role": "tool", "content": result}
    return {"role": "user", "content": f"Tool result: {result}"}


def _opening(
    task: Task, tool_role: str, tool_subsets: Mapping[str, Sequence[str]],
) -> list[dict[str, str]]:
    """The system prompt and the example dialogues that precede a task's first turn."""
    prompt = system_prompt(task.involved_classes, tool_subsets=tool_subsets)
    messages = [{"role": "system", "content": prompt}]
    for class_name in task.involved_classes:
        messages.extend(_few_shot(class_name, tool_role))
    return messages


def run_task(
    task: Task,
    generate: Generate,
    *,
    max_calls_per_turn: int = 3,
    max_turns: int | None = None,
    tool_role: str = "tool",
    tool_subsets: Mapping[str, Sequence[str]] = DEFAULT_TOOL_SUBSETS,
    env: ToolEnvironment | None = None,
    constrain: bool = True,
) -> list[CallTrace]:
    """Runs the agent on one task against BFCL's tool implementations.

    Per user turn the model is called up to ``max_calls_per_turn`` times; the turn ends
    early when it answers without a tool call. Malformed calls are not executed: their
    error goes back to the model like a tool result. An empty completion is not added to
    the history (a workload message cannot be empty) and ends the turn.

    Args:
        task: the task.
        generate: the model, ``messages -> completion text``.
        max_calls_per_turn: LLM calls at most per user turn (>= 1).
        max_turns: user turns to play at most; ``None`` plays all.
        tool_role: ``"tool"``, or ``"user"`` for chat templates that refuse the tool role.
        tool_subsets: functions documented per class (see :func:`system_prompt`).
        env: the tools to run the calls on; default a fresh ``ToolEnvironment(task)``.
            Pass one to inspect the tools' state afterwards.
        constrain: pass :func:`task_grammar` with every call, so that every call the model
            writes parses as calls of the task's tools; False: unconstrained text.

    Returns:
        One trace per LLM call, in order.
    """
    if max_calls_per_turn < 1:
        raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
    if tool_role not in ("tool", "user"):
        raise ValueError(f"tool_role must be 'tool' or 'user', got {tool_role!r}")
    env = env if env is not None else ToolEnvironment(task)
    grammar = task_grammar(task, tool_subsets=tool_subsets) if constrain else None
    messages = _opening(task, tool_role, tool_subsets)
    traces: list[CallTrace] = []
    for turn, user_messages in enumerate(task.turns[:max_turns]):
        messages.extend(dict(m) for m in user_messages)
        for call in range(max_calls_per_turn):
            sent = tuple(dict(m) for m in messages)
            completion = generate([dict(m) for m in sent], grammar)
            calls, errors = _reply_calls(completion, constrained=grammar is not None)
            results = [env.execute(c) for c in calls] + errors
            traces.append(CallTrace(task.id, turn, call, sent, completion, tuple(calls),
                                    tuple(results), tuple(errors), grammar))
            if not completion.strip():
                break
            messages.append({"role": "assistant", "content": completion})
            if not results:
                break
            messages.extend(_result_message(r, tool_role) for r in results)
    return traces


def _reply_calls(completion: str, *, constrained: bool) -> tuple[list[ToolCall], list[str]]:
    """The calls of a reply. Under the grammar a reply is a call list exactly when it starts
    with ``[`` (the grammar's two branches); plain text is never read as a call attempt."""
    if constrained and not completion.lstrip().startswith("["):
        return [], []
    return parse_tool_calls(completion)


def build_workload(
    tasks: Sequence[Task],
    generate: Generate,
    *,
    warmup_fraction: float = 0.5,
    max_new_tokens: int = 128,
    scope_of: Callable[[Task], str] = lambda task: f"bfcl-{main_class(task)}",
    max_calls_per_turn: int = 3,
    max_turns: int | None = None,
    tool_role: str = "tool",
    constrain: bool = True,
    traces_out: list[CallTrace] | None = None,
) -> list[WorkloadItem]:
    """Runs the agent on every task and turns each LLM call into one workload line.

    The split is by task: the first ``floor(len(tasks) * warmup_fraction)`` tasks are
    ``warmup``, the rest ``measure`` (at least one), so no task is in both phases. Item ids
    are ``"<task id>-turn<t>-call<c>"``.

    Args:
        tasks: the tasks, in order.
        generate: the model; it should itself stop at ``max_new_tokens``.
        warmup_fraction: share of tasks in the warmup phase, in [0, 1).
        max_new_tokens: recorded on every item.
        scope_of: the memory scope of a task's calls; default ``"bfcl-" + main class``.
        max_calls_per_turn, max_turns, tool_role, constrain: as in :func:`run_task`; each
            item carries its call's grammar, so the bench decodes under it too.
        traces_out: when given, every call's trace is appended to it (for
            :func:`parse_summary`).
    """
    if not 0 <= warmup_fraction < 1:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")
    if not tasks:
        raise ValueError("build_workload needs at least one task, got none")
    n_warmup = min(int(len(tasks) * warmup_fraction), len(tasks) - 1)
    items = []
    for index, task in enumerate(tasks):
        phase = "warmup" if index < n_warmup else "measure"
        traces = run_task(task, generate, max_calls_per_turn=max_calls_per_turn,
                          max_turns=max_turns, tool_role=tool_role, constrain=constrain)
        if traces_out is not None:
            traces_out.extend(traces)
        for trace in traces:
            items.append(WorkloadItem(
                id=f"{task.id}-turn{trace.turn}-call{trace.call}", scope=scope_of(task),
                phase=phase, messages=trace.messages, max_new_tokens=max_new_tokens,
                grammar=trace.grammar,
            ))
    return items


def parse_summary(traces: Sequence[CallTrace], tasks: Sequence[Task], *,
                  tool_subsets: Mapping[str, Sequence[str]] = DEFAULT_TOOL_SUBSETS,
                  ) -> dict[str, Any]:
    """How many of the agent's replies were tool calls, and how many of those parse as calls
    of the tools the task shows (every call in the reply named among them, with an arguments
    object).

    Returns:
        ``{"replies", "call_replies", "valid_call_replies", "parse_rate"}`` (the rate over
        replies that attempted a call; None when none did).
    """
    shown = {t.id: {d["name"] for d in task_tools(t.involved_classes,
                                                    tool_subsets=tool_subsets)[1]} for t in tasks}
    attempted = [tr for tr in traces if tr.calls or tr.errors
                 or (tr.grammar is not None and tr.completion.lstrip().startswith("["))]
    valid = [tr for tr in attempted
             if not tr.errors and all(c.name in shown[tr.task_id] for c in tr.calls)]
    return {"replies": len(traces), "call_replies": len(attempted),
            "valid_call_replies": len(valid),
            "parse_rate": len(valid) / len(attempted) if attempted else None}
