"""The JSON Lines workload format: good lines, each kind of bad line, round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentspec.bench.workload import WorkloadItem, load_workload, write_workload

SYSTEM = {"role": "system", "content": "You call tools."}
USER = {"role": "user", "content": "List the files."}


def _write(path: Path, lines: list[object]) -> Path:
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    path.write_text(text, encoding="utf-8")
    return path


def test_good_lines_with_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path / "w.jsonl", [
        {"id": "a", "scope": "bfcl-fs", "phase": "warmup", "messages": [SYSTEM, USER],
         "max_new_tokens": 16},
        "",
        {"id": "b", "prompt": "Once upon a time"},
        {"id": "c", "messages": [USER, {"role": "assistant", "content": "[]"},
                                 {"role": "tool", "content": "ok"}]},
    ])
    w = load_workload(path, default_max_new_tokens=64)
    assert w.errors == ()
    assert [i.id for i in w.items] == ["a", "b", "c"]
    a, b, c = w.items
    assert (a.scope, a.phase, a.max_new_tokens, a.line) == ("bfcl-fs", "warmup", 16, 1)
    assert a.messages == (SYSTEM, USER) and a.prompt is None
    assert (b.scope, b.phase, b.max_new_tokens, b.line) == ("default", "measure", 64, 3)
    assert b.prompt == "Once upon a time" and b.messages is None
    assert c.messages is not None and c.messages[-1]["role"] == "tool"
    assert [i.id for i in w.warmup] == ["a"] and [i.id for i in w.measure] == ["b", "c"]


BAD_LINES = [
    ("{not json", "not valid JSON"),
    ('["a list"]', "JSON object"),
    ({"scope": "s", "prompt": "p"}, "missing field 'id'"),
    ({"id": "", "prompt": "p"}, "id must be"),
    ({"id": 7, "prompt": "p"}, "id must be"),
    ({"id": "x1", "prompt": "p", "max_tokens": 5}, "unknown fields ['max_tokens']"),
    ({"id": "x2"}, "exactly one of messages and prompt"),
    ({"id": "x3", "prompt": "p", "messages": [USER]}, "exactly one of messages and prompt"),
    ({"id": "x4", "prompt": ""}, "prompt must be"),
    ({"id": "x5", "prompt": "p", "phase": "train"}, "'train'"),
    ({"id": "x6", "prompt": "p", "scope": ""}, "scope must be"),
    ({"id": "x7", "messages": []}, "non-empty list"),
    ({"id": "x8", "messages": "hi"}, "non-empty list"),
    ({"id": "x9", "messages": ["hi"]}, "messages[0] must be an object"),
    ({"id": "x10", "messages": [{"role": "robot", "content": "hi"}]}, "'robot'"),
    ({"id": "x11", "messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
    ({"id": "x12", "messages": [USER, {"role": "user", "content": 3}]}, "messages[1].content"),
    ({"id": "x13", "messages": [{"role": "user", "content": "a", "name": "n"}]}, "['name']"),
    ({"id": "x14", "prompt": "p", "max_new_tokens": 0}, "got 0"),
    ({"id": "x15", "prompt": "p", "max_new_tokens": 2.5}, "got 2.5"),
    ({"id": "x16", "prompt": "p", "max_new_tokens": True}, "got True"),
    ({"id": "good", "prompt": "again"}, "duplicate id 'good' (first on line 1)"),
]


def test_bad_lines_are_reported_with_their_line_number_and_good_ones_kept(
    tmp_path: Path,
) -> None:
    lines: list[object] = [{"id": "good", "prompt": "p"}]
    lines += [bad for bad, _ in BAD_LINES]
    lines.append({"id": "last", "prompt": "q"})
    w = load_workload(_write(tmp_path / "w.jsonl", lines), default_max_new_tokens=8)
    assert [(i.id, i.line) for i in w.items] == [("good", 1), ("last", len(lines))]
    assert [n for n, _ in w.errors] == list(range(2, 2 + len(BAD_LINES)))
    for (number, message), (_, expected) in zip(w.errors, BAD_LINES, strict=True):
        assert expected in message, (number, message)


def test_empty_file_raises_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty.jsonl"):
        load_workload(path, default_max_new_tokens=8)


def test_file_without_a_valid_measure_line_raises(tmp_path: Path) -> None:
    path = _write(tmp_path / "warm.jsonl", [
        {"id": "a", "phase": "warmup", "prompt": "p"},
        {"id": "b", "phase": "measure", "prompt": ""},
    ])
    with pytest.raises(ValueError, match=r"warm\.jsonl.*no valid 'measure' line"):
        load_workload(path, default_max_new_tokens=8)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_workload(tmp_path / "nope.jsonl", default_max_new_tokens=8)


def test_default_max_new_tokens_must_be_positive(tmp_path: Path) -> None:
    path = _write(tmp_path / "w.jsonl", [{"id": "a", "prompt": "p"}])
    with pytest.raises(ValueError, match="got 0"):
        load_workload(path, default_max_new_tokens=0)


def test_round_trip(tmp_path: Path) -> None:
    items = [
        WorkloadItem("t0-c0", scope="bfcl-fs", phase="warmup",
                     messages=[SYSTEM, USER], max_new_tokens=32),
        WorkloadItem("t1-c0", prompt="déjà vu\n{\"json\": true}"),
        WorkloadItem("t1-c1", scope="bfcl-fs",
                     messages=[USER, {"role": "tool", "content": "ok"}]),
    ]
    path = tmp_path / "sub" / "w.jsonl"
    assert write_workload(path, items) == 3
    w = load_workload(path, default_max_new_tokens=128)
    assert w.errors == ()
    expected = [(i.id, i.scope, i.phase, i.messages, i.prompt, i.max_new_tokens or 128, n)
                for n, i in enumerate(items, start=1)]
    got = [(i.id, i.scope, i.phase, i.messages, i.prompt, i.max_new_tokens, i.line)
           for i in w.items]
    assert got == expected


def test_items_validate_on_construction_and_writer_refuses_duplicates(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'robot'"):
        WorkloadItem("a", messages=[{"role": "robot", "content": "x"}])
    messages = [dict(USER)]
    item = WorkloadItem("a", messages=messages)
    messages[0]["content"] = "changed"
    assert item.messages == (USER,)
    with pytest.raises(ValueError, match="duplicate workload id 'a'"):
        write_workload(tmp_path / "w.jsonl", [item, item])


def test_in_turn_takes_one_item_of_each_scope_in_turn() -> None:
    from agentspec.bench.workload import in_turn

    items = [WorkloadItem(id=f"{s}{i}", prompt="p", scope=s) for s, i in
             (("a", 0), ("a", 1), ("b", 0), ("a", 2), ("c", 0), ("b", 1))]
    assert [i.id for i in in_turn(items)] == ["a0", "b0", "c0", "a1", "b1", "a2"]


def test_package_data_says_what_is_missing() -> None:
    from agentspec.bench.workload import package_data

    with pytest.raises(FileNotFoundError, match=r"no-such-data is not installed: pip install --no-deps no-such-data==1\.0"):
        package_data("agentspec_no_such_data", "no-such-data==1.0", "x.json")
    with pytest.raises(FileNotFoundError, match="nothing.json not found in agentspec"):
        package_data("agentspec", "agentspec==0", "nothing.json")
