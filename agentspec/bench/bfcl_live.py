"""Single-turn tool calling on BFCL's live requests, as a bench workload (``bfcl-live``).

BFCL's ``live_multiple`` category holds real user requests sent to deployed function-calling
agents, each with the tool set it was sent with (2-8 tools; many tool sets recur across
requests). An agent serving one tool set sees many requests against the same tool docs, so:

- one scope per tool set (identical docs), named after its functions;
- the tool sets with at least ``warmup + measure`` requests and docs that fit the prompt
  budget (``max_doc_chars``), most frequent first, ``tool_sets`` of them;
- per tool set, its first ``warmup`` requests in file order are warmup lines (they fill the
  completion memory) and the next ``measure`` are measured: every measured call reuses a tool
  set that the warmup saw, with a request the memory has not seen;
- within each phase one tool set's requests come one after another (one agent's traffic), so
  consecutive calls share their system prompt, as in a deployed agent.

With ``one_agent`` the chosen tool sets' tools all belong to one agent instead: every system
prompt lists all of them (14 tools, prompts of ~4,000 SmolLM2 tokens with the defaults), every
reply's grammar allows a call of any of them, and all lines share one scope. An agent holding
many tools is the common deployed case, and long prompts are where a wide draft costs most.

Each line is one LLM call: a system prompt listing the tools as JSON schemas and asking for a
JSON list of calls, then the request's own messages, and (``choice``, default ``"required"``)
the grammar of that reply: a JSON list of calls of the tool set's tools with arguments valid
under their schemas, as an agent framework asks with ``tool_choice="required"``. The selection is by frequency and size
only, fixed before any drafter ran on it. No model runs to build it: the file is a pure
function of the BFCL data (``agentspec bench build-bfcl-live``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentspec.bench.workload import WorkloadItem, package_data

CATEGORY_FILE = "BFCL_v4_live_multiple.json"
TOOL_SETS = 6
WARMUP = 10  # per tool set: 60 warmup calls
MEASURE = 4  # per tool set: 24 measured calls
# Docs of about 4,300 characters are ~1,150 SmolLM2 tokens: with the instructions and the
# request the prompt stays near the ~1,500 tokens a 2-core CPU handles per call.
MAX_DOC_CHARS = 4300
MAX_NEW_TOKENS = 96

INSTRUCTIONS = """\
You are an assistant that answers the user's request by calling one of these tools.

Tools, as JSON schemas:
{tools}

Reply with only a JSON list of calls, like [{example}]"""


def data_file() -> Path:
    """BFCL's ``live_multiple`` file in the installed ``bfcl-eval`` package.

    Raises:
        FileNotFoundError: ``bfcl-eval`` is not installed (the message says how to install it).
    """
    return package_data("bfcl_eval", "bfcl-eval==2026.3.23", CATEGORY_FILE)


def load_entries(path: Path | None = None) -> list[dict[str, Any]]:
    """The category's entries, in file order (one JSON object per line)."""
    path = path or data_file()
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def tool_set_key(entry: Mapping[str, Any]) -> str:
    """Identical tool docs give identical keys (the docs as canonical JSON)."""
    return json.dumps(entry["function"], sort_keys=True, ensure_ascii=False)


def system_prompt(functions: Sequence[Mapping[str, Any]]) -> str:
    """The agent's system prompt for one tool set; the example call names its first tool."""
    example = json.dumps({"name": functions[0]["name"], "arguments": {}})
    return INSTRUCTIONS.format(
        tools="\n".join(json.dumps(f, ensure_ascii=False) for f in functions), example=example)


ONE_AGENT_SCOPE = "bfcl-live-agent"


