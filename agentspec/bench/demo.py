"""``agentspec demo``: a BFCL tool-calling agent, plain decoding against agentspec, call by call.

The agent of :mod:`agentspec.bench.bfcl` plays a few BFCL multi-turn file-system tasks on
BFCL's own tool implementations. Every LLM call it makes runs twice on the same loaded target,
side by side: plain decoding (``Speculator(target, speculate=False)``) and agentspec with a
completion memory (a fresh SQLite file in a temporary folder, or ``--db``); which runs first
alternates call by call. Greedy outputs must be token-identical, and the agent goes on with
that completion. The tasks are played twice: a cold pass (empty memory) and a warm pass (the
memory holds the cold pass's completions), to show what the memory buys an agent that repeats
itself. Times are wall clock around ``generate`` (agentspec's include memory lookup and record).
The agent calls its tools through the grammar (:func:`agentspec.bench.bfcl.task_grammar`: each
reply is a JSON list of calls of the task's tools, valid under their schemas, or plain text);
``--no-grammar`` lets the model write free text, to see what the grammar saves (malformed calls).

Exit codes: 0 every output matched, 1 an output differed (or a failure), 2 bad input.

The command is :mod:`agentspec.cli.demo`.

Example: agentspec demo --tasks multi_turn_base_26 --max-new-tokens 64 --out out/demo.json
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agentspec.bench import bfcl
from agentspec.bench.toolcalls import ToolCall, ToolEnvironment, parse_tool_calls
from agentspec.config import SamplingParams
from agentspec.grammar import compiled
from agentspec.terminal import output_width
from agentspec.text import cut_at_stop

MODEL = "smollm2-135m-instruct"
# Two file-system tasks of 3 user turns, using mostly the documented tools. Each call prefills
# ~1100 prompt tokens (a few seconds on 2 CPU cores, per system): at most 2 calls per turn keep
# both passes (<= 12 calls each) within about 5 minutes.
DEFAULT_TASK_IDS = ("multi_turn_base_26", "multi_turn_base_12")
DEFAULT_MAX_CALLS_PER_TURN = 2
DEFAULT_MAX_NEW_TOKENS = 96
PASSES = ("cold", "warm")


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs.

    Attributes:
        task_ids: BFCL ``multi_turn_base`` task ids, in order.
        max_new_tokens: budget of every LLM call.
        max_turns, max_calls_per_turn: user turns per task (None: all), LLM calls per turn.
        db: memory database (SQLAlchemy URL); None: a fresh SQLite file in a temporary folder.
        model: the target.
        grammar: constrain every reply to the task's tool-call grammar; False: free text.
    """

    task_ids: tuple[str, ...] = DEFAULT_TASK_IDS
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_turns: int | None = None
    max_calls_per_turn: int = DEFAULT_MAX_CALLS_PER_TURN
    db: str | None = None
    model: str = MODEL
    grammar: bool = True

    def __post_init__(self) -> None:
        if not self.task_ids:
            raise ValueError("task_ids must name at least one BFCL task, got none")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 or None, got {self.max_turns}")
        if self.max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {self.max_calls_per_turn}")


@dataclass(frozen=True)
class CallResult:
    """One LLM call of the agent, run by both systems.

    Attributes:
        pass_name, task_id, turn, call: ``"cold"``/``"warm"``, where (turn, call 0-based).
        new_tokens: tokens of plain decoding's completion (stop token included).
        plain_seconds, spec_seconds, spec_steps: each system's ``generate`` wall time;
            agentspec's decoding steps (target forwards).
        accepted: agentspec's accepted draft tokens by source.
        exact: the two completions are token-identical.
        malformed: the reply's tool calls that did not parse (each goes back to the agent as
            an error); none under the grammar but one cut short by the token budget.
    """

    pass_name: str
    task_id: str
    turn: int
    call: int
    new_tokens: int
    plain_seconds: float
    spec_seconds: float
    spec_steps: int
    accepted: dict[str, int]
    exact: bool
    malformed: int = 0

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.spec_seconds if self.spec_seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.spec_steps if self.spec_steps else 0.0


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def reply_calls(text: str, *, constrained: bool) -> tuple[list[ToolCall], list[str]]:
    """A reply's tool calls and malformed-call errors, read as the agent reads them
    (:func:`agentspec.bench.bfcl.run_task`): under the grammar a reply is a call list exactly
    when it starts with ``[`` (the grammar's two branches), else it is an answer."""
    if constrained and not text.lstrip().startswith("["):
        return [], []
    return parse_tool_calls(text)


