"""``agentspec bench --concurrency 1,4,8,16``: many agents at once on one engine.

At each concurrency ``c``, ``c`` clients (threads) run the workload's measured requests on one
Speculator, closed loop: a client takes the next request as soon as its last one ends, so ``c``
requests are live at once until the list runs out. The systems take turns at every level, the
order rotated from one pass to the next, so a slow phase of a shared machine falls on each
alike; with ``--repeats`` each level is run that many times and the median pass counts.

Systems (their names as the bench's, each on its own fork of the target, so a pool and its
cached prompts are a system's own):

- ``agentspec-plain``: the engine without drafts (``speculate=False``), prefix reuse on: plain
  batched decoding, the baseline of every level.
- ``agentspec-suffix``: suffix matching over earlier outputs and prompt lookup (a store of its
  own); the best draftless method of the field on agent traffic.
- ``agentspec-pld``: prompt lookup alone.
- ``agentspec``: every drafter and a completion memory.
- ``agentspec-oracle`` (on request): a drafter that drafts each request's own known output
  (:class:`OracleDrafter`, the outputs of an untimed solo run of ``agentspec-plain``), every
  token of which the target accepts. Its tokens per second are what no drafter can beat in
  this engine on this machine at that load: where a figure is out of the oracle's reach, the
  verifying forward's cost, not the drafts, holds it.

Every system but ``agentspec-plain`` (which learns nothing from earlier calls) first runs the
workload's warmup lines one at a time (recorded: the memories are filled as in use). The measured passes record nothing (``record=False``), so no pass drafts
from another pass's outputs and every level meets the same memory. Before each pass a
system's pool is emptied and the warmup prompts are prefilled into it again, so every pass
starts from the same cached prompts whatever ran before it.

Per pass: aggregate tokens per second (every output token over the pass's wall time), each
request's time to first token (from the call to its first step's tokens, queueing and prefill
included) and per-token latency (its time after the first token over its tokens after the
first), their medians and 99th percentiles, tokens per step, and whether each output equals
the same request's output alone (concurrency 1) on ``agentspec-plain``: the promise is that
no system, at no concurrency, changes a token.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from agentspec.bench.results import grammar_of, prompt_of
from agentspec.bench.workload import Workload, WorkloadItem
from agentspec.text import cut_at_stop

LOAD_SYSTEMS = ("agentspec-plain", "agentspec-pld", "agentspec-suffix", "agentspec",
                "agentspec-oracle")
DEFAULT_LOAD_SYSTEMS = ("agentspec-plain", "agentspec-suffix", "agentspec")
REFERENCE = "agentspec-plain"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Call:
    """One request of a pass."""

    id: str
    token_ids: tuple[int, ...]
    seconds: float
    first_token_seconds: float
    steps: int

    @property
    def per_token_seconds(self) -> float:
        """Its time after the first token over its tokens after the first."""
        return (self.seconds - self.first_token_seconds) / max(len(self.token_ids) - 1, 1)


@dataclass(frozen=True)
class Pass:
    """One system's run of the measured requests at one concurrency."""

    system: str
    concurrency: int
    seconds: float
    calls: tuple[Call, ...]

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.calls)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class OracleDrafter:
    """Drafts a request's known output from where its generated tokens stand (bench only).

    ``outputs``: prompt token ids -> that prompt's greedy output; filled before the passes. A
    request whose prompt is unknown, or whose generated tokens left the known output, gets no
    draft. The draft is as long as the drafter chain allows (``max_tokens``), so the
    scheduler's sizing by marginal cost still decides how much of it a step carries.
    """

    name = "oracle"

    def __init__(self) -> None:
        self.outputs: dict[tuple[int, ...], tuple[int, ...]] = {}

    def begin(self, context: Any) -> None:
        pass

    def propose(self, context: Any, *, max_tokens: int) -> Any:
        from agentspec.types import EMPTY_DRAFT, Draft

        known = self.outputs.get(tuple(context.tokens[:context.prompt_len]))
        done = context.tokens[context.prompt_len:]
        if known is None or max_tokens < 1 or tuple(done) != known[:len(done)]:
            return EMPTY_DRAFT
        ahead = known[len(done):len(done) + max_tokens]
        return Draft.chain(ahead, self.name) if ahead else EMPTY_DRAFT

    def observe(self, context: Any, draft: Any, verdict: Any) -> None:
        pass

    def end(self, context: Any) -> None:
        pass


