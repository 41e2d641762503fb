"""The replay's lines: a workload's lines with the target's greedy outputs, generated once
and kept in a file (the ``--outputs`` file of ``python -m agentspec.bench.replay``, the
``--lines`` file of ``agentspec bench``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentspec.config import SamplingParams


@dataclass(frozen=True)
class Line:
    """One workload line with the target's greedy output (cut before its stop token)."""

    id: str
    phase: str
    scope: str
    prompt_ids: tuple[int, ...]
    key_text: str
    output_ids: tuple[int, ...]
    output_text: str
    max_new_tokens: int
    grammar: Mapping[str, Any] | None = None

    @property
    def stopped(self) -> bool:
        return len(self.output_ids) < self.max_new_tokens


def generate_lines(workload_path: Path, model: str, default_max_new_tokens: int) -> list[Line]:
    """The target's greedy output of every line (the engine's greedy output is plain decoding's)."""
    from rich.progress import track

    from agentspec import Speculator
    from agentspec.bench.results import prompt_of
    from agentspec.bench.workload import load_workload
    from agentspec.grammar import compiled
    from agentspec.text import conversation_key

    workload = load_workload(workload_path, default_max_new_tokens=default_max_new_tokens)
    spec = Speculator.from_pretrained(model, memory=None)
    lines = []
    for item in track(workload.items, description="greedy outputs"):
        prompt = prompt_of(item)
        budget = item.max_new_tokens or default_max_new_tokens
        sampling = SamplingParams(grammar=None if item.grammar is None else compiled(item.grammar))
        gen = spec.generate(prompt, budget, sampling=sampling)
        lines.append(Line(item.id, item.phase, item.scope, tuple(spec.encode(prompt)),
                          conversation_key(prompt), gen.token_ids, gen.text, budget,
                          item.grammar))
    return lines


def save_lines(lines: Sequence[Line], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([line.__dict__ for line in lines]) + "\n", encoding="utf-8")


def load_lines(path: Path) -> list[Line]:
    rows = json.loads(path.read_text(encoding="utf-8"))
    return [Line(r["id"], r["phase"], r["scope"], tuple(r["prompt_ids"]), r["key_text"],
                 tuple(r["output_ids"]), r["output_text"], int(r["max_new_tokens"]),
                 r.get("grammar"))
            for r in rows]
