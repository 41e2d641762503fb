"""The load bench (``agentspec bench --concurrency``) and its oracle drafter.

The oracle is the bound the issue's blocked figures are argued with, so its two properties are
tested: it drafts exactly the known continuation (and nothing where the request left it), and
in a real pass every system's output still equals the solo plain run's while the oracle
commits far more tokens a step than plain decoding (plain decoding's own rows show the step
check's other side: one token a step).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentspec.bench.load import OracleDrafter, run_load
from agentspec.bench.workload import Workload, WorkloadItem
from agentspec.protocols import DraftContext


def _context(prompt: list[int], done: list[int]) -> DraftContext:
    return DraftContext(tokens=[*prompt, *done], prompt_len=len(prompt))


def test_oracle_drafts_the_known_continuation_only():
    oracle = OracleDrafter()
    oracle.outputs[(1, 2, 3)] = (7, 8, 9, 10)
    assert oracle.propose(_context([1, 2, 3], []), max_tokens=2).token_ids == (7, 8)
    draft = oracle.propose(_context([1, 2, 3], [7, 8]), max_tokens=8)
    assert draft.token_ids == (9, 10) and draft.is_chain and draft.source == "oracle"
    assert oracle.propose(_context([1, 2, 3], [7, 5]), max_tokens=8).num_nodes == 0  # diverged
    assert oracle.propose(_context([1, 2], []), max_tokens=8).num_nodes == 0  # unknown prompt
    assert oracle.propose(_context([1, 2, 3], [7, 8, 9, 10]), max_tokens=8).num_nodes == 0
    assert oracle.propose(_context([1, 2, 3], []), max_tokens=0).num_nodes == 0


def _workload() -> Workload:
    items = tuple(
        WorkloadItem(id=f"m{i}", prompt=f"List the first {n} primes, comma-separated:",
                     max_new_tokens=12)
        for i, n in enumerate((3, 5)))
    return Workload(Path("tiny.jsonl"), items, ())


@pytest.mark.timeout(300)
def test_oracle_pass_is_exact_and_commits_many_tokens_a_step():
    summary = run_load(_workload(), "smollm2-135m-instruct",
                       systems=("agentspec-plain", "agentspec-oracle"), concurrencies=(2,))
    rows = {(r["system"], r["concurrency"]): r for r in summary["rows"]}
    assert set(rows) == {(s, c) for s in ("agentspec-plain", "agentspec-oracle") for c in (1, 2)}
    assert all(r["exact"] == 1.0 for r in rows.values())
    for level in (1, 2):
        assert rows["agentspec-plain", level]["tokens_per_step"] <= 1.0
        assert rows["agentspec-oracle", level]["tokens_per_step"] >= 3.0

