"""The install lines a user copies: the distribution's own name and extras that exist.

`agentspec` on the package index is an unrelated project, so every ``pip install`` hint the
README, the docs and the error messages give names this project's distribution
(``pyproject.toml``'s ``name``) and one of its extras; a hint with the bare name, or an extra
the project does not define, fails here.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HINT = re.compile(r"(?<![\w./-])([A-Za-z][\w.-]*)\[([\w,-]+)\]")
"""``name[extra,...]`` as a pip requirement writes it."""


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _hints(text: str) -> list[tuple[str, list[str]]]:
    """Every ``agentspec...[extras]`` requirement on a ``pip install`` line of ``text``."""
    return [(m.group(1), m.group(2).split(","))
            for line in re.findall(r"pip install[^\n]*", text) for m in HINT.finditer(line)
            if m.group(1).startswith("agentspec") and not m.group(1).endswith(".whl")]


def _problems(text: str, name: str, extras: set[str]) -> list[str]:
    return [f"{dist}[{','.join(wanted)}]" for dist, wanted in _hints(text)
            if dist != name or not set(wanted) <= extras]


def test_the_distribution_is_not_the_index_s_unrelated_agentspec():
    assert _project()["name"] != "agentspec"


def test_every_install_hint_names_this_distribution_and_its_extras():
    project = _project()
    extras = set(project["optional-dependencies"])
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.toml", "*.sh", "Makefile"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bad = {f: p for f in files if f not in ("BENCHMARKS.md", "tests/test_packaging.py")
           for p in [_problems((ROOT / f).read_text(), project["name"], extras)] if p}
    assert not bad, f"install hints that pip would resolve elsewhere or fail on: {bad}"


def test_a_hint_with_the_bare_name_or_an_unknown_extra_is_caught():
    extras = {"serve", "langchain"}
    assert _problems("pip install 'agentspec[serve]'", "agentspec-llm", extras) == ["agentspec[serve]"]
    assert _problems("pip install 'agentspec-llm[gpu]'", "agentspec-llm", extras) == ["agentspec-llm[gpu]"]
    assert _problems("pip install 'agentspec-llm[serve,langchain]'", "agentspec-llm", extras) == []
    assert _problems("FORMATS[name] and agentspec[serve] outside an install line", "agentspec-llm",
                     extras) == []
