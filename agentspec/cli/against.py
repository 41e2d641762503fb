"""``agentspec bench --against``: agentspec serve beside the servers users run instead.

Called by :mod:`agentspec.cli.bench` once its options are checked; the bench itself is
:mod:`agentspec.bench.servers` (imported when the command runs).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from agentspec.cli.common import EXIT_USAGE, console, err_console, fail, print_json, progress


def against_servers(workload: str, model: str, against: str, levels: list[int], *,
                    tools: bool, threads: int | None, context: int, max_new_tokens: int,
                    out: Path | None, report: Path | None, plot: Path | None,
                    json_out: bool, dtype: str | None = None) -> None:
    """Run the servers bench, print its table and notes, write its outputs; exit 1 when a
    server failed (the others' figures are printed and written first)."""
    from agentspec.bench import servers, servers_report
    from agentspec.bench.report import write_json

    others = [s.strip() for s in against.split(",") if s.strip()]
    bad = [s for s in others if s not in servers.SYSTEMS or s == "agentspec"]
    if bad or not others:
        fail(f"--against takes servers among {', '.join(servers.SYSTEMS[1:])}, got "
             f"{against!r}", EXIT_USAGE)
    loaded = servers.load_served_workload(workload, max_new_tokens)
    for line, error in loaded.errors:
        err_console.print(f"warning: {loaded.path}:{line}: skipped: {error}", markup=False)
    tmp = tempfile.mkdtemp(prefix="agentspec-against-")  # kept when a server fails: its log
    with progress() as bar:
        passes = len(set(levels) | {1})
        task = bar.add_task("servers", total=(1 + len(others)) * (passes + 1))

        def tick(label: str, step: bool) -> None:
            bar.update(task, advance=int(step), description=label.split(":")[0])
            if not err_console.is_terminal:
                err_console.print(label, markup=False)

        try:
            summary = servers.run_against(loaded, model, ["agentspec", *others], levels,
                                          tools=tools, threads=threads, context=context,
                                          workdir=Path(tmp), on_progress=tick, dtype=dtype)
        except ValueError as e:
            fail(str(e), EXIT_USAGE)
    shown = err_console if json_out else console
    shown.print(servers_report.rich_table(summary), width=max(console.width, 150))
    for line in servers_report.notes(summary):
        shown.print(line, markup=False)
    if out is not None:
        write_json(summary, out)
    if json_out:
        print_json(summary)
    if report is not None:
        servers_report.write_markdown(summary, report)
    if plot is not None:
        servers_report.plot(summary, plot)
    if summary["failed"]:
        fail(f"{', '.join(summary['failed'])} failed (the others' figures are above; the "
             f"servers' logs are in {tmp}/logs)")
    shutil.rmtree(tmp, ignore_errors=True)
