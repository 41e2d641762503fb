"""Mutating commands: rm, prune, drop-scope; confirmation and durations."""

from __future__ import annotations

import json

import pytest

from agentspec.cli.common import CliError, parse_duration
from agentspec.stores import SQLStore
from tests.cli.conftest import Invoke


def _rows(cli: Invoke) -> int:
    return json.loads(cli("cache", "stats", "--json").stdout)["rows"]


def test_rm(cli: Invoke, url: str) -> None:
    refused = cli("cache", "rm", "1", "2")
    assert refused.exit_code == 2 and "--yes" in refused.stderr and _rows(cli) == 30
    res = cli("cache", "rm", "1", "2", "--yes")
    assert res.exit_code == 0 and "deleted 2" in res.stdout
    with SQLStore(url) as store:
        assert store.get(1) is None and store.get(3) is not None and len(store) == 28


def test_rm_unknown_id_deletes_nothing(cli: Invoke) -> None:
    res = cli("cache", "rm", "3", "4242", "--yes")
    assert res.exit_code == 3 and "4242" in res.stderr and _rows(cli) == 30  # not found
    assert cli("cache", "rm", "x", "--yes").exit_code == 2  # bad input


def test_confirm_on_a_terminal(cli: Invoke, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agentspec.cli.common.stdin_is_tty", lambda: True)
    no = cli("cache", "rm", "5", input="n\n")
    assert no.exit_code == 1 and _rows(cli) == 30
    yes = cli("cache", "rm", "5", input="y\n")
    assert yes.exit_code == 0 and _rows(cli) == 29


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("15m", 900), ("12h", 43200),
                                               ("7d", 604800), ("2w", 1209600), ("1.5h", 5400)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["7", "7x", "-1d", "d", "", "1 week"])
def test_bad_durations(bad: str) -> None:
    with pytest.raises(CliError, match="bad duration") as e:
        parse_duration(bad)
    assert e.value.code == 2


def test_prune_bad_duration_names_it(cli: Invoke) -> None:
    res = cli("cache", "prune", "--older-than", "7y", "--yes")
    assert res.exit_code == 2 and "'7y'" in res.stderr
    assert cli("cache", "prune", "--yes").exit_code == 2  # nothing to prune by


def test_prune_older_than(cli: Invoke) -> None:
    # record i was last used i days ago: 10d leaves i = 0..9 (i = 10 is a hair older than 10d)
    dry = cli("cache", "prune", "--older-than", "10d", "--dry-run")
    assert dry.exit_code == 0 and "would delete 20" in dry.stdout and _rows(cli) == 30
    assert cli("cache", "prune", "--older-than", "10d").exit_code == 2
    res = cli("cache", "prune", "--older-than", "10d", "--yes")
    assert res.exit_code == 0 and "deleted 20" in res.stdout and _rows(cli) == 10


def test_prune_scope_and_max_tokens(cli: Invoke) -> None:
    res = cli("cache", "prune", "--scope", "a", "--max-tokens", "50", "--yes")
    assert res.exit_code == 0, res.output
    out = json.loads(cli("cache", "stats", "--json").stdout)
    assert out["scopes"]["a"]["tokens"] <= 50 and out["scopes"]["b"]["rows"] == 15


def test_drop_scope(cli: Invoke) -> None:
    unknown = cli("cache", "drop-scope", "zzz", "--yes")
    assert unknown.exit_code == 3 and "'zzz'" in unknown.stderr
    assert cli("cache", "drop-scope", "a").exit_code == 2
    res = cli("cache", "drop-scope", "a", "--yes")
    assert res.exit_code == 0 and "deleted 15" in res.stdout
    assert set(json.loads(cli("cache", "stats", "--json").stdout)["scopes"]) == {"b"}


def test_relabel(cli: Invoke, url: str) -> None:
    models = json.loads(cli("cache", "stats", "--json").stdout)["models"]
    assert set(models) == {"m1", "m2"}
    refused = cli("cache", "relabel", "m1", "m2")
    assert refused.exit_code == 2 and "--yes" in refused.stderr
    res = cli("cache", "relabel", "m1", "m2", "--yes", "--json")
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["moved"], out["merged"]) == (models["m1"]["rows"], 0)
    after = json.loads(cli("cache", "stats", "--json").stdout)
    assert set(after["models"]) == {"m2"} and after["rows"] == 30
    unknown = cli("cache", "relabel", "m1", "m2", "--yes")
    assert unknown.exit_code == 3 and "no records of model 'm1'" in unknown.stderr
    other = cli("cache", "relabel", "gemma:1", "smol:2", "--yes")
    assert other.exit_code == 2 and "different models" in other.stderr
