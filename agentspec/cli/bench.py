"""``agentspec bench``: the interleaved benchmark, ``agentspec bench build-bfcl`` and
``agentspec bench build-bfcl-live``.

Wired into ``agentspec`` by :mod:`agentspec.cli` (imported lazily there). Importing this
module imports neither torch, transformers nor the bench (:mod:`agentspec.bench`): the
commands import them when they run.

Exit codes: 0 success, 1 failure, 2 bad input (one line on stderr naming the value).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer

from agentspec.cli.common import (
    APP_SETTINGS,
    EXIT_USAGE,
    console,
    err_console,
    fail,
    handles_errors,
    print_json,
    progress,
)
from agentspec.cli.placement import placement, resolve_dtype

bench_app = typer.Typer(
    name="bench", **APP_SETTINGS,
    help="Measure agentspec against transformers, interleaved request by request.\n\n"
         "Example: agentspec bench --workload prompts --out out/core.json",
)

SYSTEMS = ("hf-greedy", "hf-pld", "hf-static", "agentspec-plain", "agentspec-pld", "agentspec",
           "agentspec-chain", "agentspec-suffix")
# Systems that need something trained first (the draft head: agentspec head train).
TRAINED_SYSTEMS = ("agentspec-head",)
DEFAULT_SYSTEMS = "hf-greedy,hf-pld,agentspec-pld,agentspec"
# The core benchmark: the engine without memory against transformers.
CORE_SYSTEMS = "hf-greedy,hf-pld,agentspec-plain,agentspec-pld"
DEFAULT_MAX_NEW_TOKENS = 128


def parse_systems(text: str) -> list[str]:
    """``"hf-greedy,agentspec"`` -> names, checked; hf-greedy (the reference) is put first."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS + TRAINED_SYSTEMS]
    if unknown or not names:
        fail(f"unknown system {', '.join(map(repr, unknown)) or repr(text)}; known systems: "
             f"{', '.join(SYSTEMS + TRAINED_SYSTEMS)}", EXIT_USAGE)
    if len(set(names)) != len(names):
        fail(f"a system is listed twice in {text!r}", EXIT_USAGE)
    return ["hf-greedy"] + [s for s in names if s != "hf-greedy"]


def _check_temperature(t: float) -> float:
    if not math.isfinite(t) or t < 0:
        fail(f"temperature must be a finite number >= 0, got {t}", EXIT_USAGE)
    return t


