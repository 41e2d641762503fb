"""``python -m agentspec.bench.ab``: settings are read by SpecConfig's own field types, bad
ones are named; a tiny real run compares two settings with the same outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentspec.bench.ab import compare, format_result, main, parse_settings


def test_settings_take_each_fields_type():
    assert parse_settings("") == {}
    assert parse_settings("write_behind=false, prefetch_key=none,max_draft_tokens=8") == {
        "write_behind": False, "prefetch_key": None, "max_draft_tokens": 8}
    assert parse_settings("prefetch_key=on,trees=0") == {"prefetch_key": True, "trees": False}


@pytest.mark.parametrize(("text", "named"), [
    ("nope=1", "no field 'nope'"), ("write_behind", "field=value"),
    ("write_behind=maybe", "write_behind='maybe'"), ("max_draft_tokens=x", "max_draft_tokens='x'"),
    ("trees=none", "trees='none'"),  # a flag that may not be None
])
def test_a_bad_setting_is_named(text, named):
    with pytest.raises(ValueError, match=named):
        parse_settings(text)


def test_the_command_line_rejects_a_bad_setting_before_loading_a_model(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--b", "write_behind=maybe"])
    assert exit_.value.code == 2 and "write_behind='maybe'" in capsys.readouterr().err


@pytest.mark.slow
def test_two_settings_side_by_side_on_a_real_model(tmp_path: Path):
    result = compare("prompts", {}, {"write_behind": False}, measure=2, device="cpu")
    assert result["requests"] == 2 and result["same_outputs"] is True
    assert result["b_over_a"] > 0 and result["median_b_over_a"] > 0
    text = format_result(result)
    assert "write_behind=False" in text and "same outputs: yes" in text
    json.dumps(result)
