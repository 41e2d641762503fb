"""``agentspec demo``: bad input fails fast; tool calls are read as the agent reads them; a
tiny real run is exact, calls its tools through the grammar and the warm pass drafts from
memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from agentspec.bench.demo import (
    CallResult,
    DemoConfig,
    Reporter,
    reply_calls,
    summarize,
    task_ids,
)
from agentspec.cli import app
from agentspec.text import cut_at_stop


def test_bad_input_exits_2_before_loading() -> None:
    for args in (["--tasks", "multi_turn_base_9999"], ["--max-new-tokens", "0"],
                 ["--max-calls-per-turn", "0"]):
        res = CliRunner().invoke(app, ["demo", *args])
        assert res.exit_code == 2, (args, res.output)
        assert "error:" in res.stderr.lower()  # ours, or click's for an out-of-range option


def test_help_is_the_demo_options() -> None:
    res = CliRunner().invoke(app, ["demo", "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage: agentspec demo" in res.output
    for option in ("--tasks", "--max-new-tokens", "--max-calls-per-turn", "--db", "--json", "--out",
                   "--no-grammar"):
        assert option in res.output


def test_task_ids_and_cut() -> None:
    assert task_ids("26, multi_turn_base_12,") == ("multi_turn_base_26", "multi_turn_base_12")
    assert cut_at_stop([5, 6, 2, 7], frozenset({2}))[0] == (5, 6)
    assert cut_at_stop([5, 6], frozenset({2}))[0] == (5, 6)


def test_summarize_speedups() -> None:
    def call(pass_name: str, plain_s: float, spec_s: float, exact: bool = True) -> CallResult:
        return CallResult(pass_name, "t", 0, 0, 10, plain_s, spec_s, 5, {"memory": 4}, exact)

    rows = [call("cold", 1.0, 1.0), call("warm", 2.0, 1.0), call("warm", 4.0, 1.0, False)]
    rows.append(CallResult("warm", "t", 0, 1, 10, 1.0, 1.0, 5, {}, True, malformed=2))
    s = summarize(rows, DemoConfig(("t",)), seconds=1.0, load_seconds=0.5)
    warm = s["passes"]["warm"]
    assert warm["total_speedup"] == pytest.approx(7 / 3) and warm["median_speedup"] == 2.0
    assert warm["tokens_per_step"] == 2.0 and warm["accepted_by_source"] == {"memory": 8}
    assert s["exact_match"] == {"matched": 3, "calls": 4, "rate": pytest.approx(3 / 4)}
    assert s["malformed_calls"] == warm["malformed_calls"] == 2 and s["grammar"] is True


FENCED = 'Here it is:\n```json\n{"name": "ls", "arguments": {\n```'


def test_calls_are_read_as_the_agent_reads_them() -> None:
    """Under the grammar a reply is a call list exactly when it starts with '[': a fenced
    snippet in an answer is an answer, not a malformed call; free text tries to parse it."""
    call = '[{"name": "cd", "arguments": {"folder": "docs"}}]'
    assert [c.name for c in reply_calls(call, constrained=True)[0]] == ["cd"]
    assert reply_calls(FENCED, constrained=True) == ([], [])
    calls, errors = reply_calls(FENCED, constrained=False)
    assert calls == [] and errors and "malformed tool call" in errors[0]
    assert reply_calls('[{"name": "cd", "argu', constrained=True)[1]  # cut by the budget


@pytest.mark.parametrize("constrained", [True, False])
def test_the_live_output_shows_malformed_calls_only_where_the_agent_saw_them(
        constrained: bool) -> None:
    console = Console(record=True, width=200)
    Reporter(console, constrained=constrained).call(
        CallResult("cold", "t", 0, 0, 10, 1.0, 1.0, 5, {}, True), FENCED)
    out = console.export_text()
    assert ("malformed tool call" in out) is not constrained
    assert ("answer: Here it is:" in out) is constrained


@pytest.mark.slow
def test_demo_tiny_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # the output is not a terminal: as wide as needed
    out = tmp_path / "demo.json"
    res = CliRunner().invoke(app, ["demo", "--tasks", "multi_turn_base_26", "--max-turns", "1",
                                   "--max-calls-per-turn", "1", "--max-new-tokens", "16",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "cold pass" in res.stdout and "warm pass" in res.stdout
    assert "median speedup" in res.stdout  # the table's headers whole (80 columns cut them)
    assert "tool calls through the grammar:" in res.stdout
    summary = json.loads(out.read_text())
    assert summary["grammar"] is True
    assert summary["exact_match"]["rate"] == 1.0 and summary["exact_match"]["calls"] == 2
    cold, warm = summary["passes"]["cold"], summary["passes"]["warm"]
    for p in (cold, warm):
        assert {"plain_tokens_per_second", "agentspec_tokens_per_second", "median_speedup",
                "total_speedup", "tokens_per_step", "accepted_by_source"} <= set(p)
    assert cold["accepted_by_source"].get("memory", 0) == 0  # the memory starts empty
    assert warm["accepted_by_source"].get("memory", 0) > 0
