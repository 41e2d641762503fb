"""``agentspec demo``: the BFCL agent demo (:mod:`agentspec.bench.demo`) as a command.

The tables go to stdout; with ``--json`` (here or before the command) the summary goes to
stdout as one JSON value and the tables to stderr, and ``--out FILE`` writes the summary (every call included) to a file.
Exit codes: 0 every output matched, 1 an output differed (or a failure), 2 bad input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from agentspec.cli.common import (
    EXIT_FAIL,
    EXIT_USAGE,
    JsonOpt,
    fail,
    handles_errors,
    print_json,
    want_json,
)
from agentspec.terminal import output_width


def demo(
    ctx: typer.Context,
    tasks: Annotated[str | None, typer.Option(
        "--tasks", metavar="IDS",
        help="Comma-separated BFCL multi-turn task ids, or their numbers (26 is "
             "multi_turn_base_26); default the demo's own few.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", min=1, help="Budget of every LLM call.")] = None,
    max_turns: Annotated[int | None, typer.Option(
        "--max-turns", min=1, help="User turns per task at most (default all).")] = None,
    max_calls_per_turn: Annotated[int | None, typer.Option(
        "--max-calls-per-turn", min=1, help="LLM calls per user turn at most.")] = None,
    db: Annotated[str | None, typer.Option(
        "--db", metavar="URL",
        help="Memory database (SQLAlchemy URL); default a fresh SQLite file in a temporary "
             "folder (a --db that holds rows makes the cold pass warm).")] = None,
    no_grammar: Annotated[bool, typer.Option(
        "--no-grammar", help="Let the agent write free text instead of calling its tools "
                             "through the tool-call grammar (to see the malformed calls it "
                             "saves).")] = False,
    json_out: JsonOpt = False,
    out: Annotated[Path | None, typer.Option(
        "--out", metavar="FILE", help="Write the summary and every call as JSON.")] = None,
) -> None:
    """The BFCL agent demo: plain decoding against agentspec, call by call, cold and warm.

    A few BFCL multi-turn file-system tasks are played on BFCL's own tool implementations;
    every LLM call runs on plain decoding and on agentspec with a completion memory, and the
    outputs must be token-identical.

    Example: agentspec demo --tasks 26 --max-new-tokens 64 --out out/demo.json
    """
    handles_errors(_run)(ctx, tasks, max_new_tokens, max_turns, max_calls_per_turn, db,
                         not no_grammar, json_out, out)


def _run(ctx: typer.Context, tasks: str | None, max_new_tokens: int | None,
         max_turns: int | None, max_calls_per_turn: int | None, db: str | None, grammar: bool,
         json_out: bool, out: Path | None) -> None:
    try:
        from agentspec.bench import bfcl
        from agentspec.bench.demo import DemoConfig, print_summary, run_demo, task_ids
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("agentspec.bench"):
            raise
        fail("the demo is not available: agentspec.bench is not installed in this build")

    as_json = json_out or want_json(ctx)
    fields: dict[str, object] = {"max_turns": max_turns, "db": db, "grammar": grammar}
    for name, value in (("task_ids", None if tasks is None else task_ids(tasks)),
                        ("max_new_tokens", max_new_tokens),
                        ("max_calls_per_turn", max_calls_per_turn)):
        if value is not None:
            fields[name] = value
    config = DemoConfig(**fields)  # type: ignore[arg-type]  # ValueError: exit 2
    try:
        bfcl.load_tasks(list(config.task_ids))  # bad ids fail before the model loads
    except KeyError as e:
        fail(str(e.args[0]), EXIT_USAGE)
    stream = sys.stderr if as_json else sys.stdout
    console = Console(file=stream, highlight=False, width=output_width(stream))
    summary = run_demo(config, console=console)
    print_summary(summary, console)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    if as_json:
        print_json(summary)
    if summary["exact_match"]["matched"] != summary["exact_match"]["calls"]:
        raise typer.Exit(EXIT_FAIL)
