"""The single-turn BFCL workload (``bfcl-live``): real requests over recurring tool sets."""

from pathlib import Path

import pytest

from agentspec.bench import bfcl_live
from agentspec.bench.workload import load_workload, resolve_workload, write_workload


def _entry(i: int, tools: str, question: str = "do it") -> dict:
    return {"id": f"live_multiple_{i}", "function": [{"name": tools, "parameters": {}}],
            "question": [[{"role": "user", "content": f"{question} {i}"}]]}


def test_split_reuses_tool_sets_and_keeps_file_order() -> None:
    entries = [_entry(i, "a" if i % 3 else "b") for i in range(30)]
    items = bfcl_live.build_workload(entries, tool_sets=2, warmup=3, measure=2)
    warm = [i for i in items if i.phase == "warmup"]
    measure = [i for i in items if i.phase == "measure"]
    assert len(warm) == 6 and len(measure) == 4 and list(items[:6]) == warm
    assert {i.scope for i in measure} == {i.scope for i in warm} == {"bfcl-live-a", "bfcl-live-b"}
    # per tool set: its first requests warm up, the next are measured
    a = [int(i.id.rsplit("_", 1)[1]) for i in items if i.scope == "bfcl-live-a"]
    assert a == [1, 2, 4, 5, 7]
    assert [i.scope for i in measure] == ["bfcl-live-a"] * 2 + ["bfcl-live-b"] * 2
    assert items[0].messages[0]["role"] == "system" and '"name": "a"' in items[0].messages[0]["content"]
    assert items[0].messages[-1] == {"role": "user", "content": "do it 1"}


def test_too_few_or_too_large_tool_sets_are_refused() -> None:
    entries = [_entry(i, "a") for i in range(5)]
    with pytest.raises(ValueError, match="only 0 tool sets"):
        bfcl_live.build_workload(entries, tool_sets=1, warmup=4, measure=2)
    with pytest.raises(ValueError, match="only 0 tool sets"):
        bfcl_live.build_workload(entries, tool_sets=1, warmup=2, measure=2, max_doc_chars=10)
    with pytest.raises(ValueError, match="measure"):
        bfcl_live.build_workload(entries, measure=0)


def test_the_shipped_file_is_what_the_builder_makes_from_bfcl(tmp_path: Path) -> None:
    pytest.importorskip("bfcl_eval")
    built = tmp_path / "live.jsonl"
    write_workload(built, bfcl_live.build_workload(bfcl_live.load_entries()))
    shipped = resolve_workload("bfcl-live")
    assert built.read_bytes() == shipped.read_bytes()
    workload = load_workload(shipped, default_max_new_tokens=1)
    assert not workload.errors
    assert (len(workload.warmup), len(workload.measure)) == (60, 24)
    assert {i.scope for i in workload.measure} <= {i.scope for i in workload.warmup}


def test_each_line_carries_its_tool_sets_call_grammar() -> None:
    entries = [_entry(i, "a") for i in range(5)]
    entries[0]["function"][0]["parameters"] = {"type": "dict", "properties": {"x": {"type": "float"}}}
    for e in entries[1:]:
        e["function"] = entries[0]["function"]
    items = bfcl_live.build_workload(entries, tool_sets=1, warmup=3, measure=2)
    grammar = items[0].grammar
    assert grammar == {"type": "tool_calls", "choice": "required", "as_list": True,
                       "tools": [{"name": "a", "parameters": {
                           "type": "object", "properties": {"x": {"type": "number"}}}}]}
    assert all(i.grammar == grammar for i in items)
    from agentspec.grammar import Grammar
    assert Grammar.from_spec(grammar).tools == ("a",)  # BFCL's "dict"/"float" compile
    bare = bfcl_live.build_workload(entries, tool_sets=1, warmup=3, measure=2, choice=None)
    assert all(i.grammar is None for i in bare)
    with pytest.raises(ValueError, match="choice"):
        bfcl_live.build_workload(entries, tool_sets=1, warmup=3, measure=2, choice="any")


