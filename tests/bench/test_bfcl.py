"""The BFCL agent on real BFCL tasks and tools, with a scripted model (the ``generate`` seam).

The real model is too slow for a unit test; a script of completions stands in for it, and
everything else (task data, tool docs, BFCL's tool implementations) is real.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest

pytest.importorskip("bfcl_eval")

from agentspec.bench import bfcl  # noqa: E402
from agentspec.bench.toolcalls import ToolCall, parse_tool_calls  # noqa: E402
from agentspec.bench.workload import load_workload, write_workload  # noqa: E402

FS_TASK, TRADING_TASK = "multi_turn_base_9", "multi_turn_base_100"


def scripted(completions: Iterable[str]):
    """A fake ``generate``: returns the next scripted completion, records what it was sent."""
    script = iter(completions)
    sent: list[list[dict[str, str]]] = []

    def generate(messages: list[dict[str, str]], grammar: object = None) -> str:
        sent.append(messages)
        return next(script, "All done.")

    generate.sent = sent  # type: ignore[attr-defined]
    return generate


def test_tasks_docs_and_prompt_are_real() -> None:
    tasks = bfcl.default_tasks()
    assert [t.id for t in tasks] == bfcl.DEFAULT_TASK_IDS
    fs = bfcl.load_tasks([FS_TASK])[0]
    assert fs.involved_classes == ("GorillaFileSystem",) and len(fs.turns) == 3
    assert bfcl.main_class(fs) == "GorillaFileSystem"
    prompt = bfcl.system_prompt(fs.involved_classes)
    for name in bfcl.DEFAULT_TOOL_SUBSETS["GorillaFileSystem"]:
        assert f'"name": "{name}"' in prompt
    assert '"name": "rmdir"' not in prompt and "Tool description:" not in prompt
    with pytest.raises(KeyError, match="multi_turn_base_999"):
        bfcl.load_tasks(["multi_turn_base_999"])
    with pytest.raises(ValueError, match="'NoSuchAPI'"):
        bfcl.system_prompt(["NoSuchAPI"])


@pytest.mark.parametrize(("completion", "expected"), [
    ('[{"name": "cd", "arguments": {"folder": "document"}}]', [("cd", {"folder": "document"})]),
    ('{"name": "ls", "arguments": {}}', [("ls", {})]),
    ('```json\n[{"name": "cat", "arguments": {"file_name": "a.txt"}}]\n```', [("cat", {"file_name": "a.txt"})]),
    ('<tool_call>{"name": "pwd"}</tool_call>\n<tool_call>{"name": "ls"}</tool_call>', [("pwd", {}), ("ls", {})]),
    ('Sure! [{"function": "mkdir", "parameters": {"dir_name": "x"}}]', [("mkdir", {"dir_name": "x"})]),
    ('{"function": {"name": "touch", "arguments": "{\\"file_name\\": \\"f\\"}"}}', [("touch", {"file_name": "f"})]),
    ("The file is now sorted.", []),
    ("", []),
])
def test_parser_accepts_loose_formats(completion: str, expected: list) -> None:
    calls, errors = parse_tool_calls(completion)
    assert errors == []
    assert calls == [ToolCall(name, args) for name, args in expected]


@pytest.mark.parametrize("completion", [
    '[{"name": "cd", "arguments": {"folder": ',  # cut off at max_new_tokens
    '[{"arguments": {"folder": "x"}}]',           # no name
    '{"name": "cd", "arguments": ["x"]}',         # arguments not an object
    "```json\ncd(folder='x')\n```",                # not JSON
])
def test_parser_reports_malformed_calls(completion: str) -> None:
    calls, errors = parse_tool_calls(completion)
    assert calls == [] and len(errors) == 1 and errors[0].startswith("Error: malformed")


def test_agent_runs_real_tool_calls() -> None:
    task = bfcl.load_tasks([FS_TASK])[0]
    env = bfcl.ToolEnvironment(task)
    generate = scripted([
        '```json\n[{"name": "cd", "arguments": {"folder": "Documentation"}},'
        ' {"name": "mkdir", "arguments": {"dir_name": "agent_dir"}}]\n```',
        '<tool_call>{"name": "touch", "arguments": {"file_name": "agent.txt"}}</tool_call>',
        "I created both.",
        '[{"name": "ls", "arguments": {}}]',
    ])
    traces = bfcl.run_task(task, generate, env=env, max_turns=2, constrain=False)  # the tolerant parser
    # Turn 0 ends on the plain answer; turn 1 makes 1 call, then "All done." ends it.
    assert [(t.turn, t.call) for t in traces] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    documentation = env.instances["GorillaFileSystem"].root.contents["Documentation"]
    assert "agent_dir" in documentation.contents and "agent.txt" in documentation.contents
    assert traces[0].calls[1] == ToolCall("mkdir", {"dir_name": "agent_dir"})
    assert json.loads(traces[0].results[0]) == {"current_working_directory": "Documentation"}
    listing = json.loads(traces[3].results[0])["current_directory_content"]
    assert {"agent_dir", "agent.txt", "FinalReport.txt"} <= set(listing)
    # Each trace holds exactly what the model was sent, including the tool results.
    assert [list(t.messages) for t in traces] == generate.sent
    second = traces[1].messages
    roles = [m["role"] for m in second]
    # system, the class's example dialogue, the task's first turn, then this turn's call.
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant",
                     "user", "assistant", "tool", "tool"]
    assert second[7]["content"] == task.turns[0][0]["content"]
    assert traces[2].results == () and traces[2].calls == ()


def test_bad_model_output_becomes_error_results_not_exceptions() -> None:
    task = bfcl.load_tasks([FS_TASK])[0]
    generate = scripted([
        '[{"name": "cd", "arguments": {"folder": ',
        '[{"name": "rm_rf", "arguments": {}}, {"name": "_load_scenario", "arguments": {}}]',
        '[{"name": "cd", "arguments": {"no_such_param": 1}}]',
    ])
    traces = bfcl.run_task(task, generate, max_turns=1, tool_role="user")
    assert len(traces) == 3
    assert traces[0].errors and traces[0].results == traces[0].errors
    assert traces[0].results[0].startswith("Error: malformed tool call")
    assert traces[1].results == ("Error: no tool named 'rm_rf'",
                                 "Error: no tool named '_load_scenario'")
    assert traces[2].results[0].startswith("Error during execution: TypeError")
    fed_back = traces[1].messages[-1]
    assert fed_back["role"] == "user" and fed_back["content"].startswith("Tool result: Error")


def test_build_workload_splits_by_task(tmp_path: Path) -> None:
    tasks = bfcl.load_tasks([FS_TASK, TRADING_TASK])
    generate = scripted([
        '[{"name": "cd", "arguments": {"folder": "Documentation"}}]', "Done.",
        "Done.", "Done.",
        '[{"name": "get_symbol_by_name", "arguments": {"name": "Nvidia"}}]',
        '[{"name": "get_stock_info", "arguments": {"symbol": "NVDA"}}]', "Done.",
    ])
    items = bfcl.build_workload(tasks, generate, max_new_tokens=64)
    phases = {(i.id.split("-turn")[0], i.phase) for i in items}
    assert phases == {(FS_TASK, "warmup"), (TRADING_TASK, "measure")}
    assert {i.scope for i in items if i.phase == "warmup"} == {"bfcl-GorillaFileSystem"}
    assert {i.scope for i in items if i.phase == "measure"} == {"bfcl-TradingBot"}
    assert items[0].id == f"{FS_TASK}-turn0-call0" and len({i.id for i in items}) == len(items)
    nvda = [i for i in items if i.id == f"{TRADING_TASK}-turn0-call2"][0]
    assert nvda.messages is not None and "220.34" in nvda.messages[-1]["content"]
    path = tmp_path / "bfcl.jsonl"
    write_workload(path, items)
    loaded = load_workload(path, default_max_new_tokens=128)
    assert loaded.errors == () and [i.messages for i in loaded.items] == [i.messages for i in items]
    with pytest.raises(ValueError, match="warmup_fraction"):
        bfcl.build_workload(tasks, generate, warmup_fraction=1.0)


def test_under_the_grammar_only_a_call_list_is_a_call() -> None:
    """Plain text with a code fence is an answer (the grammar's text branch), not a
    malformed call; without the grammar the tolerant parser still reads it as an attempt."""
    task = bfcl.load_tasks([FS_TASK])[0]
    fenced = "Use this:\n```\nrm -r notes\n```"
    for constrain, expected_errors in ((True, 0), (False, 1)):
        traces = bfcl.run_task(task, scripted([fenced]), max_turns=1, constrain=constrain)
        assert len(traces[0].errors) == expected_errors
        assert (traces[0].grammar is not None) == constrain
    summary = bfcl.parse_summary(
        bfcl.run_task(task, scripted(['[{"name": "cd", "arguments": {"folder": "x"}}]', fenced]),
                      max_turns=1), [task])
    assert summary["call_replies"] == 1 and summary["parse_rate"] == 1.0