def _messages(entry: Mapping[str, Any], functions: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """System prompt for ``functions``, then the request's first turn (a system message of its
    own is kept as a second paragraph of ours)."""
    system = system_prompt(functions)
    turn = [m for m in entry["question"][0] if str(m.get("content", "")).strip()]
    own = [m["content"] for m in turn if m["role"] == "system"]
    if own:
        system += "\n\n" + "\n".join(own)
    rest = [{"role": m["role"], "content": m["content"]} for m in turn if m["role"] != "system"]
    return [{"role": "system", "content": system}, *rest]


def reply_grammar(functions: Sequence[Mapping[str, Any]], choice: str = "required") -> dict[str, Any]:
    """The grammar spec of the reply: a JSON list of calls of ``functions`` (BFCL's parameter
    schemas in standard JSON Schema); ``choice="auto"`` also allows plain text."""
    from agentspec.bench.bfcl import json_schema_of

    tools = [{"name": f["name"], "parameters": json_schema_of(f.get("parameters") or {})}
             for f in functions]
    return {"type": "tool_calls", "tools": tools, "choice": choice, "as_list": True}


def _scope(functions: Sequence[Mapping[str, Any]]) -> str:
    return "bfcl-live-" + "+".join(str(f["name"]) for f in functions)


def build_workload(entries: Sequence[Mapping[str, Any]], *, tool_sets: int = TOOL_SETS,
                   warmup: int = WARMUP, measure: int = MEASURE,
                   max_doc_chars: int = MAX_DOC_CHARS,
                   max_new_tokens: int = MAX_NEW_TOKENS,
                   choice: str | None = "required", rest: bool = False,
                   skip: int = 0, one_agent: bool = False) -> list[WorkloadItem]:
    """The workload lines: all warmup lines, then the measured ones; within each phase the
    requests of one tool set come together, as consecutive requests to one deployed agent.
    ``rest``: instead, the chosen tool sets' other requests (after their warmup and measured
    ones, as warmup lines): more of the same agents' traffic, e.g. to train a draft head on.
    ``choice``: each line's reply grammar (:func:`reply_grammar`: ``"required"`` or ``"auto"``),
    or None for unconstrained replies. ``skip``: leave out the ``skip`` most frequent tool sets
    that qualify (``skip=6``: held-out tool sets, none of them in the shipped ``bfcl-live``).
    ``one_agent``: the same requests sent to one agent holding every chosen tool set's tools
    (each tool once, by name, in the order the tool sets were chosen): one system prompt, one
    grammar, one scope (:data:`ONE_AGENT_SCOPE`).

    Raises:
        ValueError: a count is not positive, ``choice`` is unknown, or fewer than
            ``tool_sets`` tool sets qualify.
    """
    if choice not in ("required", "auto", None):
        raise ValueError(f"choice must be 'required', 'auto' or None, got {choice!r}")
    for name, value in (("tool_sets", tool_sets), ("warmup", warmup), ("measure", measure),
                        ("max_doc_chars", max_doc_chars), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    by_set: dict[str, list[Mapping[str, Any]]] = {}
    for entry in entries:
        if any(m["role"] == "user" for m in entry["question"][0]):
            by_set.setdefault(tool_set_key(entry), []).append(entry)
    counts = Counter({k: len(v) for k, v in by_set.items()
                      if len(v) >= warmup + measure and len(k) <= max_doc_chars})
    chosen = [k for k, _ in counts.most_common(skip + tool_sets)][skip:]  # ties: first seen first
    if len(chosen) < tool_sets:
        raise ValueError(f"only {len(chosen)} tool sets have {warmup + measure} requests and "
                         f"docs of at most {max_doc_chars} characters (after skipping {skip}); "
                         f"asked for {tool_sets}")
    union: list[Mapping[str, Any]] = []
    if one_agent:
        names: set[str] = set()
        for key in chosen:
            for function in by_set[key][0]["function"]:
                if function["name"] not in names:
                    names.add(function["name"])
                    union.append(function)
    items: list[WorkloadItem] = []
    phases = [("warmup", 0, warmup), ("measure", warmup, warmup + measure)]
    if rest:
        phases = [("warmup", warmup + measure, max(len(v) for v in by_set.values()))]
    for phase, lo, hi in phases:
        for key in chosen:
            for i in range(lo, min(hi, len(by_set[key]))):
                entry = by_set[key][i]
                functions = union or entry["function"]  # the tools the request is sent with
                grammar = None if choice is None else reply_grammar(functions, choice)
                items.append(WorkloadItem(id=str(entry["id"]),
                                          scope=ONE_AGENT_SCOPE if one_agent else _scope(functions),
                                          phase=phase, messages=tuple(_messages(entry, functions)),
                                          max_new_tokens=max_new_tokens, grammar=grammar))
    return items
