"""``python -m agentspec.bench.ab``: settings are read by SpecConfig's own field types, bad
ones are named; a tiny real run compares two settings with the same outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentspec.bench.ab import compare, format_result, main, parse_settings, parse_widths


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
    with pytest.raises(SystemExit) as exit_:
        main(["--a-widths", "2,8,4"])
    assert exit_.value.code == 2 and "smallest first, got '2,8,4'" in capsys.readouterr().err


def test_widths_are_read_and_bad_ones_named():
    assert parse_widths(None) is None and parse_widths("") is None
    assert parse_widths("2,4,6,8") == (2, 4, 6, 8)
    for bad, named in (("2,x", "integers, got '2,x'"), ("0,4", "positive"), ("4,4", "distinct")):
        with pytest.raises(ValueError, match=named):
            parse_widths(bad)


def test_the_report_names_each_sides_widths_where_they_differ():
    result = {"workload": "bfcl-live", "requests": 3, "device": "cpu", "a": {}, "b": {},
              "widths": {"a": [2, 4, 8], "b": [2, 4, 6, 8]},
              "seconds": {"a": 2.0, "b": 1.0}, "tokens_per_second": {"a": 10.0, "b": 20.0},
              "tokens_per_step": {"a": 2.0, "b": 2.5}, "b_over_a": 2.0, "median_b_over_a": 1.9,
              "same_outputs": True}
    text = format_result(result)
    assert "A (the bench's settings; widths 2,4,8): 2.00 s, 10.00 tok/s, 2.00 tok/step" in text
    assert "B (the bench's settings; widths 2,4,6,8)" in text and "2.000x aggregate" in text
    result["widths"]["b"] = [2, 4, 8]
    assert "widths" not in format_result(result)
    result["prefill_widths"] = {"a": [128, 256], "b": [96, 128, 256]}
    assert "A (the bench's settings; prefill widths 128,256)" in format_result(result)


# Its settings, widths and report are tested above, and the runner it drives (harness.run_requests)
# on the real model by test_harness and test_cli in `make test`;
# this runs the whole command on the real model.
@pytest.mark.slow
@pytest.mark.long
def test_two_settings_side_by_side_on_a_real_model(tmp_path: Path):
    # Side A also on other forward widths: another engine, the same outputs.
    result = compare("prompts", {}, {"write_behind": False}, measure=2, device="cpu",
                     widths={"a": (2, 4, 8, 16, 32, 64)})
    assert result["requests"] == 2 and result["same_outputs"] is True
    assert result["b_over_a"] > 0 and result["median_b_over_a"] > 0
    text = format_result(result)
    assert "write_behind=False" in text and "same outputs: yes" in text and "tok/step" in text
    assert result["widths"]["a"] == [2, 4, 8, 16, 32, 64] != result["widths"]["b"]
    assert "widths 2,4,8,16,32,64)" in text
    assert result["prefill_widths"]["a"] == result["prefill_widths"]["b"]
    json.dumps(result)