class SideBySide:
    """The agent's ``generate``: each call runs on both systems and returns the completion.

    Plain decoding's completion is the reference the agent continues with; when agentspec's
    differs, the call is counted as a mismatch (greedy decoding must make them identical).

    Args:
        plain: ``Speculator(target, speculate=False)``.
        spec: a ``Speculator`` with a memory, on the same target.
        max_new_tokens: budget of every call.
        on_call: called with each result and its completion text, as soon as it is known.
    """

    def __init__(self, plain: Any, spec: Any, *, max_new_tokens: int,
                 on_call: Callable[[CallResult, str], None]) -> None:
        self.plain, self.spec = plain, spec
        self.max_new_tokens = max_new_tokens
        self.on_call = on_call
        self.results: list[CallResult] = []
        self._where = ("cold", "", "default")  # pass, task id, memory scope
        self._users, self._turn, self._call = -1, -1, 0

    def begin(self, pass_name: str, task: bfcl.Task) -> None:
        """Start a task's calls (they share the memory scope of its main tool class)."""
        self._where = (pass_name, task.id, f"bfcl-{bfcl.main_class(task)}")
        self._users, self._turn, self._call = -1, -1, 0

    def __call__(self, messages: list[dict[str, str]], grammar: Any = None) -> str:
        # A new user message opens a turn (tool results use the "tool" role).
        users = sum(m["role"] == "user" for m in messages)
        if users != self._users:
            self._users, self._turn, self._call = users, self._turn + 1, 0
        else:
            self._call += 1
        order = ["plain", "agentspec"]
        if len(self.results) % 2:  # alternate who runs first: neither gets a warmer machine
            order.reverse()
        sampling = SamplingParams(grammar=None if grammar is None else compiled(grammar))
        runs = {name: self._timed(name, messages, sampling) for name in order}
        (plain, plain_s), (spec, spec_s) = runs["plain"], runs["agentspec"]
        stop_ids = self.plain.stop_token_ids
        pass_name, task_id, _ = self._where
        _, errors = reply_calls(str(plain.text), constrained=grammar is not None)
        result = CallResult(
            pass_name, task_id, self._turn, self._call, len(plain.token_ids), plain_s, spec_s,
            spec.stats.steps, dict(spec.stats.accepted_by_source),
            cut_at_stop(plain.token_ids, stop_ids) == cut_at_stop(spec.token_ids, stop_ids),
            len(errors))
        self.results.append(result)
        self.on_call(result, plain.text)
        return str(plain.text)

    def _timed(self, name: str, messages: list[dict[str, str]],
               sampling: SamplingParams) -> tuple[Any, float]:
        started = time.perf_counter()
        if name == "plain":
            gen = self.plain.generate(messages, self.max_new_tokens, record=False,
                                      sampling=sampling)
        else:
            gen = self.spec.generate(messages, self.max_new_tokens, scope=self._where[2],
                                     sampling=sampling)
        return gen, time.perf_counter() - started


class _EchoEnvironment(ToolEnvironment):
    """BFCL's tools, reporting every executed call and its result."""

    def __init__(self, task: bfcl.Task, show: Callable[[ToolCall, str], None]) -> None:
        super().__init__(task)
        self._show = show

    def execute(self, call: ToolCall) -> str:
        result = super().execute(call)
        self._show(call, result)
        return result


# --- live output ----------------------------------------------------------------------------
def _short(text: str, width: int = 90) -> str:
    text = " ".join(text.split())
    return escape(text if len(text) <= width else text[: width - 3] + "...")


def _accepted(accepted: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(accepted.items()) if v) or "-"


