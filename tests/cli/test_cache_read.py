"""Read commands: stats, ls, show, search; missing and corrupt databases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.conftest import EMBEDDER, Invoke, make_invoke


def test_stats_totals_and_index_not_built(cli: Invoke) -> None:
    res = cli("cache", "stats", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert (out["rows"], out["tokens"]) == (30, sum(i + 1 for i in range(30)))
    assert set(out["scopes"]) == {"a", "b"} and set(out["models"]) == {"m1", "m2"}
    assert out["hits"] == sum(i % 4 for i in range(30))
    assert out["accepted_tokens"] == sum(3 * i for i in range(30))
    assert out["index"]["status"] == "not built"
    human = cli("cache", "stats")
    assert human.exit_code == 0 and "per scope" in human.stdout and "not built" in human.stdout


def test_global_json_flag(cli: Invoke) -> None:
    res = cli("--json", "cache", "stats")
    assert res.exit_code == 0 and json.loads(res.stdout)["rows"] == 30


@pytest.mark.parametrize(("sort", "key"), [("hits", "hits"), ("size", "num_tokens"),
                                           ("accepted", "accepted_tokens"),
                                           ("recent", "last_used_at")])
def test_ls_sorts(cli: Invoke, sort: str, key: str) -> None:
    res = cli("cache", "ls", "--sort", sort, "--limit", "7", "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert len(rows) == 7
    values = [r[key] for r in rows]
    assert values == sorted(values, reverse=True)


def test_ls_filters_and_table(cli: Invoke) -> None:
    rows = json.loads(cli("cache", "ls", "--scope", "a", "--model", "m2", "--json").stdout)
    assert rows and all(r["scope"] == "a" and r["model"] == "m2" for r in rows)
    res = cli("cache", "ls", "-n", "3")
    assert res.exit_code == 0 and "request 0" in res.stdout


def test_ls_bad_sort(cli: Invoke) -> None:
    res = cli("cache", "ls", "--sort", "bogus")
    assert res.exit_code == 2 and "'bogus'" in res.stderr


def test_show(cli: Invoke) -> None:
    res = cli("cache", "show", "3", "--json")
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["request_text"] == "request 2 é" and rec["completion_ids"] == [102, 103, 104]
    assert rec["hits"] == 2 and rec["accepted_tokens"] == 6 and rec["dim"] == 64
    human = cli("cache", "show", "3")
    assert "answer 2 ✓" in human.stdout and "[102, 103, 104]" in human.stdout


def test_show_unknown_id(cli: Invoke) -> None:
    res = cli("cache", "show", "9999")
    assert res.exit_code == 3 and res.stderr.strip() == "error: no record with id 9999"
    as_json = cli("cache", "show", "9999", "--json")  # --json: the error as JSON on stdout too
    assert as_json.exit_code == 3
    assert json.loads(as_json.stdout) == {"error": "no record with id 9999", "exit_code": 3}


def test_search_uses_the_rows_embedder(cli: Invoke) -> None:
    key = "user: question number 7 about taxes"
    res = cli("cache", "search", key, "-k", "3", "--json")
    assert res.exit_code == 0, res.output
    hits = json.loads(res.stdout)
    assert len(hits) == 3 and hits[0]["key_text"] == key
    assert hits[0]["similarity"] == pytest.approx(1.0, abs=1e-5)
    scoped = json.loads(cli("cache", "search", key, "--scope", "a", "--json").stdout)
    assert scoped and all(h["scope"] == "a" for h in scoped)
    assert "similarity" in cli("cache", "search", key).stdout
    assert EMBEDDER.name == "hash-trigram-64"


def test_missing_sqlite_file_is_an_error_not_created(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "memory.db"
    for args in (["cache", "stats"], ["cache", "ls"], ["cache", "show", "1"],
                 ["cache", "verify"], ["cache", "export", str(tmp_path / "x.jsonl")]):
        res = make_invoke(f"sqlite:///{path}")(*args)
        assert res.exit_code == 3, (args, res.output)  # not found
        assert res.stderr.startswith("error: no memory database at") and str(path) in res.stderr
    assert not path.exists() and not path.parent.exists()


def test_default_db_under_home(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from agentspec.cli import app

    # A fresh home: stats and ls answer empty with a hint; a command naming a row says not found.
    res = CliRunner().invoke(app, ["cache", "stats"])
    assert res.exit_code == 0 and "0 rows" in res.stdout and "nothing recorded yet" in res.stderr
    as_json = json.loads(CliRunner().invoke(app, ["cache", "stats", "--json"]).stdout)
    assert as_json["rows"] == 0 and as_json["scopes"] == {} and str(home / "memory.db") in as_json["database"]
    assert not (home / "memory.db").exists()  # nothing created
    listed = CliRunner().invoke(app, ["cache", "ls", "--json"])
    assert listed.exit_code == 0 and json.loads(listed.stdout) == []
    assert "nothing recorded yet" in listed.stderr and not (home / "memory.db").exists()
    shown = CliRunner().invoke(app, ["cache", "show", "1"])
    assert shown.exit_code == 3 and str(home / "memory.db") in shown.stderr
    # A database named by AGENTSPEC_DB (or --db) that is not there is not a fresh home.
    monkeypatch.setenv("AGENTSPEC_DB", "sqlite:////nonexistent-dir/x.db")
    named = CliRunner().invoke(app, ["cache", "stats"])
    assert named.exit_code == 3 and "/nonexistent-dir/x.db" in named.stderr


def test_corrupt_database_file(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    path.write_bytes(b"this is not a database" * 100)
    res = make_invoke(f"sqlite:///{path}")("cache", "stats")
    assert res.exit_code == 1 and res.stderr.startswith("error: ")
    assert "Traceback" not in res.output and len(res.stderr.strip().splitlines()) == 1


def test_bad_url() -> None:
    res = make_invoke("notaurl")("cache", "stats")
    assert res.exit_code == 2 and "notaurl" in res.stderr


def test_help_everywhere_has_an_example() -> None:
    from typer.testing import CliRunner

    from agentspec.cli import app

    commands = [["generate"], ["demo"], *[["cache", c] for c in (
        "stats", "ls", "show", "search", "rm", "prune", "drop-scope", "export", "import",
        "reindex", "verify")]]
    for cmd in commands:
        res = CliRunner().invoke(app, [*cmd, "--help"])
        assert res.exit_code == 0 and "Example: agentspec" in res.stdout, cmd
