"""glibc malloc settings (:mod:`agentspec.engine.malloc`) against glibc's defaults, on a workload.

    python -m agentspec.bench.malloc --workload bfcl-live --rounds 2

The settings are process-wide and cannot be undone in a process, so each run is a child
process: ``AGENTSPEC_MALLOC=default`` and ``=tuned`` alternate (default first in odd rounds,
tuned first in even ones). A child loads the model, runs one request untimed, then the
workload's measured requests through a ``Speculator`` (prompt lookup, no memory), each request
timed as the bench times it (under its grammar, in its scope), and reports its seconds, the page faults taken while generating
(``ru_minflt``) and its outputs. Prints per setting the median of the runs' totals, the
page faults, and whether every output equals the other setting's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from agentspec.bench.workload import WorkloadItem, in_turn

SETTINGS = ("default", "tuned")


def ordered(items: Sequence[WorkloadItem], order: str) -> list[WorkloadItem]:
    """The workload's order, or one request of each scope in turn (agents interleaving)."""
    return list(items) if order == "workload" else in_turn(items)


def child(workload: str, model: str, limit: int | None, order: str) -> dict[str, Any]:
    """One run in this process (its malloc settings are the environment's)."""
    from agentspec import Speculator, load_target
    from agentspec.bench.harness import SpecSystem
    from agentspec.bench.results import prompt_of
    from agentspec.bench.workload import load_workload, resolve_workload
    from agentspec.engine import malloc

    items = list(load_workload(resolve_workload(workload), default_max_new_tokens=96).measure)
    items = ordered(items[:limit], order)
    target = load_target(model, device="cpu")
    system = SpecSystem("agentspec-pld", Speculator(target, memory=None), temperature=0.0)
    system.spec.generate(prompt_of(items[0]), 8)  # widths, kernels: not timed
    seconds, outputs = [], []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for item in items:
        outcome = system.run(item, item.max_new_tokens or 96, None)
        seconds.append(outcome.seconds)
        outputs.append(list(outcome.token_ids))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {"malloc": malloc.state(), "seconds": seconds, "faults": faults, "outputs": outputs}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.malloc",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="bfcl-live")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting")
    parser.add_argument("--limit", type=int, default=None, help="the first N measured requests")
    parser.add_argument("--order", choices=("workload", "round-robin"), default="workload",
                        help="the workload's order, or one request of each scope in turn")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.workload, args.model, args.limit, args.order)))
        return 0
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting in (SETTINGS if r % 2 == 0 else SETTINGS[::-1]):
            env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
            env["AGENTSPEC_MALLOC"] = setting
            cmd = [sys.executable, "-m", "agentspec.bench.malloc", "--child", setting,
                   "--workload", args.workload, "--model", args.model, "--order", args.order]
            if args.limit is not None:
                cmd += ["--limit", str(args.limit)]
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs[setting].append(run)
            total = sum(run["seconds"])
            print(f"round {r + 1}: {setting} ({run['malloc']}) {total:.2f} s, "
                  f"{run['faults']} page faults", flush=True)
    totals = {s: [sum(run["seconds"]) for run in runs[s]] for s in SETTINGS}
    same = all(run["outputs"] == runs["default"][0]["outputs"] for s in SETTINGS for run in runs[s])
    medians = {s: statistics.median(totals[s]) for s in SETTINGS}
    print(json.dumps({
        "workload": args.workload, "order": args.order,
        "requests": len(runs["default"][0]["outputs"]),
        "rounds": args.rounds,
        "settings": {s: {"median_s": round(medians[s], 2), "runs_s": [round(t, 2) for t in totals[s]],
                         "page_faults": [run["faults"] for run in runs[s]]} for s in SETTINGS},
        "speedup": round(medians["default"] / medians["tuned"], 3),
        "same_outputs": same,
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
