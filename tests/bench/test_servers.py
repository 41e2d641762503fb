"""The servers bench (``agentspec bench --against``) against stub OpenAI servers.

Each stub (``tests/bench/stub_openai.py``) is a real HTTP server in its own process, started
and stopped by the bench as it starts llama-server and agentspec serve. The checks: the levels
and rows, the warmup (agentspec's restart with recording off, warmed twice), the invariance
accounting (a stub whose answers depend on the load, the deliberately wrong server, is caught;
a pure one is not), agreement between servers, tokens per step as each server reports it, the
tools mode's valid-call share, and a server that dies mid-pass (named, with its exit code; the
others' figures kept). The real llama.cpp run is a command (BENCHMARKS.md), not a test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agentspec.bench import llama_cpp, servers
from agentspec.bench.servers import Launch
from agentspec.bench.servers_report import rich_table, summarize, to_markdown, valid_call
from agentspec.bench.workload import Workload, WorkloadItem
from agentspec.errors import NotFoundError

STUB = str(Path(__file__).with_name("stub_openai.py"))
TOOLS = ({"name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                                "properties": {"city": {"type": "string"}}}},)


def _item(i: int, phase: str) -> WorkloadItem:
    return WorkloadItem(id=f"{phase}-{i}", phase=phase, max_new_tokens=16,
                        messages=({"role": "system", "content": "tools"},
                                  {"role": "user", "content": "q" * (3 + i)}),
                        grammar={"type": "tool_calls", "tools": list(TOOLS), "choice": "required"})


WORKLOAD = Workload(Path("stub.jsonl"),
                    tuple([_item(i, "warmup") for i in range(3)] +
                          [_item(i, "measure") for i in range(6)]), ())


def _stub(name: str, record: Path, *flags: str, measure_flag: str | None = None) -> Launch:
    base = (sys.executable, STUB, "--port", "{port}", "--record", str(record), *flags)
    measure = None if measure_flag is None else (*base, "--tag", measure_flag)
    return Launch(name, (*base, "--tag", "first"), measure, start_seconds=30)


def _sent(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def _run(tmp_path: Path, launches: list[Launch], levels=(1, 4), tools=False) -> dict:
    return servers.run_against(WORKLOAD, "stub", [s.name for s in launches], list(levels),
                               tools=tools, workdir=tmp_path, launches=launches)


def test_levels_warmup_and_invariance(tmp_path: Path) -> None:
    record = tmp_path / "sent.jsonl"
    launches = [_stub("agentspec", record, "--steps", "agentspec", measure_flag="measured"),
                _stub("llama.cpp", record, "--steps", "llama"),
                _stub("by-load", record, "--by-load")]
    summary = _run(tmp_path, launches, levels=(4, 2))
    rows = {(r["system"], r["concurrency"]): r for r in summary["rows"]}
    assert sorted(rows) == sorted((s, c) for s in ("agentspec", "llama.cpp", "by-load")
                                  for c in (1, 2, 4))
    assert all(r["requests"] == 6 and r["tokens_per_second"] > 0 for r in rows.values())
    # The pure servers answer alike at every level; the load-dependent one does not (control).
    assert all(rows[("agentspec", c)]["same_as_level_1"] == 1.0 for c in (1, 2, 4))
    assert all(rows[("llama.cpp", c)]["same_as_level_1"] == 1.0 for c in (1, 2, 4))
    assert rows[("by-load", 4)]["same_as_level_1"] < 1.0
    assert summary["agreement_at_1"]["agentspec = llama.cpp"] == 1.0
    assert summary["agreement_at_1"]["agentspec = by-load"] == 0.0
    # Steps as each server says them; none where the server says nothing.
    assert rows[("agentspec", 1)]["tokens_per_step"] > 1.0
    assert rows[("llama.cpp", 1)]["tokens_per_step"] > 1.0
    assert rows[("by-load", 1)]["tokens_per_step"] is None
    assert summary["versus_llama_cpp"]["1"]["agentspec"] > 0
    # Warmup: agentspec warmed, restarted with its measure command, warmed again; the others
    # warmed once; every warmup line before any measured one, greedy, its own budget.
    sent = _sent(record)
    ids = [(s["tag"], s["body"]["messages"][-1]["content"]) for s in sent]
    warm = [_item(i, "warmup").messages[-1]["content"] for i in range(3)]
    assert [c for t, c in ids if t == "first"][:3] == warm
    assert [c for t, c in ids if t == "measured"][:3] == warm
    # agentspec's first start only warms; the two other stubs warm and take three levels.
    assert sum(t == "first" for t, _ in ids) == 3 + 2 * (3 + 3 * 6)
    assert sum(t == "measured" for t, _ in ids) == 3 + 3 * 6
    assert all(s["body"]["temperature"] == 0 and s["body"]["max_tokens"] == 16 for s in sent)
    assert not any("tools" in s["body"] for s in sent)
    assert summary["failed"] == {}
    assert "agentspec" in to_markdown(summary) and rich_table(summary).row_count == 9


def test_a_server_that_dies_mid_pass_is_named_and_the_others_kept(tmp_path: Path) -> None:
    record = tmp_path / "sent.jsonl"
    launches = [_stub("agentspec", record), _stub("llama.cpp", record, "--die-after", "8")]
    summary = _run(tmp_path, launches, levels=(1, 4))
    assert "exited with code 7" in summary["failed"]["llama.cpp"]
    assert "at level" in summary["failed"]["llama.cpp"]
    assert {(r["system"], r["concurrency"]) for r in summary["rows"]} == {
        ("agentspec", 1), ("agentspec", 4)}


def test_a_server_that_does_not_start_is_named(tmp_path: Path) -> None:
    record = tmp_path / "sent.jsonl"
    launches = [_stub("agentspec", record), _stub("llama.cpp", record, "--fail-start")]
    summary = _run(tmp_path, launches, levels=(1,))
    assert "did not start" in summary["failed"]["llama.cpp"]
    assert "told to fail at start" in summary["failed"]["llama.cpp"]
    assert [r["system"] for r in summary["rows"]] == ["agentspec"]


def test_tools_mode_sends_tools_and_counts_valid_calls(tmp_path: Path) -> None:
    record = tmp_path / "sent.jsonl"
    launches = [_stub("agentspec", record, "--calls"), _stub("llama.cpp", record)]
    summary = _run(tmp_path, launches, levels=(1,), tools=True)
    rows = {r["system"]: r for r in summary["rows"]}
    # The stub calls on even-length requests: 3 of the 6 measured lines (lengths 3..8).
    assert rows["agentspec"]["valid_calls"] == 0.5
    assert rows["llama.cpp"]["valid_calls"] == 0.0
    body = _sent(record)[0]["body"]
    assert body["tool_choice"] == "required"
    assert body["tools"] == [{"type": "function", "function": TOOLS[0]}]


def test_valid_call() -> None:
    ok = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert valid_call(ok, TOOLS)
    assert not valid_call([], TOOLS)
    assert not valid_call([{"name": "other", "arguments": '{"city": "Paris"}'}], TOOLS)
    assert not valid_call([{"name": "get_weather", "arguments": "{}"}], TOOLS)  # required
    assert not valid_call([{"name": "get_weather", "arguments": '{"city": 1'}], TOOLS)
    assert not valid_call([{"name": "get_weather",
                            "arguments": '{"city": "P", "zip": 1}'}], TOOLS)


def test_summary_of_no_passes_is_empty() -> None:
    out = summarize([], {"llama.cpp": "gone"}, [], tools=False)
    assert out["rows"] == [] and out["failed"] == {"llama.cpp": "gone"}


def test_raw_prompt_lines_are_refused_before_any_server_starts(tmp_path: Path) -> None:
    raw = Workload(Path("raw.jsonl"), (WorkloadItem(id="r", prompt="def f():"),), ())
    with pytest.raises(ValueError, match="raw prompt"):
        servers.run_against(raw, "stub", ["agentspec"], [1], workdir=tmp_path,
                            launches=[_stub("agentspec", tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_llama_cpp_build_needs_its_tools(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert llama_cpp.missing_tools(lambda name: None) == [
        "cmake", "a C compiler (cc, gcc or clang)", "a C++ compiler (c++, g++ or clang++)"]
    assert llama_cpp.missing_tools(lambda name: "/usr/bin/" + name) == []
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(llama_cpp, "missing_tools", lambda: ["cmake"])
    with pytest.raises(llama_cpp.BuildError, match="needs cmake.*apt-get install cmake"):
        llama_cpp.build()
    with pytest.raises(NotFoundError, match="make llama-cpp"):
        llama_cpp.binary("llama-server")


def test_launch_commands(tmp_path: Path) -> None:
    from agentspec.bench.servers import Setup

    setup = Setup(model="m", gguf=tmp_path / "m.gguf", threads=2, context=2048, slots=8,
                  workdir=tmp_path, agentspec=("agentspec",),
                  llama_server=tmp_path / "llama-server")
    a = servers.launch("agentspec", setup)
    assert a.measure_command is not None and a.measure_command[-1] == "--no-record"
    assert "--no-record" not in a.command and ("OMP_NUM_THREADS", "2") in a.env
    assert servers.launch("agentspec-plain", setup).command[-1] == "--no-speculate"
    ll = servers.launch("llama.cpp-ngram-mod", setup).command
    assert ll[ll.index("-c") + 1] == str(2048 * 8) and ll[ll.index("-t") + 1] == "2"
    assert ll[-2:] == ("--spec-type", "ngram-mod") and "--jinja" in ll
    with pytest.raises(NotFoundError, match="make test-vllm"):
        servers.launch("vllm", setup)
    with pytest.raises(ValueError, match="unknown system 'x'"):
        servers.launch("x", setup)


@pytest.mark.parametrize(("args", "named"), [
    (["--against", "llama.cpp,warp-drive"], "'llama.cpp,warp-drive'"),
    (["--against", "agentspec"], "'agentspec'"),
    (["--against", "llama.cpp", "--concurrency", "0"], "'0'"),
    (["--against", "llama.cpp", "--max-new-tokens", "0"], "got 0"),
    (["--tools"], "--tools goes with --against"),
])
def test_bad_input_exits_2_naming_the_value(args: list[str], named: str) -> None:
    from typer.testing import CliRunner

    from agentspec.cli import app

    res = CliRunner().invoke(app, ["bench", *args])
    assert res.exit_code == 2, res.output
    assert named in res.stderr and res.stderr.count("\n") == 1


@pytest.mark.parametrize("name", ["bfcl-live", "bfcl", "humaneval"])
def test_the_three_workloads_make_chat_requests(name: str) -> None:
    """Every line of the shipped workloads and of HumanEval's becomes a chat request (bfcl's
    tool results included, as role "tool"); bfcl-live's also with its tools bound."""
    loaded = servers.load_served_workload(name, 64)
    assert loaded.warmup and loaded.measure
    bodies = [servers.request_body(i, tools=False) for i in loaded.items]
    assert all(b["messages"] and b["temperature"] == 0 for b in bodies)
    if name == "bfcl":
        results = [m for b in bodies for m in b["messages"] if m["role"] == "tool"]
        assert results and all(isinstance(m["tool_call_id"], str) for m in results)
    if name == "bfcl-live":
        assert all(servers.request_body(i, tools=True)["tools"] for i in loaded.items)
