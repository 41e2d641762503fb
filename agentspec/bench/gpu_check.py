"""``python -m agentspec.bench.gpu_check --out DIR``: every GPU figure in one run, each step
under its own timeout.

A session lent a GPU has minutes of device time, so the measurements run as one prepared
command, in priority order: the engine's figures (a verification forward's cost as a CUDA
graph, fused and on the modules, draft invariance), the GPU tests, the load bench (bfcl-live
by 1, 8 and 32 clients at once on one engine), then bfcl-live, the core prompts and bfcl
against transformers' plain and compiled decoding, and last the operation counts (which the
CPU counts as well). Each step is a process of
its own under a timeout cut to what is left of ``--budget-s``, its output kept in
``DIR/<step>.log``; after every step ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` are
written again, so a step that runs long, fails or is killed still leaves the others' results.
A step's failure never stops the ones after it; the command exits 1 when any step failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_SYSTEMS = "hf-greedy,hf-static,agentspec-plain,agentspec-pld,agentspec-suffix,agentspec"
# The steps' order, each one's longest run in seconds (cut to the budget left) and what it is.
STEPS: dict[str, tuple[int, str]] = {
    "engine": (80, "python -m agentspec.bench.engine: forward ms as a graph, invariance"),
    "tests": (80, "pytest tests/gpu"),
    "load": (130, "agentspec bench --concurrency 1,8,32 on bfcl-live"),
    "bfcl-live": (140, "agentspec bench on bfcl-live"),
    "prompts": (70, "agentspec bench on the core prompts, 64 tokens"),
    "bfcl": (70, "agentspec bench on bfcl"),
    "ops": (30, "python -m agentspec.bench.engine --ops: operations of a 64-row forward"),
}


@dataclass(frozen=True)
class Step:
    """One measurement: a command, its longest run, and the JSON file it writes (if any)."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float
    results: Path | None = None


@dataclass
class Outcome:
    """How a step ended: ``ok``, ``failed`` (its exit code), ``timed out`` or ``skipped``
    (no budget left); its seconds, log file and what its results file holds."""

    name: str
    status: str
    seconds: float = 0.0
    returncode: int | None = None
    log: str = ""
    results: Any = None
    summary: list[str] = field(default_factory=list)


def steps_for(names: Sequence[str], out: Path, python: str = sys.executable,
              tests: Path = Path("tests/gpu")) -> list[Step]:
    """The commands of the named steps, writing under ``out``; ``tests``: the GPU tests' folder.

    The tests run with pytest's ``append`` import mode: the source tree goes last on the path,
    so where the package is installed elsewhere (a GPU machine's mapped copy, which holds
    ``stores`` and ``adapters``), that copy is the one imported.

    Raises:
        ValueError: a name that is no step (the message names it and the known ones).
    """
    bad = [n for n in names if n not in STEPS]
    if bad:
        raise ValueError(f"unknown step(s) {', '.join(bad)}: expected some of {', '.join(STEPS)}")
    bench = (python, "-m", "agentspec.cli", "bench")
    argv = {
        "tests": (python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=append",
                  str(tests)),
        "engine": (python, "-m", "agentspec.bench.engine", "--context", "1984",
                   "--out", str(out / "engine.json")),
        "ops": (python, "-m", "agentspec.bench.engine", "--ops", "1024,2048,4096",
                "--out", str(out / "ops.json")),
        "load": (*bench, "--workload", "bfcl-live", "--concurrency", "1,8,32",
                 "--systems", "agentspec-plain,agentspec-pld,agentspec-suffix,agentspec",
                 "--max-batch", "32", "--out", str(out / "load.json")),
        "bfcl-live": (*bench, "--workload", "bfcl-live", "--systems", BENCH_SYSTEMS,
                      "--out", str(out / "bfcl-live.json")),
        "bfcl": (*bench, "--workload", "bfcl", "--systems", BENCH_SYSTEMS,
                 "--out", str(out / "bfcl.json")),
        "prompts": (*bench, "--workload", "prompts", "--max-new-tokens", "64", "--systems",
                    BENCH_SYSTEMS, "--out", str(out / "prompts.json")),
    }
    # every step but the tests writes its results to <step>.json
    return [Step(n, argv[n], STEPS[n][0], None if n == "tests" else out / f"{n}.json")
            for n in names]


