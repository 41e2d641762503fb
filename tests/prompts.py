"""The bench's bundled prompts and shipped workloads, read as data (no bench code imported).

``agentspec/bench/data/prompts.jsonl`` holds the prompts of :mod:`agentspec.bench.prompts` in
order (``grounded-*`` then ``open-*``): core tests read them here, so that they never import
the bench. tests/bench/test_prompts_data.py checks both say the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import agentspec

DATA = Path(agentspec.__file__).parent / "bench" / "data"


def workload_lines(path: Path, phase: str = "measure") -> list[dict[str, Any]]:
    """A JSON Lines workload's lines of ``phase``, in file order, as plain dicts."""
    with path.open(encoding="utf-8") as f:
        lines = [json.loads(text) for text in f if text.strip()]
    return [line for line in lines if line.get("phase", "measure") == phase]


def prompt_of(line: dict[str, Any]) -> Any:
    """A workload line's chat messages (fresh dicts) or raw prompt, as a Speculator takes it."""
    return [dict(m) for m in line["messages"]] if "messages" in line else line["prompt"]


_LINES = workload_lines(DATA / "prompts.jsonl")

# Half input-grounded (the answer copies from the prompt), half open-ended.
ALL_PROMPTS: list[Any] = [prompt_of(line) for line in _LINES]
GROUNDED: list[Any] = [prompt_of(line) for line in _LINES if line["id"].startswith("grounded-")]
# The code and the JSON record the grounded prompts quote.
CODE: str = GROUNDED[0][-1]["content"].split("\n\n", 1)[1]
RECORD: str = GROUNDED[3][-1]["content"].split("\n", 1)[1]
