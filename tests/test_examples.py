"""Smoke-run the examples with small settings (each loads the packaged model once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


def _run(script: str, *args: str, db_dir: Path) -> str:
    # The examples use the default memory; point it at a scratch file, not the user's.
    env = {**os.environ, "AGENTSPEC_DB": f"sqlite:///{db_dir / 'memory.db'}"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_quickstart(tmp_path: Path) -> None:
    out = _run("quickstart.py", "--max-new-tokens", "8", db_dir=tmp_path)
    assert "tokens/step" in out and "[session task-1: 2 calls" in out


@pytest.mark.slow
def test_langchain_agent(tmp_path: Path) -> None:
    out = _run("langchain_agent.py", "--max-tokens", "16", "--max-iterations", "2", db_dir=tmp_path)
    assert "model calls" in out and "human: 'What is 12 times 7?" in out


@pytest.mark.slow
def test_bfcl_agent(tmp_path: Path) -> None:
    out = _run("bfcl_agent.py", "--tasks", "multi_turn_base_26", "--max-turns", "1",
               "--max-calls-per-turn", "1", "--max-new-tokens", "8", db_dir=tmp_path)
    assert "warm pass" in out and "exact match: 2/2" in out and "memory warm:" in out
