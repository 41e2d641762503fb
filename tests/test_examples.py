"""Run the examples at their own budgets (each loads the packaged model once).

quickstart and langchain_agent run at their defaults (the model load dominates either way).
bfcl_agent runs one turn of one task at 32 new tokens, the task whose agent calls a tool: its
other default task would double the time and check nothing more (that agent answers in text).
Each test checks what its example prints against what the example promises, and a control
shows each checker refusing a wrong output (the langchain agent's old "12 * 7 = 80").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
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


def _check_quickstart(out: str) -> None:
    """The generation's stats, a streamed body, and the session's second call drafting from
    the first: fewer steps for the same (asserted by the example) text."""
    stats = re.search(r"^\[(\d+) tokens in (\d+) steps, [\d.]+ tokens/step, accepted by source "
                      r"\{.*\}, finish: (stop|length)\]$", out, re.M)
    assert stats and int(stats[1]) > 0 and out[:stats.start()].strip(), out
    assert re.search(r"^    \S", out[stats.end():], re.M), out  # the stream: an indented body
    session = re.search(r"^\[session task-1: 2 calls, .*; second call (\d+) steps vs (\d+)\]$",
                        out, re.M)
    assert session and int(session[1]) < int(session[2]), out


@pytest.mark.slow
def test_quickstart(tmp_path: Path) -> None:
    _check_quickstart(_run("quickstart.py", db_dir=tmp_path))


def _check_langchain_agent(out: str) -> None:
    """The agent calls ``multiply`` with the question's numbers, the tool returns 84, and the
    answer is that result; the forced tool step is said."""
    assert "the tool step is forced (tool_choice='multiply')" in out, out
    assert re.search(r"^\[model calls: 1, \d+ tokens in \d+ steps", out, re.M), out
    assert re.search(r"^ +human: 'What is 12 times 7\?'$", out, re.M), out
    assert re.search(r"^ +ai: .* tool_calls: multiply\(a=12, b=7\)$", out, re.M), out
    assert re.search(r"^ +tool: multiply -> '84'$", out, re.M), out
    assert re.search(r"^answer: 84$", out, re.M), out


@pytest.mark.slow
def test_langchain_agent(tmp_path: Path) -> None:
    _check_langchain_agent(_run("langchain_agent.py", db_dir=tmp_path))


_LANGCHAIN_OUT = """\
[the tool step is forced (tool_choice='multiply'): the packaged 135M model does not ...]
[model calls: 1, 22 tokens in 7 steps, accepted by source {'grammar': 15}]
 human: 'What is 12 times 7?'
    ai: '' tool_calls: multiply(a=12, b=7)
  tool: multiply -> '84'
answer: 84
"""
_QUICKSTART_OUT = """\
Here are three uses of Python:
[48 tokens in 46 steps, 1.04 tokens/step, accepted by source {'prompt_lookup': 2}, finish: length]

    if n == 0:
        return 1
[session task-1: 2 calls, 96 tokens in 42 steps, accepted {'memory': 46}; second call 2 steps vs 40]
"""


@pytest.mark.parametrize(("check", "good", "bad"), [
    # the example before the tool step was forced: no call, a wrong answer in text
    (_check_langchain_agent, _LANGCHAIN_OUT,
     "[1 model calls, 9 tokens in 8 steps, accepted by source {'prompt_lookup': 2}]\n"
     " human: 'What is 12 times 7? Use the multiply tool.'\n    ai: '12 * 7 = 80'\n"),
    (_check_langchain_agent, _LANGCHAIN_OUT, _LANGCHAIN_OUT.replace("b=7", "b=8")),
    (_check_langchain_agent, _LANGCHAIN_OUT, _LANGCHAIN_OUT.replace("answer: 84", "answer: 80")),
    (_check_quickstart, _QUICKSTART_OUT, _QUICKSTART_OUT.replace("2 steps vs", "40 steps vs")),
    (_check_quickstart, _QUICKSTART_OUT, _QUICKSTART_OUT.split("\n", 1)[1]),  # no text
])
def test_the_output_checks_refuse_a_wrong_output(check: Callable[[str], None], good: str,
                                                 bad: str) -> None:
    """The controls: each checker passes the output its example prints and refuses one that
    misses what the example promises (no model load)."""
    check(good)
    with pytest.raises(AssertionError):
        check(bad)


def _check_bfcl_agent(out: str) -> None:
    assert "warm pass" in out and "memory warm:" in out
    exact = re.search(r"exact match: (\d+)/(\d+) calls", out)
    assert exact and exact[1] == exact[2] and int(exact[1]) >= 4, out[-2000:]
    assert re.search(r"^\s+cat\(file_name='[^']+'\) -> ", out, re.M), out[-4000:]
    assert "tool calls through the grammar: 0 malformed" in out and "malformed tool call" not in out


@pytest.mark.slow
@pytest.mark.long  # make test's time: the run at the example's own budget below, long too
def test_bfcl_agent(tmp_path: Path) -> None:
    """The agent's tool calls go through the grammar: on this task's first turn, the call it
    makes (``cat``) parses and runs, cold and warm, and no reply is a malformed call. The task
    is named by its bare number, as the example's docstring does (``--tasks 26``)."""
    _check_bfcl_agent(_run("bfcl_agent.py", "--tasks", "12", "--max-turns", "1",
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