def test_the_rest_of_the_tool_sets_requests_is_disjoint_from_the_workload() -> None:
    entries = bfcl_live.load_entries()
    workload = bfcl_live.build_workload(entries)
    rest = bfcl_live.build_workload(entries, rest=True)
    assert rest and not {i.id for i in rest} & {i.id for i in workload}
    assert {i.scope for i in rest} <= {i.scope for i in workload}
    assert all(i.phase == "warmup" and i.grammar is not None for i in rest)


def test_a_head_corpus_leaves_out_every_variant_of_the_held_out_tasks() -> None:
    from agentspec.bench import head_corpus

    tasks = head_corpus.corpus_tasks("GorillaFileSystem", suites=("base", "miss_param"))
    held = {head_corpus.task_number(t) for t in head_corpus.HELD_OUT}
    assert held and not held & {head_corpus.task_number(t.id) for t in tasks}
    assert {t.id.rsplit("_", 1)[0] for t in tasks} == {"multi_turn_base", "multi_turn_miss_param"}
    with pytest.raises(KeyError, match="unknown BFCL suite 'nope'"):
        head_corpus.corpus_tasks("GorillaFileSystem", suites=("nope",))


def test_skip_leaves_out_the_most_frequent_tool_sets_for_a_held_out_workload() -> None:
    entries = [_entry(i, "abc"[i % 3] if i < 27 else "d") for i in range(40)]  # d: 13, a-c: 9
    shipped = bfcl_live.build_workload(entries, tool_sets=1, warmup=4, measure=2)
    held_out = bfcl_live.build_workload(entries, tool_sets=3, warmup=4, measure=2, skip=1)
    assert {i.scope for i in shipped} == {"bfcl-live-d"}
    assert {i.scope for i in held_out} == {"bfcl-live-a", "bfcl-live-b", "bfcl-live-c"}
    with pytest.raises(ValueError, match="after skipping 2"):
        bfcl_live.build_workload(entries, tool_sets=3, warmup=4, measure=2, skip=2)
    with pytest.raises(ValueError, match="skip must be >= 0, got -1"):
        bfcl_live.build_workload(entries, skip=-1)


def test_the_held_out_tool_sets_are_none_of_the_shipped_ones(tmp_path: Path) -> None:
    pytest.importorskip("bfcl_eval")
    held_out = bfcl_live.build_workload(bfcl_live.load_entries(), tool_sets=9, warmup=6,
                                        measure=4, skip=6)
    shipped = load_workload(resolve_workload("bfcl-live"), default_max_new_tokens=1)
    assert len(held_out) == 90
    assert not {i.scope for i in held_out} & {i.scope for i in shipped.items}


def test_one_agent_holds_every_tool_set_and_keeps_the_requests() -> None:
    entries = [_entry(i, "a" if i % 3 else "b") for i in range(30)]
    for entry in entries[::3]:  # the second tool set shares tool "a" with the first
        entry["function"] = entry["function"] + [{"name": "a", "parameters": {}}]
    apart = bfcl_live.build_workload(entries, tool_sets=2, warmup=3, measure=2)
    one = bfcl_live.build_workload(entries, tool_sets=2, warmup=3, measure=2, one_agent=True)
    # The same requests in the same order and phases, now one agent's: one scope, one system
    # prompt listing each tool once, one grammar allowing a call of any of them.
    assert [(i.id, i.phase) for i in one] == [(i.id, i.phase) for i in apart]
    assert [i.messages[1:] for i in one] == [i.messages[1:] for i in apart]
    assert {i.scope for i in one} == {bfcl_live.ONE_AGENT_SCOPE}
    system = {i.messages[0]["content"] for i in one}
    assert len(system) == 1
    assert system.pop().count('"name": "a"') == 1 + 1  # listed once, and named by the example
    assert {tuple(t["name"] for t in i.grammar["tools"]) for i in one} == {("a", "b")}
    plain = bfcl_live.build_workload(entries, tool_sets=2, warmup=3, measure=2, one_agent=True,
                                     choice=None)
    assert all(i.grammar is None for i in plain)