@bench_app.callback(invoke_without_command=True)
@handles_errors
def bench(
    ctx: typer.Context,
    workload: Annotated[str, typer.Option(
        "--workload", help="A .jsonl workload, or a shipped one by name: bfcl, bfcl-live, "
                                 "prompts.")] = "bfcl",
    model: Annotated[str, typer.Option(
        "--model", help="Target model: a packaged name (smollm2-135m-instruct, gemma-3-270m), "
                        "a model folder, a .gguf file or a hub id (org/name).")] = "smollm2-135m-instruct",
    systems: Annotated[str | None, typer.Option(
        "--systems", help=f"Comma-separated, among {', '.join(SYSTEMS)} (and agentspec-head "
                          "once a head is trained: agentspec head train). Default "
                          f"{DEFAULT_SYSTEMS} ({CORE_SYSTEMS} for the prompts workload); "
                          f"hf-greedy is always run: it is the reference.")] = None,
    temperature: Annotated[float, typer.Option(
        "--temperature", help="0 is greedy (outputs must match exactly); > 0 runs a "
                              "distribution check instead.")] = 0.0,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", help="Budget for every request; default each line's own, "
                                 f"else {DEFAULT_MAX_NEW_TOKENS}.")] = None,
    samples: Annotated[int, typer.Option(
        "--samples", help="Seeds per request when temperature > 0.")] = 3,
    db: Annotated[str | None, typer.Option(
        "--db", metavar="URL", help="Memory database of the agentspec system; default a fresh "
                                    "SQLite file in a temporary folder (agentspec-chain always "
                                    "gets a fresh file of its own).")] = None,
    device: Annotated[str | None, typer.Option(
        "--device", help="Where the target runs, for every system: cpu, cuda, cuda:N. Default "
                         "cuda when available, else cpu.")] = None,
    dtype: Annotated[str | None, typer.Option(
        "--dtype", help="The target's weights, for every system: bf16, fp16, fp32, or gguf "
                        "(a GGUF model's weights as the file stores them, on the CPU or CUDA). "
                        "Default bf16 on CUDA, fp32 on the CPU.")] = None,
    quantize: Annotated[str | None, typer.Option(
        "--quantize", help="The target's weights quantized at load, for every system: int8 "
                           "or int4 (per 32 weights, as GGUF's Q8_0 and Q4_1), held and run "
                           "as a GGUF's are (CPU, fp32 loaded first). Not for a GGUF model: "
                           "it takes --dtype gguf.")] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="The results as one JSON value on stdout (the table goes to "
                       "stderr).")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", metavar="FILE", help="Write the results as JSON.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of the results.")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Write a markdown report.")] = None,
    lines: Annotated[Path | None, typer.Option(
        "--lines", help="Greedy runs with agentspec: also write the outputs (warmup and "
                        "measured) for the offline replay: python -m agentspec.bench.replay "
                        "--outputs FILE replays drafting policies over them in seconds.")] = None,
    prefix_cache_mb: Annotated[float | None, typer.Option(
        "--prefix-cache-mb", help="Each agentspec system's prefix cache (KV rows of earlier "
                                  "calls restored instead of prefilled), in MiB; 0 turns it "
                                  "off. Default 512.")] = None,
    concurrency: Annotated[str | None, typer.Option(
        "--concurrency", metavar="LEVELS",
        help="Measure load instead: at each level (comma-separated, e.g. 1,4,8,16) that many "
             "clients run the measured requests at once on one engine; systems among "
             "agentspec-plain, agentspec-pld, agentspec-suffix, agentspec and "
             "agentspec-oracle (drafts each request's known output: the bound of any "
             "drafter) (default agentspec-plain,agentspec-suffix,agentspec), greedy. "
             "Reports tokens/s, per-token latency and time to first token (p50/p99) and the "
             "outputs against agentspec-plain alone.")] = None,
    repeats: Annotated[int, typer.Option(
        "--repeats", help="With --concurrency: passes per level and system; the median "
                          "counts.")] = 1,
    max_batch: Annotated[int | None, typer.Option(
        "--max-batch", help="With --concurrency: the most requests an engine steps at once "
                            "(default 16).")] = None,
    against: Annotated[str | None, typer.Option(
        "--against", metavar="SERVERS",
        help="Measure agentspec serve against other servers on the same GGUF file instead, "
             "through the OpenAI chat API, at each --concurrency level (default 1,4,8,16): "
             "comma-separated among llama.cpp, llama.cpp-ngram-mod (and its other n-gram "
             "types: -ngram-simple, -ngram-map-k, -ngram-map-k4v, -ngram-cache), "
             "agentspec-plain, vllm, vllm-suffix (llama.cpp: make "
             "llama-cpp builds it; vllm: make test-vllm's venv). Workloads: a file, bfcl-live, "
             "bfcl, humaneval.")] = None,
    tools: Annotated[bool, typer.Option(
        "--tools", help="With --against: send each line's tools as OpenAI tools with "
                        "tool_choice 'required' and report the share of valid calls.")] = False,
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, help="With --against: every server's threads (default: the "
                                 "cores).")] = None,
    context: Annotated[int, typer.Option(
        "--context", min=256, help="With --against: a request's context budget in tokens "
                                   "(llama-server gets this per slot).")] = 4096,
) -> None:
    """Run every request of a workload through each system, interleaved, and compare.

    Example: agentspec bench --workload prompts --systems hf-greedy,agentspec-pld
    """
    if ctx.invoked_subcommand is not None:
        return
    if against is not None:
        from agentspec.cli.against import against_servers

        if quantize is not None:
            fail("--quantize does not go with --against: the servers share one GGUF file, "
                 "quantized already (agentspec serve's weights as stored: --dtype gguf)",
                 EXIT_USAGE)
        if max_new_tokens is not None and max_new_tokens < 1:
            fail(f"max-new-tokens must be a positive integer, got {max_new_tokens}", EXIT_USAGE)
        against_servers(workload, model, against, parse_levels(concurrency or "1,4,8,16"),
                        tools=tools, threads=threads, context=context,
                        max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS, out=out,
                        report=report, plot=plot, json_out=json_out,
                        dtype=None if dtype is None else resolve_dtype(dtype, "cpu"))
        return
    if tools:
        fail("--tools goes with --against", EXIT_USAGE)
    if concurrency is not None:
        _load(workload, model, concurrency, systems, repeats=repeats, max_batch=max_batch,
              max_new_tokens=max_new_tokens, device=device, dtype=dtype, temperature=temperature,
              out=out, json_out=json_out, quantize=quantize)
        return
    _check_temperature(temperature)
    if max_new_tokens is not None and max_new_tokens < 1:
        fail(f"max-new-tokens must be a positive integer, got {max_new_tokens}", EXIT_USAGE)
    if samples < 1:
        fail(f"samples must be a positive integer, got {samples}", EXIT_USAGE)
    if systems is not None:
        parse_systems(systems)  # bad names fail before anything loads
    if prefix_cache_mb is not None and not prefix_cache_mb >= 0:
        fail(f"prefix-cache-mb must be >= 0, got {prefix_cache_mb}", EXIT_USAGE)
    device, dtype, quantize = placement(model, device, dtype, quantize)
    from agentspec.bench.results import BenchConfig
    from agentspec.bench.workload import load_workload, resolve_workload

    path = resolve_workload(workload)  # neither a file nor a shipped name: ValueError, exit 2
    names = parse_systems(systems or (CORE_SYSTEMS if path.stem == "prompts" else DEFAULT_SYSTEMS))
    if lines is not None and (temperature > 0 or "agentspec" not in names):
        fail("--lines needs a greedy run (temperature 0) with the agentspec system, whose "
             f"warmup outputs it writes; got temperature {temperature}, systems "
             f"{','.join(names)}", EXIT_USAGE)
    loaded = load_workload(path, default_max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS)
    for line, error in loaded.errors:
        err_console.print(f"warning: {path}:{line}: skipped: {error}", markup=False)
    config = BenchConfig(systems=tuple(names), temperature=temperature,
                         max_new_tokens=max_new_tokens, samples=samples, db=db, device=device,
                         dtype=dtype, quantize=quantize, lines_out=lines,
                         prefix_cache_bytes=None if prefix_cache_mb is None
                         else int(prefix_cache_mb * 2**20))
    _run_and_report(loaded, model, config, json_out=json_out, out=out, plot=plot, report=report)