class Reporter:
    """Prints the demo as it runs: one line per LLM call, then its tool calls and results.
    ``constrained``: the replies were decoded under the tool-call grammar (see :func:`reply_calls`)."""

    def __init__(self, console: Console, *, constrained: bool = True) -> None:
        self.console = console
        self.constrained = constrained

    def pass_header(self, pass_name: str) -> None:
        what = "memory empty" if pass_name == "cold" else "memory filled by the cold pass"
        self.console.rule(f"[bold]{pass_name} pass[/] ({what})")
        self.console.print("[dim]task            turn call  tokens   plain tok/s  agentspec "
                           "tok/s  speedup  tok/step  accepted by source[/]", soft_wrap=True)

    def call(self, r: CallResult, text: str) -> None:
        mark = "" if r.exact else "  [bold red]OUTPUTS DIFFER[/]"
        self.console.print(
            f"{r.task_id:<18}{r.turn + 1:>2} {r.call + 1:>4}  {r.new_tokens:>6}  "
            f"{_rate(r.new_tokens, r.plain_seconds):>12.1f}  "
            f"{_rate(r.new_tokens, r.spec_seconds):>15.1f}  [bold]{r.speedup:>6.2f}x[/]  "
            f"{r.tokens_per_step:>8.2f}  {_accepted(r.accepted)}{mark}", soft_wrap=True)
        calls, errors = reply_calls(text, constrained=self.constrained)
        if not calls and not errors:
            self.console.print(f"    [dim]answer:[/] {_short(text)}")
        for error in errors:
            self.console.print(f"    [yellow]{_short(error)}[/]")

    def tool(self, call: ToolCall, result: str) -> None:
        args = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
        self.console.print(f"    [cyan]{_short(f'{call.name}({args})', 60)}[/] -> "
                           f"{_short(result, 70)}")


# --- the run ----------------------------------------------------------------------------------
def _load(config: DemoConfig, db_url: str, console: Console) -> tuple[Any, Any]:
    """The plain and the memory speculator on one loaded target, warmed up."""
    from agentspec import Speculator, load_target
    from agentspec.memory.completion import CompletionMemory

    started = time.perf_counter()
    with console.status(f"loading {config.model} (the first run converts its GGUF, ~20 s)"):
        target = load_target(config.model)
    memory = CompletionMemory.open(db_url)
    # Plain decoding as without agentspec: no prompt-prefix KV reuse across calls. agentspec
    # keeps its own KV on the same weights, so neither run inherits the other's prefill.
    from agentspec.engine.target import HFTarget

    baseline = HFTarget(target.model, target.tokenizer, name=target.name, reuse_prefix=False)
    plain, spec = Speculator(baseline, speculate=False, memory=None), Speculator(target, memory=memory)
    with console.status("loading the memory's embedder, warming up"):
        memory.embedder.embed(["warm up"])  # so that the first timed call does not load it
        hello = [{"role": "user", "content": "Say hi."}]
        plain.generate(hello, 4, record=False)
        spec.generate(hello, 4, record=False)
    console.print(f"loaded {config.model} on {target.device} in "
                  f"{time.perf_counter() - started:.1f} s; memory: {escape(db_url)}")
    return plain, spec


def run_demo(config: DemoConfig, *, console: Console | None = None) -> dict[str, Any]:
    """Play the tasks twice (cold, then warm memory), every call on both systems.

    Returns:
        The summary (see :func:`summarize`), ``"calls"`` holding every call's result.

    Raises:
        KeyError: a task id is not in BFCL's multi-turn suite (the message names it).
    """
    console = console or Console(highlight=False, width=output_width(sys.stdout))
    tasks = bfcl.load_tasks(list(config.task_ids))
    started = time.perf_counter()
    report = Reporter(console, constrained=config.grammar)
    with tempfile.TemporaryDirectory(prefix="agentspec-demo-") as tmp:
        plain, spec = _load(config, config.db or f"sqlite:///{Path(tmp) / 'memory.db'}", console)
        load_seconds = time.perf_counter() - started
        console.print("tool calls: " + ("through the grammar (a JSON list of calls of the task's "
                                        "tools, or plain text); --no-grammar: free text"
                                        if config.grammar else "free text (--no-grammar)"))
        runner = SideBySide(plain, spec, max_new_tokens=config.max_new_tokens,
                            on_call=report.call)
        try:
            for pass_name in PASSES:
                report.pass_header(pass_name)
                for task in tasks:
                    runner.begin(pass_name, task)
                    bfcl.run_task(task, runner, max_calls_per_turn=config.max_calls_per_turn,
                                  max_turns=config.max_turns, constrain=config.grammar,
                                  env=_EchoEnvironment(task, report.tool))
        finally:
            spec.memory.close()  # before the temporary folder goes
    return summarize(runner.results, config, seconds=time.perf_counter() - started,
                     load_seconds=load_seconds)


