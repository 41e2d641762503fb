"""The GPU check's runner: each step under its own timeout, results written after every step,
a slow or failing step never stopping the next (fake steps on the CPU; the real ones need a
GPU and are only built here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from agentspec.bench.gpu_check import BENCH_SYSTEMS, STEPS, Step, main, run_steps, steps_for
from agentspec.cli.bench import SYSTEMS

BENCH_JSON = {"systems": {"hf-greedy": {"tokens_per_second": 10.0, "speedup": 1.0},
                          "hf-static": {"tokens_per_second": 20.0, "speedup": 2.0},
                          "agentspec": {"tokens_per_second": 60.0, "speedup": 6.0,
                                        "median_speedup": 5.5, "tokens_per_step": 6.4}},
              "exact_match": {"agentspec": 1.0}, "same_as_plain": {"agentspec": 1.0},
              "versus": {"over_best_single_source": 1.1}}


def _py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_a_slow_or_failing_step_leaves_the_others_results(tmp_path: Path) -> None:
    results = tmp_path / "bench.json"
    steps = [
        Step("bench", _py(f"import json; open({str(results)!r}, 'w').write({json.dumps(json.dumps(BENCH_JSON))})"),
             30, results),
        Step("slow", _py("import time; print('started', flush=True); time.sleep(30)"), 1),
        Step("broken", _py("raise SystemExit(3)"), 30),
        Step("last", _py("print('fine')"), 30),
    ]
    outcomes = run_steps(steps, tmp_path, budget_s=60, report=lambda _: None)
    assert [(o.name, o.status, o.returncode) for o in outcomes] == [
        ("bench", "ok", 0), ("slow", "timed out", None), ("broken", "failed", 3), ("last", "ok", 0)]
    assert outcomes[1].seconds < 10  # killed at its own timeout, not the budget's
    assert (tmp_path / "slow.log").read_text() == "started\n"
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["status"] for s in summary["steps"]] == ["ok", "timed out", "failed", "ok"]
    assert summary["steps"][0]["results"] == BENCH_JSON
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| agentspec | 60.00 | 6.00x | 5.50x | 3.00x | 6.40 | 1.00 | 1.00 |" in md
    assert "| broken | failed (3) |" in md and "| slow | timed out |" in md


def test_the_summary_is_written_after_every_step(tmp_path: Path) -> None:
    """A run killed mid-way (the device's time spent) still leaves what finished."""
    seen: list[list[str]] = []

    def report(_: str) -> None:
        seen.append([s["name"] for s in json.loads((tmp_path / "gpu_check.json").read_text())["steps"]])

    run_steps([Step("a", _py("pass"), 30), Step("b", _py("pass"), 30)], tmp_path, budget_s=60,
              report=report)
    assert seen == [["a"], ["a", "b"]]


def test_steps_past_the_budget_are_skipped_and_the_last_timeout_is_cut(tmp_path: Path) -> None:
    steps = [Step("long", _py("import time; time.sleep(30)"), 600),
             Step("after", _py("pass"), 600)]
    outcomes = run_steps(steps, tmp_path, budget_s=6, report=lambda _: None)
    assert [(o.name, o.status) for o in outcomes] == [("long", "timed out"), ("after", "skipped")]
    assert outcomes[0].seconds < 15


def test_the_real_steps_name_commands_and_systems_that_exist(tmp_path: Path) -> None:
    steps = steps_for(list(STEPS), tmp_path)
    assert [s.name for s in steps] == ["engine", "tests", "load", "bfcl-live", "prompts", "bfcl",
                                       "ops"]
    for step in steps:
        module = step.argv[step.argv.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, module
        assert step.results is None or step.results.parent == tmp_path
    assert "--import-mode=append" in steps[1].argv and steps[1].argv[-1] == "tests/gpu"
    assert set(BENCH_SYSTEMS.split(",")) <= set(SYSTEMS)
    assert sum(timeout for timeout, _ in STEPS.values()) <= 600


def test_an_unknown_step_is_refused_naming_it(tmp_path: Path, capsys) -> None:
    with pytest.raises(ValueError, match="unknown step.s. gpu: expected some of engine, tests"):
        steps_for(["tests", "gpu"], tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path), "--steps", "engine,nope"])
    assert exit_.value.code == 2 and "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path), "--budget-s", "0"])
    assert exit_.value.code == 2 and "--budget-s must be > 0, got 0.0" in capsys.readouterr().err
