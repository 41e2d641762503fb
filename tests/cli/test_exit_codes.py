"""Every command follows the README's exit-code table: 0 done, 1 failed, 2 bad input, 3 not found.

The walk finds every command of the ``agentspec`` tree (the bench's own app included, mounted
as a pass-through command) and checks what every command must do alike: ``-h`` and ``--help``
exit 0 with the usage on stdout, an unknown option exits 2. The table below then checks the
cases that name a thing: a missing record, scope, database, model or workload exits 3, a
database that cannot be reached 1, a bad value 2, each with one line on stderr. A command
that answers an unknown option with another code is caught by the same walk (the control at
the end).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from agentspec.cli import app
from agentspec.cli.bench import bench_app
from agentspec.cli.common import APP_SETTINGS


def walk(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command path under ``command`` (a click command or group), groups included."""
    yield path
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from walk(sub, (*path, name))


def every_command() -> list[tuple[str, ...]]:
    paths = [p for p in walk(typer.main.get_command(app)) if p]
    bench = [("bench", *p) for p in walk(typer.main.get_command(bench_app)) if p]
    return sorted(set(paths + bench))


def violations(target: typer.Typer, path: tuple[str, ...]) -> list[str]:
    """How the command at ``path`` breaks the shared rules (an empty list: none)."""
    found = []
    runner = CliRunner()
    for flag in ("-h", "--help"):
        res = runner.invoke(target, [*path, flag])
        if res.exit_code != 0 or "Usage:" not in res.stdout:
            found.append(f"{' '.join(path)} {flag}: exit {res.exit_code}")
    res = runner.invoke(target, [*path, "--no-such-option"])
    if res.exit_code != 2:
        found.append(f"{' '.join(path)} --no-such-option: exit {res.exit_code}, not 2")
    return found


def test_the_walk_sees_every_command() -> None:
    names = {" ".join(p) for p in every_command()}
    assert {"cache", "cache stats", "cache show", "cache export", "head", "head train",
            "generate", "demo", "bench", "bench build-bfcl"} <= names


@pytest.mark.parametrize("path", every_command(), ids=" ".join)
def test_help_exits_0_and_an_unknown_option_2(path: tuple[str, ...]) -> None:
    target = app
    if path[0] == "bench":  # the pass-through command: its own app answers
        target, path = bench_app, path[1:]
    if not path:
        res = CliRunner().invoke(app, ["bench", "--no-such-option"])
        assert res.exit_code == 2, res.output
        return
    assert violations(target, path) == []


@pytest.fixture
def db(tmp_path: Path) -> str:
    """A memory database holding one record (scope ``a``, model ``m``)."""
    from agentspec.stores import SQLStore
    from agentspec.types import Record

    url = f"sqlite:///{tmp_path / 'memory.db'}"
    with SQLStore(url) as store:
        store.add_many([Record(scope="a", model="m", request_text="q", key_text="q",
                               completion_text="a", completion_ids=(1, 2))])
    return url


NOT_FOUND = [
    ("cache", "show", "999"),
    ("cache", "rm", "999", "--yes"),
    ("cache", "drop-scope", "no-such-scope", "--yes"),
    ("cache", "relabel", "no-such-model", "m2", "--yes"),
    ("generate", "hi", "--model", "/no/such/model/folder"),
    ("bench", "--workload", "/no/such/workload.jsonl"),
]
BAD_INPUT = [
    ("cache", "ls", "--sort", "sideways"),
    ("cache", "stats", "--db", "not a url"),
    ("cache", "import", "/no/such/file.jsonl"),
    ("generate", "hi", "--max-new-tokens", "0"),
    ("bench", "--systems", "warp-drive"),
    ("demo", "--max-new-tokens", "0"),
]


@pytest.mark.parametrize("args", NOT_FOUND, ids=" ".join)
def test_a_missing_thing_exits_3(db: str, args: tuple[str, ...]) -> None:
    res = CliRunner().invoke(app, ["--db", db, *args])
    assert res.exit_code == 3, res.output
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr


@pytest.mark.parametrize("args", BAD_INPUT, ids=" ".join)
def test_bad_input_exits_2(db: str, args: tuple[str, ...]) -> None:
    res = CliRunner().invoke(app, ["--db", db, *args])
    assert res.exit_code == 2, res.output
    assert "error" in res.stderr.lower(), res.stderr


def test_a_missing_database_exits_3_and_an_unreachable_one_1(tmp_path: Path) -> None:
    missing = f"sqlite:///{tmp_path / 'nothing-here.db'}"
    res = CliRunner().invoke(app, ["cache", "show", "1", "--db", missing])
    assert res.exit_code == 3 and "no memory database" in res.stderr, res.output
    unreachable = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    res = CliRunner().invoke(app, ["cache", "stats", "--db", unreachable])
    assert res.exit_code == 1 and "cannot open" in res.stderr, res.output


def test_a_fresh_home_lists_nothing_and_exits_0(tmp_path: Path) -> None:
    """Read commands on a home where nothing was recorded: empty answers and a hint."""
    for args in (("cache", "stats"), ("cache", "ls"), ("cache", "search", "weather"),
                 ("head", "stats")):
        res = CliRunner().invoke(app, [*args, "--json"])
        assert res.exit_code == 0, (args, res.output)


def test_the_walk_catches_a_command_that_breaks_the_table() -> None:
    """The control: a command that swallows unknown options and exits 1 is reported."""
    wrong = typer.Typer(**APP_SETTINGS)

    @wrong.command("lenient", context_settings={"ignore_unknown_options": True,
                                                "allow_extra_args": True})
    def lenient(ctx: typer.Context) -> None:
        if ctx.args:
            raise typer.Exit(1)

    @wrong.command("other")
    def other() -> None:
        pass

    assert violations(wrong, ("lenient",)) == ["lenient --no-such-option: exit 1, not 2"]
    assert violations(wrong, ("other",)) == []