def _pass_summary(rows: Sequence[CallResult]) -> dict[str, Any]:
    tokens, steps = sum(r.new_tokens for r in rows), sum(r.spec_steps for r in rows)
    plain_s, spec_s = sum(r.plain_seconds for r in rows), sum(r.spec_seconds for r in rows)
    accepted: dict[str, int] = {}
    for r in rows:
        accepted.update({k: accepted.get(k, 0) + n for k, n in r.accepted.items()})
    return {
        "calls": len(rows), "new_tokens": tokens, "plain_seconds": plain_s,
        "agentspec_seconds": spec_s,
        "plain_tokens_per_second": _rate(tokens, plain_s),
        "agentspec_tokens_per_second": _rate(tokens, spec_s),
        "median_speedup": statistics.median(r.speedup for r in rows) if rows else None,
        "total_speedup": plain_s / spec_s if spec_s > 0 else None,
        "tokens_per_step": tokens / steps if steps else None,
        "accepted_by_source": dict(sorted(accepted.items())),
        "exact_match": sum(r.exact for r in rows),
        "malformed_calls": sum(r.malformed for r in rows),
    }


def summarize(results: Sequence[CallResult], config: DemoConfig, *, seconds: float,
              load_seconds: float) -> dict[str, Any]:
    """The machine-readable summary: per pass, plain against agentspec; exact matches.

    ``total_speedup`` is plain seconds over agentspec seconds summed over the pass's calls;
    ``median_speedup`` the median of the per-call ratios.
    """
    matched = sum(r.exact for r in results)
    return {
        **asdict(config),  # model, task_ids, max_new_tokens, max_turns, ..., db
        "passes": {p: _pass_summary([r for r in results if r.pass_name == p]) for p in PASSES},
        "exact_match": {"matched": matched, "calls": len(results),
                        "rate": matched / len(results) if results else 1.0},
        "malformed_calls": sum(r.malformed for r in results),
        "seconds": seconds, "load_seconds": load_seconds,
        # The machine may be shared: the 1/5/15-minute load at the end says how loaded it was.
        "loadavg": list(os.getloadavg()),
        "calls": [asdict(r) for r in results],
    }


def summary_table(summary: dict[str, Any]) -> Table:
    """Plain against agentspec, one row per pass."""
    table = Table(title="plain decoding vs agentspec (same target, greedy, call by call)")
    for column in ("pass", "calls", "tokens", "plain tok/s", "agentspec tok/s",
                   "median speedup", "total speedup", "tok/step", "accepted by source",
                   "exact"):
        table.add_column(column, justify="left" if column.startswith(("pass", "acc")) else "right")
    for name, p in summary["passes"].items():
        num = {k: "-" if v is None else f"{v:.2f}" for k, v in p.items()
               if v is None or isinstance(v, float)}
        table.add_row(name, str(p["calls"]), str(p["new_tokens"]),
                      num["plain_tokens_per_second"], num["agentspec_tokens_per_second"],
                      f"{num['median_speedup']}x", f"{num['total_speedup']}x",
                      num["tokens_per_step"], _accepted(p["accepted_by_source"]),
                      f"{p['exact_match']}/{p['calls']}")
    return table


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """The summary table, the exact-match line and the run time."""
    console = console or Console(highlight=False, width=output_width(sys.stdout))
    console.print(summary_table(summary), width=max(console.width, 130))
    exact = summary["exact_match"]
    style = "green" if exact["matched"] == exact["calls"] else "bold red"
    console.print(f"[{style}]exact match: {exact['matched']}/{exact['calls']} calls "
                  f"token-identical[/]; ran {summary['seconds']:.0f} s (model load "
                  f"{summary['load_seconds']:.0f} s); load average "
                  f"{' '.join(f'{x:.1f}' for x in summary['loadavg'])}")
    how = "through the grammar" if summary["grammar"] else "as free text (--no-grammar)"
    console.print(f"tool calls {how}: {summary['malformed_calls']} malformed")


# --- the command's input ----------------------------------------------------------------------
def task_ids(text: str) -> tuple[str, ...]:
    """``"29,multi_turn_base_26"`` -> full ids (a bare number is a multi_turn_base task)."""
    ids = [t.strip() for t in text.split(",") if t.strip()]
    return tuple(f"multi_turn_base_{t}" if t.isdigit() else t for t in ids)
