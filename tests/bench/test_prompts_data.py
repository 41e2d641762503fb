"""The core tests' prompts (tests/prompts.py reads the shipped prompts.jsonl) are the bench's
bundled prompts, in order; and the shipped workloads read as plain JSON as the bench reads them."""

from __future__ import annotations

from agentspec.bench import prompts
from agentspec.bench.workload import load_workload
from tests import prompts as data


def test_the_tests_prompts_are_the_bench_prompts() -> None:
    assert data.ALL_PROMPTS == prompts.ALL_PROMPTS
    assert data.GROUNDED == prompts.GROUNDED
    assert (data.CODE, data.RECORD) == (prompts._CODE, prompts._RECORD)


def test_workload_lines_are_the_workloads_measured_items() -> None:
    for name in ("prompts", "bfcl-live"):
        path = data.DATA / f"{name}.jsonl"
        items = load_workload(path, default_max_new_tokens=8)
        assert not items.errors
        lines = data.workload_lines(path)
        assert [line["id"] for line in lines] == [item.id for item in items.measure]
        assert [line["scope"] for line in lines] == [item.scope for item in items.measure]
        assert [data.prompt_of(line) for line in lines] == [
            [dict(m) for m in i.messages] if i.messages is not None else i.prompt
            for i in items.measure]