def teach_oracle(oracle: OracleDrafter, reference: Any, items: Sequence[WorkloadItem],
                 budget: int | None) -> None:
    """Fill ``oracle`` with ``reference``'s outputs of ``items``, one at a time, untimed."""
    from agentspec import SamplingParams

    for item in items:
        gen = reference.generate(prompt_of(item), budget or item.max_new_tokens or 128,
                                 sampling=SamplingParams(grammar=grammar_of(item)),
                                 scope=item.scope, record=False)
        oracle.outputs[tuple(reference.encode(prompt_of(item)))] = tuple(gen.token_ids)


T = TypeVar("T")
R = TypeVar("R")


def closed_loop(items: Sequence[T], concurrency: int, call: Callable[[T], R],
                *, name: str = "bench-client") -> tuple[float, list[R], BaseException | None]:
    """``call`` on every item by ``concurrency`` client threads, closed loop: a client takes
    the next item as soon as its last call returns. The first error stops the clients.

    Returns:
        The wall time, the results in item order (those that finished), and the first error
        (or None).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    queue = list(enumerate(items))
    lock = threading.Lock()
    results: dict[int, R] = {}
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                if not queue or errors:
                    return
                index, item = queue.pop(0)
            try:
                results[index] = call(item)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                with lock:
                    errors.append(e)
                return

    threads = [threading.Thread(target=client, name=f"{name}-{i}", daemon=True)
               for i in range(min(concurrency, len(items)))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    return seconds, [results[i] for i in sorted(results)], errors[0] if errors else None


def run_pass(spec: Any, items: Sequence[WorkloadItem], concurrency: int, budget: int | None,
             *, system: str = "") -> Pass:
    """The requests ``items`` on ``spec`` by ``concurrency`` clients at once (closed loop);
    ``budget``: every request's token budget (None: each item's own)."""
    from agentspec import SamplingParams

    def call(item: WorkloadItem) -> Call:
        started = time.perf_counter()
        gen = spec.generate(prompt_of(item), budget or item.max_new_tokens or 128,
                            sampling=SamplingParams(grammar=grammar_of(item)),
                            scope=item.scope, record=False)
        seconds = time.perf_counter() - started
        # The generation's clock starts after the prompt is encoded; the pass's before.
        first = gen.stats.first_token_seconds + (seconds - gen.stats.seconds)
        tokens = cut_at_stop(gen.token_ids, spec.stop_token_ids)[0]
        return Call(item.id, tuple(tokens), seconds, first, gen.stats.steps)

    seconds, calls, error = closed_loop(items, concurrency, call)
    if error is not None:
        raise error
    return Pass(system, concurrency, seconds, tuple(calls))


def build_load_systems(target: Any, names: Sequence[str], tmp: Path, *,
                       max_batch: int | None = None) -> dict[str, Any]:
    """Each named system's Speculator on a fork of ``target`` (see the module docstring);
    ``max_batch``: the most requests each steps at once (default SpecConfig's)."""
    from agentspec import SpecConfig, Speculator
    from agentspec.bench.harness import memory_speculator, suffix_speculator

    bad = [n for n in names if n not in LOAD_SYSTEMS]
    if bad or not names:
        raise ValueError(f"load systems are among {', '.join(LOAD_SYSTEMS)}, got {list(names)}")
    config = SpecConfig(draft_head=False)
    if max_batch is not None:
        config = SpecConfig(draft_head=False, max_batch=max_batch)
    built: dict[str, Any] = {}
    for name in names:
        if name == "agentspec-plain":
            built[name] = Speculator(target.fork(), speculate=False, memory=None, config=config)
        elif name == "agentspec-pld":
            built[name] = Speculator(target.fork(), memory=None, config=config)
        elif name == "agentspec-suffix":
            built[name] = suffix_speculator(target, f"sqlite:///{tmp / 'suffix.db'}", config)
        elif name == "agentspec-oracle":
            built[name] = Speculator(target.fork(), memory=None, config=config,
                                     drafters=[OracleDrafter()])
        else:
            built[name] = memory_speculator(target, f"sqlite:///{tmp / 'memory.db'}", config)
        built[name].warmup()
    return built


def warm(spec: Any, items: Sequence[WorkloadItem], budget: int | None) -> None:
    """The warmup lines, one at a time, recorded (a memory is filled as in use)."""
    from agentspec import SamplingParams

    for item in items:
        spec.generate(prompt_of(item), budget or item.max_new_tokens or 128,
                      sampling=SamplingParams(grammar=grammar_of(item)), scope=item.scope)


def reset_pool(spec: Any, items: Sequence[WorkloadItem]) -> None:
    """Empty ``spec``'s pool and prefill the warmup prompts into it again: every pass starts
    from the same cached prompts."""
    target = spec.target
    target.pool.clear_cache()
    seq = target.new_sequence()
    try:
        for item in items:
            target.prefill(seq, spec.encode(prompt_of(item)))
    finally:
        seq.release()


def run_load(workload: Workload, model: str, *, systems: Sequence[str] = DEFAULT_LOAD_SYSTEMS,
             concurrencies: Sequence[int] = (1, 4, 8, 16), repeats: int = 1,
             max_new_tokens: int | None = None, device: str | None = None,
             dtype: Any = None, max_batch: int | None = None,
             on_progress: Progress | None = None, quantize: str | None = None) -> dict[str, Any]:
    """Every system at every concurrency (see the module docstring); returns the summary
    (:func:`summarize`) with every pass. ``device``, ``dtype`` and ``quantize`` as
    :func:`agentspec.load_target` takes them."""
    from agentspec import load_target

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not concurrencies or min(concurrencies) < 1:
        raise ValueError(f"concurrencies must be integers >= 1, got {list(concurrencies)}")
    levels = sorted(set(concurrencies) | {1})  # the solo outputs are every check's reference
    names = list(dict.fromkeys([REFERENCE, *systems]))
    target = load_target(model, device=device, dtype=dtype, quantize=quantize)
    passes: list[Pass] = []
    with tempfile.TemporaryDirectory(prefix="agentspec-load-") as tmp:
        specs = build_load_systems(target, names, Path(tmp), max_batch=max_batch)
        for name, spec in specs.items():
            if name == REFERENCE:  # it learns nothing from earlier calls
                continue
            if name == "agentspec-oracle":
                if on_progress:
                    on_progress(f"the oracle's outputs: {len(workload.measure)} lines")
                teach_oracle(spec.drafters[0], specs[REFERENCE], workload.measure,
                             max_new_tokens)
                # Untimed, so its drafter chain has learned how far its drafts hold.
                run_pass(spec, workload.measure, 1, max_new_tokens, system=name)
                continue
            if on_progress:
                on_progress(f"warmup {name}: {len(workload.warmup)} lines")
            warm(spec, workload.warmup, max_new_tokens)
        turn = 0
        for level in levels:
            for _ in range(repeats):
                for name in names[turn % len(names):] + names[: turn % len(names)]:
                    reset_pool(specs[name], workload.warmup)
                    done = run_pass(specs[name], workload.measure, level, max_new_tokens,
                                    system=name)
                    passes.append(done)
                    if on_progress:
                        on_progress(f"{name} at {level}: {done.tokens_per_second:.1f} tok/s")
                turn += 1
        for spec in specs.values():
            close = getattr(spec.memory, "close", None)
            if callable(close):
                close()
    out = summarize(passes)
    out.update({"workload": str(workload.path), "model": model, "device": str(target.device),
                "dtype": _weights_mode(target.model),
                "repeats": repeats, "requests": len(workload.measure),
                "warmup": len(workload.warmup)})
    return out


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(passes: Sequence[Pass]) -> dict[str, Any]:
    """Per system and concurrency, the median pass's figures; outputs checked against
    :data:`REFERENCE` alone."""
    reference = {c.id: c.token_ids for p in passes
                 if p.system == REFERENCE and p.concurrency == 1 for c in p.calls}
    table: dict[str, dict[str, Any]] = {}  # "system@level" -> its row
    groups: dict[tuple[str, int], list[Pass]] = {}
    for p in passes:
        groups.setdefault((p.system, p.concurrency), []).append(p)
    for (system, level), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        median = sorted(runs, key=lambda p: p.tokens_per_second)[len(runs) // 2]
        calls = [c for p in runs for c in p.calls]
        steps = sum(c.steps for c in median.calls)
        solo = groups.get((system, 1))
        solo_rate = statistics.median(p.tokens_per_second for p in solo) if solo else 0.0
        exact = [c.token_ids == reference.get(c.id) for c in calls if c.id in reference]
        row: dict[str, Any] = {
            "system": system, "concurrency": level, "passes": len(runs),
            "tokens_per_second": round(median.tokens_per_second, 2),
            "x_solo": round(median.tokens_per_second / solo_rate, 3) if solo_rate else None,
            "tokens": median.tokens, "seconds": round(median.seconds, 3),
            "tokens_per_step": round(median.tokens / steps, 3) if steps else None,
            "per_token_ms_p50": round(1e3 * percentile([c.per_token_seconds for c in calls], 0.5), 2),
            "per_token_ms_p99": round(1e3 * percentile([c.per_token_seconds for c in calls], 0.99), 2),
            "ttft_ms_p50": round(1e3 * percentile([c.first_token_seconds for c in calls], 0.5), 1),
            "ttft_ms_p99": round(1e3 * percentile([c.first_token_seconds for c in calls], 0.99), 1),
            "exact": round(sum(exact) / len(exact), 4) if exact else None,
        }
        table[f"{system}@{level}"] = row
    by_level: dict[int, dict[str, float]] = {}
    for row in table.values():
        by_level.setdefault(int(row["concurrency"]), {})[str(row["system"])] = float(
            row["tokens_per_second"])
    versus = {str(level): {s: round(r / rates[REFERENCE], 3) for s, r in rates.items()
                           if s != REFERENCE and rates.get(REFERENCE)}
              for level, rates in sorted(by_level.items())}
    return {"rows": list(table.values()), "versus_plain": versus,
            "passes": [{**asdict(p), "calls": [asdict(c) for c in p.calls]} for p in passes]}


def rich_table(summary: dict[str, Any]) -> Any:
    """The summary's rows as a rich table."""
    from rich.table import Table

    table = Table(title=f"{summary.get('workload', '')}: {summary.get('requests', '?')} requests "
                        f"by concurrency ({summary.get('device', '')}, {summary.get('dtype', '')})")
    for col in ("concurrency", "system", "tok/s", "x solo", "x plain", "tok/step", "per-token ms p50/p99",
                "TTFT ms p50/p99", "exact"):
        table.add_column(col, justify="left" if col == "system" else "right")
    versus = summary.get("versus_plain", {})
    for row in summary["rows"]:
        plain = versus.get(str(row["concurrency"]), {}).get(row["system"])
        table.add_row(str(row["concurrency"]), row["system"], f"{row['tokens_per_second']:.1f}",
                      "-" if row["x_solo"] is None else f"{row['x_solo']:.2f}x",
                      "-" if plain is None else f"{plain:.2f}x",
                      "-" if row["tokens_per_step"] is None else f"{row['tokens_per_step']:.2f}",
                      f"{row['per_token_ms_p50']:.1f} / {row['per_token_ms_p99']:.1f}",
                      f"{row['ttft_ms_p50']:.0f} / {row['ttft_ms_p99']:.0f}",
                      "-" if row["exact"] is None else f"{row['exact']:.2f}")
    return table


def _weights_mode(model: Any) -> str:
    from agentspec.engine.quant.model import weights_mode

    return weights_mode(model)
