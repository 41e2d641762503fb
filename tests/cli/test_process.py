"""The CLI as a process: torch stays unimported for cache commands; generate, demo, bench."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentspec.cli import app
from agentspec.types import Generation, GenerationStats

# Runs the CLI in this interpreter, then reports which heavy modules got imported.
_WRAPPER = """
import json, sys
from agentspec.cli import app
try:
    app(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "transformers", "sentence_transformers") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _run(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AGENTSPEC_HOME": str(home)}
    env.pop("AGENTSPEC_DB", None)
    return subprocess.run([sys.executable, "-c", _WRAPPER, *args], capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.mark.parametrize("args", [["cache", "stats"], ["cache", "ls"], ["cache", "show", "1"],
                                  ["cache", "export", "-"], ["cache", "prune", "--older-than",
                                                             "1w", "--dry-run"]])
def test_cache_commands_leave_torch_unimported(url: str, home: Path, args: list[str]) -> None:
    proc = _run(["--db", url, *args], home)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report == {"code": 0, "heavy": []}, proc.stderr


def test_console_script(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("agentspec")
    if not exe.exists():
        pytest.skip("no agentspec console script: .venv/bin/pip install -q --no-deps -e .")
    env = {**os.environ, "AGENTSPEC_HOME": str(tmp_path)}
    env.pop("AGENTSPEC_DB", None)
    ok = subprocess.run([str(exe), "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0 and "cache" in ok.stdout
    fresh = subprocess.run([str(exe), "cache", "stats"], capture_output=True, text=True,
                           env=env, timeout=60)
    assert fresh.returncode == 0 and "0 rows" in fresh.stdout  # a fresh home: zeros, a hint
    listed = subprocess.run([str(exe), "cache", "ls"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert listed.returncode == 0 and listed.stderr.startswith("nothing recorded yet")
    missing = subprocess.run([str(exe), "cache", "show", "1"], capture_output=True, text=True,
                             env=env, timeout=60)
    assert missing.returncode == 3 and "Traceback" not in missing.stderr
    assert missing.stderr.startswith("error: no memory database at")
    bad = subprocess.run([str(exe), "cache", "ls", "--limit", "many"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


# Without the bench (a build that leaves agentspec.bench out: hidden here from the import
# system), demo and bench fail with one line naming what is missing. With it, their options:
# tests/bench/test_demo.py (demo --help, bad input exits 2 before loading) and below.
_NO_BENCH = ("agentspec.bench", "agentspec.bench.demo", "agentspec.bench.cli", "agentspec.cli.bench")


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_without_the_bench_demo_and_bench_fail_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                        command: str) -> None:
    for name in _NO_BENCH:
        monkeypatch.setitem(sys.modules, name, None)
    res = CliRunner().invoke(app, [command])
    assert res.exit_code == 1, res.output
    assert "agentspec.bench" in res.stderr and "is not installed in this build" in res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.output


def test_bench_help() -> None:
    res = CliRunner().invoke(app, ["bench", "--help"])
    assert res.exit_code == 0, res.output
    assert "agentspec bench" in res.output


def test_generate_bad_input() -> None:
    assert CliRunner().invoke(app, ["generate", "hi", "--max-new-tokens", "0"]).exit_code == 2
    assert CliRunner().invoke(app, ["generate", "hi", "--temperature", "-1"]).exit_code == 2


class _SlowToStart:
    """A speculator whose load and warmup take time and whose generation takes none."""

    def __init__(self, events: list[str]) -> None:
        time.sleep(0.3)
        self.events = events
        self.target = self

    def warmup(self) -> None:
        time.sleep(0.2)
        self.events.append("warmup")

    def generate(self, request: object, max_new_tokens: int, **kw: object) -> Generation:
        self.events.append("generate")
        return Generation("hello", (1, 2, 3, 4),
                          GenerationStats(steps=2, new_tokens=4, prompt_tokens=5, seconds=0.01,
                                          drafted={"memory": 3}, accepted={"memory": 2}),
                          "length")


def test_generate_reports_load_and_warmup_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading and calibrating used to count as generation ("8 tokens in 46.59 s")."""
    events: list[str] = []
    monkeypatch.setattr("agentspec.cli.load_speculator", lambda model, url: _SlowToStart(events))
    res = CliRunner().invoke(app, ["generate", "hi", "--no-stream"])
    assert res.exit_code == 0, res.output
    assert events == ["warmup", "generate"]  # calibrated before the call
    setup, summary = res.stderr.strip().splitlines()[-2:]
    load, warm = (float(x) for x in re.findall(r"(?:load|warmup) (\d+\.\d+) s", setup))
    assert load >= 0.3 and warm >= 0.2
    assert summary.startswith("4 tokens in 0.01 s (400.0 tok/s), 2 steps")
    assert res.stdout == "hello\n"


def test_generate_json_is_one_json_value_on_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--json`` before ``generate`` used to be ignored silently."""
    events: list[str] = []
    monkeypatch.setattr("agentspec.cli.load_speculator", lambda model, url: _SlowToStart(events))
    res = CliRunner().invoke(app, ["--json", "generate", "hi"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["text"] == "hello" and out["token_ids"] == [1, 2, 3, 4]
    assert out["stats"]["steps"] == 2 and out["stats"]["accepted"] == {"memory": 2}


@pytest.mark.slow
def test_generate_real_model(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentspec.home import model_dir

    monkeypatch.delenv("AGENTSPEC_HOME")  # reuse the converted model under the real home
    if not (model_dir() / "smollm2-135m-instruct").is_dir():
        monkeypatch.setenv("AGENTSPEC_HOME", str(home))
    for extra in ([], ["--no-stream"]):
        res = CliRunner().invoke(app, ["generate", "What is 2 + 2?", "--max-new-tokens", "8",
                                       *extra])
        assert res.exit_code == 0, res.output
        assert res.stdout.strip()
        setup, summary = res.stderr.strip().splitlines()[-2:]
        assert " tokens in " in summary and "tok/s" in summary and "accepted" in summary
        assert re.match(r"load \d+\.\d+ s, warmup \d+\.\d+ s", setup), setup


def test_generate_grammar_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--json-schema/--tools/--regex become the call's grammar; bad ones exit 2, named."""
    seen: list[object] = []

    class _Spec(_SlowToStart):
        def __init__(self) -> None:
            self.events, self.target = [], self

        def warmup(self) -> None:
            pass

        def generate(self, request: object, max_new_tokens: int, **kw: object) -> Generation:
            seen.append(getattr(kw["sampling"], "grammar", None))
            return super().generate(request, max_new_tokens, **kw)

    monkeypatch.setattr("agentspec.cli.load_speculator", lambda model, url: _Spec())
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    tools = tmp_path / "tools.json"
    tools.write_text('[{"name": "add", "parameters": {"type": "object", "properties": {}}}]')
    for args, kind in ((["--json-schema", str(schema)], "json_schema"),
                       (["--tools", str(tools)], "tool_calls"), (["--regex", "[0-9]+"], "regex")):
        res = CliRunner().invoke(app, ["generate", "hi", "--no-stream", *args])
        assert res.exit_code == 0, res.output
        assert getattr(seen[-1], "kind", None) == kind
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for args, message in ((["--json-schema", str(bad)], "is not JSON"),
                          (["--json-schema", str(tmp_path / "none.json")], "cannot read"),
                          (["--tools", str(schema)], "must hold a JSON list"),
                          (["--regex", "(["], "does not compile"),
                          (["--regex", "a", "--json-schema", str(schema)], "at most one")):
        res = CliRunner().invoke(app, ["generate", "hi", *args])
        assert res.exit_code == 2 and message in res.output, (args, res.output)
