"""Run the examples at their own budgets (each loads the packaged model once).

quickstart and langchain_agent run at their defaults (the model load dominates either way).
bfcl_agent runs its default budgets on one task, the one whose agent calls a tool: its other
default task would double the time and check nothing more (that agent answers in text).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


def _run(script: str, *args: str, db_dir: Path) -> str:
    # The examples use the default memory; point it at a scratch file, not the user's.
    env = {**os.environ, "AGENTSPEC_DB": f"sqlite:///{db_dir / 'memory.db'}"}
    env.pop("COLUMNS", None)  # the output is a pipe: tables as wide as they need
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_quickstart(tmp_path: Path) -> None:
    out = _run("quickstart.py", db_dir=tmp_path)
    assert "tokens/step" in out and "[session task-1: 2 calls" in out


@pytest.mark.slow
def test_langchain_agent(tmp_path: Path) -> None:
    out = _run("langchain_agent.py", db_dir=tmp_path)
    assert "model calls" in out and "human: 'What is 12 times 7?" in out


def _check_bfcl_agent(out: str) -> None:
    assert "warm pass" in out and "memory warm:" in out
    exact = re.search(r"exact match: (\d+)/(\d+) calls", out)
    assert exact and exact[1] == exact[2] and int(exact[1]) >= 4, out[-2000:]
    assert re.search(r"^\s+cat\(file_name='[^']+'\) -> ", out, re.M), out[-4000:]
    assert "tool calls through the grammar: 0 malformed" in out and "malformed tool call" not in out


@pytest.mark.slow
def test_bfcl_agent(tmp_path: Path) -> None:
    """The agent's tool calls go through the grammar: on this task's first turn, the call it
    makes (``cat``) parses and runs, cold and warm, and no reply is a malformed call."""
    _check_bfcl_agent(_run("bfcl_agent.py", "--tasks", "multi_turn_base_12", "--max-turns", "1",
                           "--max-new-tokens", "32", db_dir=tmp_path))


@pytest.mark.long  # the same checks at the example's own budget, every turn (make test-long)
def test_bfcl_agent_at_its_own_budget(tmp_path: Path) -> None:
    _check_bfcl_agent(_run("bfcl_agent.py", "--tasks", "multi_turn_base_12", db_dir=tmp_path))


def _code(line: str) -> str:
    """A line of Python without its comment and indentation."""
    return line.split("  #")[0].strip()


def test_the_readme_quickstart_is_the_example() -> None:
    """Every line of the README's quickstart block is a line of examples/quickstart.py (the
    script `make test-install` runs), so the two cannot drift apart; a line the example lacks
    (the control) is caught."""
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    example = {_code(line) for line in (EXAMPLES / "quickstart.py").read_text().splitlines()}
    lines = [_code(line) for line in block.splitlines() if _code(line)]
    assert len(lines) >= 8
    drifted = "gen = spec.generate(messages, max_new_tokens=999)"  # the control
    assert [line for line in [*lines, drifted] if line not in example] == [drifted]