def parse_levels(text: str) -> list[int]:
    """``"1,4,8"`` -> ``[1, 4, 8]``, checked: integers >= 1."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        fail(f"concurrency must be comma-separated integers >= 1, got {text!r}", EXIT_USAGE)
    return levels


def _load(workload: str, model: str, concurrency: str, systems: str | None, *, repeats: int,
          max_batch: int | None, max_new_tokens: int | None, device: str | None,
          dtype: str | None, temperature: float, out: Path | None, json_out: bool,
          quantize: str | None = None) -> None:
    """``--concurrency``: the load bench (:mod:`agentspec.bench.load`)."""
    from agentspec.bench.load import DEFAULT_LOAD_SYSTEMS, LOAD_SYSTEMS

    levels = parse_levels(concurrency)
    names = [s.strip() for s in (systems or ",".join(DEFAULT_LOAD_SYSTEMS)).split(",") if s.strip()]
    bad = [n for n in names if n not in LOAD_SYSTEMS]
    if bad or not names:
        fail(f"with --concurrency, systems are among {', '.join(LOAD_SYSTEMS)}, got "
             f"{systems!r}", EXIT_USAGE)
    if temperature != 0:
        fail(f"--concurrency measures greedy decoding, got temperature {temperature}", EXIT_USAGE)
    if repeats < 1:
        fail(f"repeats must be a positive integer, got {repeats}", EXIT_USAGE)
    if max_batch is not None and max_batch < 1:
        fail(f"max-batch must be a positive integer, got {max_batch}", EXIT_USAGE)
    if max_new_tokens is not None and max_new_tokens < 1:
        fail(f"max-new-tokens must be a positive integer, got {max_new_tokens}", EXIT_USAGE)
    device, dtype, quantize = placement(model, device, dtype, quantize)
    import torch

    from agentspec.bench import load as load_mod
    from agentspec.bench import report as report_mod
    from agentspec.bench.results import DTYPES
    from agentspec.bench.workload import load_workload, resolve_workload

    path = resolve_workload(workload)
    loaded = load_workload(path, default_max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS)
    for line, error in loaded.errors:
        err_console.print(f"warning: {path}:{line}: skipped: {error}", markup=False)
    with progress() as bar:
        task = bar.add_task("load", total=None)

        def tick(label: str) -> None:
            bar.update(task, description=label)
            if not err_console.is_terminal:
                err_console.print(label, markup=False)

        summary = load_mod.run_load(loaded, model, systems=names, concurrencies=levels,
                                    repeats=repeats, max_new_tokens=max_new_tokens,
                                    device=device, dtype=DTYPES[dtype] if dtype == "gguf"
                                    else getattr(torch, DTYPES[dtype]),
                                    max_batch=max_batch, on_progress=tick, quantize=quantize)
    shown = err_console if json_out else console
    shown.print(load_mod.rich_table(summary), width=max(console.width, 150))
    if out is not None:
        report_mod.write_json(summary, out)
    if json_out:
        print_json(summary)
    wrong = [f"{r['system']}@{r['concurrency']}: {r['exact']}" for r in summary["rows"]
             if r["exact"] is not None and r["exact"] < 1.0]
    if wrong:
        fail(f"outputs differ from agentspec-plain alone: {', '.join(wrong)}")


def _run_and_report(loaded: Any, model: str, config: Any, *, json_out: bool, out: Path | None,
                    plot: Path | None, report: Path | None) -> None:
    """Run the bench with a progress bar, print the table and notes, write the outputs."""
    from agentspec.bench import harness
    from agentspec.bench import report as report_mod

    with progress() as bar:
        task = bar.add_task("bench", total=None)

        def tick(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=label.split(":")[0])
            if not err_console.is_terminal:  # a log: one line per request instead of a bar
                err_console.print(f"[{done}/{total}] {label}", markup=False)

        result = harness.run_bench(loaded, model, config, on_progress=tick)
    summary = report_mod.summarize(result)
    for note in summary["notes"]:
        err_console.print(f"note: {note}", markup=False)
    shown = err_console if json_out else console  # --json: stdout holds the JSON alone
    shown.print(report_mod.rich_table(summary), width=max(console.width, 150))
    for line in (report_mod.versus_line(summary), report_mod.cached_line(summary)):
        if line:
            shown.print(line, markup=False)
    if out is not None:
        report_mod.write_json(summary, out)
    if json_out:
        print_json(summary)
    if plot is not None:
        report_mod.plot(summary, plot)
    if report is not None:
        report_mod.write_markdown(summary, report)
    fail_on_mismatch(summary)


def fail_on_mismatch(summary: dict[str, Any]) -> None:
    """Exit 1 when an agentspec system breaks its promise.

    In fp32 the promise is identity with hf-greedy. In bf16/fp16 transformers' kernels round
    differently from agentspec's fixed-width forwards, so the promise is identity with
    ``agentspec-plain`` (the ``same_as_plain`` figure), and hf-greedy's match is reported.
    transformers' own variants (hf-pld, hf-static) are baselines: reported, never failed on.
    """
    bad = {k: v for k, v in summary["exact_match"].items() if v is not None and v < 1.0}
    bad.update({k: v["p_value"] for k, v in summary.get("distribution_check", {}).items()
                if not v["ok"]})
    reduced = summary.get("dtype") not in (None, "fp32", "float32")
    reported = {k: v for k, v in bad.items()
                if k.startswith("hf-") or (reduced and k.startswith("agentspec"))}
    if reported:
        err_console.print(f"warning: outputs differ from hf-greedy: {reported} (see the report)",
                          markup=False)
    own = {k: v for k, v in bad.items() if k not in reported}
    own.update({f"{k} vs agentspec-plain": v for k, v in summary.get("same_as_plain", {}).items()
                if v < 1.0})
    if own:
        fail(f"outputs differ: {own} (see the report)")


@bench_app.command("build-bfcl")
@handles_errors
def build_bfcl(
    out: Annotated[Path, typer.Option("--out", help="The workload file to write.")],
    tasks: Annotated[str | None, typer.Option(
        "--tasks", help="Comma-separated BFCL task ids; default the default tasks.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = DEFAULT_MAX_NEW_TOKENS,
    model: Annotated[str, typer.Option("--model")] = "smollm2-135m-instruct",
    max_calls_per_turn: Annotated[int | None, typer.Option(
        "--max-calls-per-turn", help="LLM calls per user turn at most; default bfcl's.")] = None,
    grammar: Annotated[bool, typer.Option(
        "--grammar/--no-grammar", help="Constrain every reply to a valid list of calls of the "
                                       "task's tools, or plain text (each line carries its "
                                       "grammar, so the bench decodes under it too).")] = True,
) -> None:
    """Run the BFCL agent with agentspec (greedy, exact) and write its calls as a workload;
    prints how many of its tool-call replies parse as calls of the task's tools.

    Example: agentspec bench build-bfcl --out agentspec/bench/data/bfcl.jsonl
    """
    if max_new_tokens < 1:
        fail(f"max-new-tokens must be a positive integer, got {max_new_tokens}", EXIT_USAGE)
    from agentspec.bench import bfcl
    from agentspec.bench.workload import write_workload

    ids = [t.strip() for t in tasks.split(",") if t.strip()] if tasks else bfcl.DEFAULT_TASK_IDS
    try:
        task_list = bfcl.load_tasks(ids)
    except KeyError as e:
        fail(str(e.args[0]), EXIT_USAGE)
    from agentspec import SamplingParams, Speculator, load_target
    from agentspec.grammar import compiled

    spec = Speculator(load_target(model), memory=None)  # prompt lookup, greedy: the trace is plain decoding's
    calls = 0

    def generate(messages: list[dict[str, str]], spec_grammar: Any) -> str:
        nonlocal calls
        calls += 1
        err_console.print(f"call {calls}", end="\r", markup=False) if err_console.is_terminal \
            else None
        sampling = SamplingParams(grammar=None if spec_grammar is None else compiled(spec_grammar))
        return str(spec.generate(messages, max_new_tokens, sampling=sampling).text)

    per_turn = max_calls_per_turn or bfcl.DEFAULT_MAX_CALLS_PER_TURN
    if per_turn < 1:
        fail(f"max-calls-per-turn must be a positive integer, got {per_turn}", EXIT_USAGE)
    traces: list[Any] = []
    items = bfcl.build_workload(task_list, generate, max_new_tokens=max_new_tokens,
                                max_calls_per_turn=per_turn, constrain=grammar,
                                traces_out=traces)
    n = write_workload(out, items)
    warm = sum(i.phase == "warmup" for i in items)
    parsed = bfcl.parse_summary(traces, task_list)
    rate = "n/a" if parsed["parse_rate"] is None else f"{parsed['parse_rate']:.0%}"
    console.print(f"wrote {n} calls ({warm} warmup, {n - warm} measure) of {len(task_list)} "
                  f"tasks to {out}; {parsed['call_replies']} of {parsed['replies']} replies "
                  f"were tool calls, {parsed['valid_call_replies']} of them ({rate}) calls of "
                  f"the task's tools ({'with' if grammar else 'without'} the grammar)")


@bench_app.command("build-bfcl-live")
@handles_errors
def build_bfcl_live(
    out: Annotated[Path, typer.Option("--out", help="The workload file to write.")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 96,
    choice: Annotated[str, typer.Option(
        "--choice", help="Each reply's grammar: 'required' (a JSON list of calls of the tool "
        "set's tools), 'auto' (such a list or plain text) or 'none' (unconstrained).")] = "required",
    tool_sets: Annotated[int, typer.Option("--tool-sets", help="How many tool sets.")] = 6,
    warmup: Annotated[int, typer.Option("--warmup", help="Warmup requests per tool set.")] = 10,
    measure: Annotated[int, typer.Option("--measure", help="Measured requests per tool set.")] = 4,
    skip: Annotated[int, typer.Option(
        "--skip", help="Leave out the most frequent qualifying tool sets: --skip 6 --tool-sets "
                       "9 --warmup 6 --measure 4 gives held-out tool sets, none of them in "
                       "the shipped bfcl-live.")] = 0,
    one_agent: Annotated[bool, typer.Option(
        "--one-agent", help="Send the requests to one agent holding every chosen tool set's "
                            "tools: one system prompt listing them all (~4,000 tokens with "
                            "the defaults), one grammar over them all, one scope.")] = False,
) -> None:
    """Write the single-turn BFCL workload (live_multiple requests over recurring tool sets).

    Example: agentspec bench build-bfcl-live --out agentspec/bench/data/bfcl-live.jsonl
    """
    if max_new_tokens < 1:
        fail(f"max-new-tokens must be a positive integer, got {max_new_tokens}", EXIT_USAGE)
    if choice not in ("required", "auto", "none"):
        fail(f"choice must be required, auto or none, got {choice!r}", EXIT_USAGE)
    from agentspec.bench import bfcl_live
    from agentspec.bench.workload import write_workload

    try:
        items = bfcl_live.build_workload(bfcl_live.load_entries(), max_new_tokens=max_new_tokens,
                                         choice=None if choice == "none" else choice,
                                         tool_sets=tool_sets, warmup=warmup, measure=measure,
                                         skip=skip, one_agent=one_agent)
    except ValueError as e:
        fail(str(e), EXIT_USAGE)
    n = write_workload(out, items)
    warm = sum(i.phase == "warmup" for i in items)
    held = "one agent" if one_agent else f"{len({i.scope for i in items})} tool sets"
    console.print(f"wrote {n} calls ({warm} warmup, {n - warm} measure) over {held} to {out}")


@bench_app.command("build-humaneval")
@handles_errors
def build_humaneval(
    out: Annotated[Path, typer.Option("--out", help="The workload file to write.")],
    warmup: Annotated[int, typer.Option("--warmup", help="Problems that fill the memory.")] = 10,
    measure: Annotated[int, typer.Option("--measure", help="Problems measured.")] = 40,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 128,
) -> None:
    """Write a code-completion workload from HumanEval (one problem per line, one scope).

    Example: agentspec bench build-humaneval --out out/humaneval.jsonl
    """
    from agentspec.bench import humaneval
    from agentspec.bench.workload import write_workload

    try:
        items = humaneval.build_workload(humaneval.load_problems(), warmup=warmup,
                                         measure=measure, max_new_tokens=max_new_tokens)
    except ValueError as e:
        fail(str(e), EXIT_USAGE)
    n = write_workload(out, items)
    console.print(f"wrote {n} calls ({warmup} warmup, {measure} measure) to {out}")