def run_steps(steps: Sequence[Step], out: Path, *, budget_s: float,
              report: Callable[[str], None] = print) -> list[Outcome]:
    """Run ``steps`` in order within ``budget_s`` seconds in all, each under its own timeout
    (cut to what is left), rewriting the JSON and markdown summaries after each one."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    outcomes: list[Outcome] = []
    for step in steps:
        left = budget_s - (time.monotonic() - started)
        if left < 5:
            outcomes.append(Outcome(step.name, "skipped"))
        else:
            outcomes.append(_run(step, out, min(step.timeout_s, left)))
        write_summary(out, outcomes)
        last = outcomes[-1]
        report(f"{step.name}: {last.status} in {last.seconds:.0f} s")
    return outcomes


def _run(step: Step, out: Path, timeout_s: float) -> Outcome:
    log = out / f"{step.name}.log"
    began = time.monotonic()
    with log.open("w") as sink:
        try:
            proc = subprocess.run(step.argv, stdout=sink, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            status, code = "timed out", None
        except OSError as e:  # the command cannot start
            sink.write(f"cannot run {step.argv[0]}: {e}\n")
            status, code = "failed", None
        else:
            status, code = ("ok" if proc.returncode == 0 else "failed"), proc.returncode
    outcome = Outcome(step.name, status, time.monotonic() - began, code, log.name)
    if step.results is not None and step.results.exists():
        try:
            outcome.results = json.loads(step.results.read_text())
        except (OSError, ValueError) as e:
            outcome.summary.append(f"results unreadable: {e}")
        else:
            outcome.summary = summarize(outcome.results)
    return outcome


def summarize(results: Any) -> list[str]:
    """Markdown lines for a results file: a bench run's systems (speedup over hf-greedy and
    over hf-static, tokens per step, exact, = plain), or the engine's figures."""
    if not isinstance(results, dict):
        return []
    if isinstance(results.get("rows"), list):  # the load bench
        return _load_table(results["rows"], results.get("versus_plain") or {})
    systems = results.get("systems")
    if isinstance(systems, dict):
        return _bench_table(results, systems)
    return [f"- {key}: `{json.dumps(value)[:300]}`" for key, value in results.items()]


def _bench_table(results: dict[str, Any], systems: dict[str, Any]) -> list[str]:
    static = (systems.get("hf-static") or {}).get("tokens_per_second")
    exact, plain = results.get("exact_match") or {}, results.get("same_as_plain") or {}
    lines = ["| system | tok/s | x hf-greedy | median | x hf-static | tok/step | exact | = plain |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in systems.items():
        rate = row.get("tokens_per_second")
        over = f"{rate / static:.2f}x" if rate and static else "-"
        lines.append(f"| {name} | {_num(rate)} | {_num(row.get('speedup'), 'x')} | "
                     f"{_num(row.get('median_speedup'), 'x')} | {over} | "
                     f"{_num(row.get('tokens_per_step'))} | {_num(exact.get(name))} | "
                     f"{_num(plain.get(name))} |")
    versus = results.get("versus")
    if isinstance(versus, dict) and versus:
        lines.append("")
        lines.append(f"versus: `{json.dumps(versus)}`")
    return lines


def _load_table(rows: list[dict[str, Any]], versus: dict[str, Any]) -> list[str]:
    lines = ["| clients | system | tok/s | x solo | x plain | tok/step | per-token ms p50/p99 | "
             "TTFT ms p50/p99 | exact |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        plain = (versus.get(str(r.get("concurrency"))) or {}).get(r.get("system"))
        lines.append(f"| {r.get('concurrency')} | {r.get('system')} | "
                     f"{_num(r.get('tokens_per_second'))} | {_num(r.get('x_solo'), 'x')} | "
                     f"{_num(plain, 'x')} | {_num(r.get('tokens_per_step'))} | "
                     f"{_num(r.get('per_token_ms_p50'))} / {_num(r.get('per_token_ms_p99'))} | "
                     f"{_num(r.get('ttft_ms_p50'))} / {_num(r.get('ttft_ms_p99'))} | "
                     f"{_num(r.get('exact'))} |")
    return lines


def _num(value: Any, unit: str = "") -> str:
    return f"{value:.2f}{unit}" if isinstance(value, (int, float)) else "-"


def write_summary(out: Path, outcomes: Sequence[Outcome]) -> None:
    """``gpu_check.json`` (every outcome, results included) and ``gpu_check.md``."""
    device = _device()
    (out / "gpu_check.json").write_text(json.dumps(
        {"device": device, "steps": [asdict(o) for o in outcomes]}, indent=1))
    lines = [f"# GPU check: {device}", "", "| step | status | seconds | log |", "|---|---|---:|---|"]
    lines += [f"| {o.name} | {o.status}{'' if o.returncode in (0, None) else f' ({o.returncode})'} "
              f"| {o.seconds:.0f} | {o.log} |" for o in outcomes]
    for o in outcomes:
        if o.summary:
            lines += ["", f"## {o.name}", "", *o.summary]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def _device() -> str:
    try:
        import torch
    except ImportError:  # the summary still names the steps
        return "unknown (no torch)"
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"cpu (no CUDA), torch {torch.__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentspec.bench.gpu_check",
        description="Every GPU figure in one run, each step under its own timeout; results "
                    "under --out as each step finishes.")
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated, in order, among {', '.join(STEPS)}")
    parser.add_argument("--tests", type=Path, default=Path("tests/gpu"),
                        help="the GPU tests' folder (default tests/gpu; on a GPU machine set up "
                             "by ../shared/gpu: /tmp/src/tests/gpu)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds for all steps together (default 480: 8 minutes)")
    args = parser.parse_args(argv)
    if not args.budget_s > 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    try:
        steps = steps_for([s.strip() for s in args.steps.split(",") if s.strip()], args.out,
                          tests=args.tests)
    except ValueError as e:
        parser.error(str(e))
    outcomes = run_steps(steps, args.out, budget_s=args.budget_s)
    print(f"results: {args.out / 'gpu_check.md'}, {args.out / 'gpu_check.json'}")
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
