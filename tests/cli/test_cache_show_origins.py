"""``agentspec cache show ID``: the completion by where each token came from, in colour on a
terminal (each source's colour, every other step underlined, a legend with counts) and as
``[source]`` tags with ``|`` between steps in a pipe or with ``--no-color``."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from agentspec.cli import cache as cache_cli
from agentspec.cli.origins import COLORS, plain, styled
from agentspec.stores import SQLStore
from agentspec.types import Origins, Record
from tests.cli.conftest import Invoke, make_invoke

TEXT = "Paris is the capital of France."
# Three steps: the memory's "Paris is the" then the target's " capital"; prompt lookup's
# " of" then the target's " France"; the target's "." alone.
ORIGINS = Origins(("memory", "memory", "memory", "target", "prompt_lookup", "target", "target"),
                  (4, 2, 1), (12, 20, 23, 30, 31))
RUNS = [(0, "memory", "Paris is the"), (0, "target", " capital"), (1, "prompt_lookup", " of"),
        (1, "target", " France"), (2, "target", ".")]


@pytest.fixture
def show(empty_url: str) -> Invoke:
    with SQLStore(empty_url) as store:
        for origins in (ORIGINS, None):
            store.add(Record(scope="s", model="m", request_text="capital of France?",
                             key_text=f"k{origins is None}", completion_text=TEXT,
                             completion_ids=tuple(range(7)), origins=origins))
    return make_invoke(empty_url)


def parse_plain(line: str) -> list[tuple[int, str, str]]:
    """The runs a plain line shows: ``[source]text`` runs, ``|`` between steps."""
    out = []
    for step, part in enumerate(line.split("|")):
        out += [(step, m[1], m[2]) for m in re.finditer(r"\[([a-z_]+)\]([^[]*)", part)]
    return out


def test_a_pipe_gets_tags_steps_and_counts(show: Invoke) -> None:
    for args in ((), ("--no-color",)):
        res = show("cache", "show", "1", *args)
        assert res.exit_code == 0, res.output
        lines = res.stdout.splitlines()
        by_origin = lines[lines.index(next(ln for ln in lines if "completion by origin" in ln)) + 1]
        assert parse_plain(by_origin) == RUNS
        assert "memory 3   prompt_lookup 1   target (the model itself) 3   in 3 steps" in res.stdout
        assert "\x1b[" not in res.stdout


def test_parse_plain_sees_a_wrong_step() -> None:
    """The check above has teeth: origins one step off show other runs."""
    shifted = Origins(ORIGINS.sources, (3, 3, 1), (12, 20, 23, 30, 31))
    assert parse_plain(plain(TEXT, shifted)) != RUNS


def test_a_terminal_gets_colours_and_underlined_steps(show: Invoke, monkeypatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(cache_cli, "console", Console(file=out, force_terminal=True,
                                                      color_system="standard", width=200))
    res = show("cache", "show", "1")
    assert res.exit_code == 0, res.output
    shown = out.getvalue()
    assert "\x1b[32mParis is the" in shown  # green: the memory
    assert "\x1b[4;34m of" in shown  # blue: prompt lookup, underlined: the second step
    assert re.sub(r"\x1b\[[0-9;]*m", "", shown).count(TEXT) == 2  # the plain and the coloured
    text = styled(TEXT, ORIGINS)
    assert text.plain == TEXT
    for span in text.spans:  # each character's colour is its token's source's
        step, source, piece = next(r for r in RUNS if TEXT.find(r[2]) == span.start)
        assert TEXT[span.start:span.end] == piece
        assert (span.style.color.name if span.style.color else None) == COLORS.get(source)
        assert span.style.underline == (step % 2 == 1)


def test_json_and_a_record_without_origins(show: Invoke) -> None:
    res = show("cache", "show", "1", "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)["origins"]
    assert got["counts"] == {"memory": 3, "prompt_lookup": 1, "target": 3}
    assert got["steps"] == [4, 2, 1]
    assert [(r["step"], r["source"], r["text"]) for r in got["runs"]] == RUNS
    bare = show("cache", "show", "2")
    assert bare.exit_code == 0 and "no origins kept for this record" in bare.stdout
    assert json.loads(show("cache", "show", "2", "--json").stdout)["origins"] is None


def test_export_and_import_keep_origins(tmp_path) -> None:
    from agentspec.cli.cache_io import from_line, to_line

    with SQLStore(f"sqlite:///{tmp_path / 'src.db'}") as store:
        rid = store.add(Record(scope="s", model="m", request_text="r", key_text="k",
                               completion_text=TEXT, completion_ids=tuple(range(7)),
                               origins=ORIGINS))[0]
        line = to_line(store.get(rid))
    assert json.loads(line)["origins"] == json.loads(ORIGINS.as_json())
    assert from_line(line).origins == ORIGINS
    obj = json.loads(line)
    obj["origins"]["runs"][0][2] = 9  # nine tokens of seven
    with pytest.raises(ValueError, match="origins name 13 tokens for 7 completion ids"):
        from_line(json.dumps(obj))
    obj["origins"] = "no"
    with pytest.raises(ValueError, match="not the JSON of token origins"):
        from_line(json.dumps(obj))
