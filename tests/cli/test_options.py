"""``--db`` and ``--json``: before the command, after ``cache``, after every cache subcommand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentspec.cli import app
from agentspec.stores import SQLStore

CACHE_COMMANDS = ("stats", "ls", "show", "search", "rm", "prune", "drop-scope", "export",
                  "import", "reindex", "verify")


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


@pytest.mark.parametrize("command", CACHE_COMMANDS)
def test_every_cache_command_takes_db_and_json_after_it(command: str) -> None:
    res = run("cache", command, "--help")
    assert res.exit_code == 0
    assert re.search(r"--db\s+URL", res.stdout) and "--json" in res.stdout, res.stdout


def test_the_issue_case_db_after_the_subcommand(url: str) -> None:
    """``agentspec cache stats --db URL`` used to say "No such option: --db"."""
    res = run("cache", "stats", "--db", url)
    assert res.exit_code == 0, res.output
    assert "30 rows" in res.stdout
    as_json = run("cache", "stats", "--db", url, "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["rows"] == 30


def test_read_commands_with_options_after_them(url: str, tmp_path: Path) -> None:
    key = "user: question number 7 about taxes"
    for args, check in (
            (("ls", "-n", "2"), lambda out: len(out) == 2),
            (("show", "3"), lambda out: out["id"] == 3),
            (("search", key, "-k", "1"), lambda out: out[0]["key_text"] == key),
            (("verify",), lambda out: out["ok"] and out["rows"] == 30)):
        res = run("cache", *args, "--db", url, "--json")
        assert res.exit_code == 0, (args, res.output)
        assert check(json.loads(res.stdout)), args


def test_write_commands_report_json(url: str, tmp_path: Path) -> None:
    def cache(*args: str) -> dict:
        res = run("cache", *args, "--db", url, "--json")
        assert res.exit_code == 0, (args, res.output)
        return json.loads(res.stdout)

    assert cache("rm", "1", "2", "--yes") == {"deleted": 2, "ids": [1, 2]}
    dry = cache("prune", "--older-than", "20d", "--dry-run")
    assert dry["dry_run"] and dry["deleted"] == 0 and len(dry["ids"]) == 10  # i = 20..29
    done = cache("prune", "--older-than", "20d", "--yes")
    assert done["deleted"] == 10 and sorted(done["ids"]) == sorted(dry["ids"])
    assert cache("drop-scope", "a", "--yes")["scope"] == "a"
    backup = tmp_path / "b.jsonl"
    assert cache("export", str(backup)) == {"exported": 9, "file": str(backup)}
    with SQLStore(url) as store:
        store.delete(store.ids().tolist())
    assert cache("import", str(backup), "--yes") == {"imported": 9, "already_present": 0,
                                                     "bad_lines": []}
    reindexed = cache("reindex", "--yes")
    assert reindexed["vectors"] == 9 and reindexed["index_files"] == 1


def test_export_to_stdout_keeps_stdout_for_the_records(url: str) -> None:
    res = run("cache", "export", "-", "--db", url, "--json")
    assert res.exit_code == 0
    assert len(res.stdout.splitlines()) == 30
    assert json.loads(res.stderr) == {"exported": 30, "file": "-"}


def test_the_last_db_given_wins(url: str, tmp_path: Path) -> None:
    missing = f"sqlite:///{tmp_path / 'nothing-here.db'}"
    assert run("--db", missing, "cache", "stats", "--db", url).exit_code == 0
    assert run("--db", missing, "cache", "--db", url, "stats").exit_code == 0
    assert run("cache", "--db", missing, "stats", "--db", url).exit_code == 0
    wrong = run("--db", url, "cache", "stats", "--db", missing)
    assert wrong.exit_code == 3 and "nothing-here.db" in wrong.stderr
    # AGENTSPEC_DB is the fallback of the global option only: it never overrides a --db
    assert run("cache", "stats", "--db", url, env={"AGENTSPEC_DB": missing}).exit_code == 0
    assert run("cache", "stats", env={"AGENTSPEC_DB": url}).exit_code == 0


def test_json_before_or_after(url: str) -> None:
    for args in (("--json", "--db", url, "cache", "ls"), ("cache", "--json", "--db", url, "ls"),
                 ("cache", "ls", "--json", "--db", url)):
        res = run(*args)
        assert res.exit_code == 0 and len(json.loads(res.stdout)) == 20, args


def test_db_and_json_are_defined_once() -> None:
    """One shared definition, no copy per command. ``agentspec bench`` (cli/bench.py) and
    ``agentspec demo`` (cli/demo.py) have a ``--db`` of their own: the benched system's memory
    database, default a fresh file, not $AGENTSPEC_DB."""
    import agentspec.cli as cli

    files = list(Path(cli.__file__).parent.glob("*.py"))
    sources = "".join(p.read_text() for p in files if p.name not in ("bench.py", "demo.py"))
    assert sources.count('"--db"') == 1 and sources.count('"--json"') == 1
    own = "".join(p.read_text() for p in files if p.name == "demo.py")
    assert own.count('"--json"') == 0  # the demo's --json is the shared one


def test_version_and_short_help_everywhere() -> None:
    from importlib.metadata import version

    res = run("--version")
    assert res.exit_code == 0 and res.stdout.strip() == f"agentspec {version('agentspec-llm')}"
    for args in ((), ("cache",), ("cache", "stats"), ("head",), ("generate",), ("bench",),
                 ("demo",)):
        short, long = run(*args, "-h"), run(*args, "--help")
        assert short.exit_code == 0, (args, short.output)
        assert short.stdout == long.stdout and "usage" in short.stdout.lower(), args
