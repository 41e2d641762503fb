"""Where a request's time goes, phase by phase, for bench systems on a workload.

    python -m agentspec.bench.phases --workload bfcl-live --systems agentspec-pld,agentspec

Each system runs the workload's warmup lines untimed, then its measured lines with every phase
of the decode loop timed: the prompt's cached prefix found (``target.prefix``), the forwards
(``target.forward``: prompt chunks and steps), the commit, drafting (the chain's ``begin``/``propose``/``observe``/``end``), sanitising (every
proposal: the chain's sources' inside drafting, then the loop's), the grammar
(``constrain``, ``advance``, its set-up), verification, and the memory's lookup, embedding and
record (only on the thread the steps run on, the torch thread on the CPU: a write handed to
the memory's worker thread counts as its hand-over, ``memory.record_behind``, and as the wait
of a later read for it, ``memory.settle``). On CUDA each timed call is bracketed by a device synchronisation, so a
phase holds its own kernels and not the next one's wait (and the whole runs a little slower
than the bench). Prints, per system, each phase's milliseconds per request and per call;
``--out FILE`` writes them. Nested phases overlap: a chain's ``begin`` holds the memory's lookup,
which holds its embedding.

Host milliseconds per step: a request's time less its forwards (``target.forward``), per
step: what the host adds to every step (drafting, verification, the commit, bookkeeping), the
part a faster forward does not shrink.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from agentspec.bench.report import write_json
from agentspec.engine.torch_thread import for_device

SYSTEMS = ("agentspec-plain", "agentspec-pld", "agentspec-suffix", "agentspec")


class PhaseClock:
    """Accumulated seconds and calls per phase, while ``on``, on one thread: ``thread``, by
    default the one that made it (the thread the steps run on: work the memory does behind
    them on its worker thread is not theirs)."""

    def __init__(self, sync: Callable[[], None] | None = None, thread: int | None = None) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.on = False
        self._sync = sync or (lambda: None)
        self._thread = threading.get_ident() if thread is None else thread

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on or threading.get_ident() != self._thread:
                return fn(*args, **kwargs)
            self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        return timed


@contextmanager
def _patched(owner: Any, name: str, clock: PhaseClock, label: str) -> Iterator[None]:
    """``owner.name`` timed under ``label`` inside the block, restored after."""
    had = name in vars(owner)
    original = getattr(owner, name)
    setattr(owner, name, clock.wrap(label, original))
    try:
        yield
    finally:
        if had:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextmanager
def timing(clock: PhaseClock, targets: Sequence[Any] = ()) -> Iterator[PhaseClock]:
    """Every phase of the decode loop, and each of ``targets``' forwards, timed on ``clock``."""
    import agentspec.decoding.loop as decode
    import agentspec.decoding.untrusted as untrusted
    from agentspec.drafters.chain import DrafterChain
    from agentspec.engine.sequence import Sequence as KVSequence
    from agentspec.grammar.state import GrammarState
    from agentspec.memory.completion import CompletionMemory
    from agentspec.memory.worker import KeyVectors, Worker

    spots: list[tuple[Any, str, str]] = [
        (untrusted, "sanitize", "sanitize"), (decode, "verify", "verify"),
        (GrammarState, "__init__", "grammar.setup"), (GrammarState, "constrain", "grammar.constrain"),
        (GrammarState, "advance", "grammar.advance"),
        (CompletionMemory, "lookup", "memory.lookup"), (KeyVectors, "get", "memory.embed"),
        (CompletionMemory, "record", "memory.record"), (CompletionMemory, "credit", "memory.credit"),
        (CompletionMemory, "record_behind", "memory.record_behind"),
        (CompletionMemory, "credit_behind", "memory.credit_behind"),
        (Worker, "settle", "memory.settle"),
    ]
    # The loop asks the chain through propose_sized (its propose is the same for a caller
    # without a step's share): timed as the proposal it is.
    spots += [(DrafterChain, m, f"drafting.{m}") for m in ("begin", "observe", "end")]
    spots.append((DrafterChain, "propose_sized", "drafting.propose"))
    for target in targets:
        spots += [(target, "prefill", "target.prefix"), (target, "run", "target.forward")]
    spots.append((KVSequence, "commit", "target.commit"))
    with ExitStack() as stack:
        for owner, name, label in spots:
            stack.enter_context(_patched(owner, name, clock, label))
        yield clock


def profile(workload: str, systems: Sequence[str], *, model: str = "smollm2-135m-instruct",
            measure: int | None = None, device: str | None = None,
            on_system: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run ``systems`` (bench names, agentspec ones) over ``workload``; per system: requests,
    steps, seconds and every phase's ``[seconds, calls]`` over the measured lines."""
    from agentspec import load_target
    from agentspec.bench.harness import SpecSystem, build_systems, close_memory
    from agentspec.bench.results import BenchConfig, budget
    from agentspec.bench.workload import load_workload, resolve_workload

    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ValueError(f"systems must be among {', '.join(SYSTEMS)}, got {list(systems)}")
    if measure is not None and measure < 1:
        raise ValueError(f"measure must be >= 1, got {measure}")
    items = load_workload(resolve_workload(workload), default_max_new_tokens=128)
    target = load_target(model, device=device)
    sync = None
    if target.device.type == "cuda":
        import torch

        sync = torch.cuda.synchronize
    # The steps' thread: on the CPU the torch thread (agentspec.engine.torch_thread).
    steps_thread = for_device(target.device, threading.get_ident)
    config = BenchConfig(systems=("hf-greedy", *systems))
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="agentspec-phases-") as tmp:
        built = build_systems(target, config, f"sqlite:///{Path(tmp) / 'memory.db'}",
                              suffix_db_url=f"sqlite:///{Path(tmp) / 'suffix.db'}")
        for name in systems:
            system = built[name]
            assert isinstance(system, SpecSystem)
            for item in items.warmup:
                system.run(item, budget(item, config), None)
            clock = PhaseClock(sync, steps_thread)
            steps, seconds, lines = 0, 0.0, list(items.measure)[:measure]
            with timing(clock, [system.spec.target]):
                clock.on = True
                for item in lines:
                    outcome = system.run(item, budget(item, config), None)
                    steps += outcome.steps or 0
                    seconds += outcome.seconds
                clock.on = False
            forwards = clock.seconds["target.forward"]
            out[name] = {"requests": len(lines), "steps": steps, "seconds": seconds,
                         "host_ms_per_step": round(1e3 * (seconds - forwards) / max(steps, 1), 3),
                         "phases": {k: [clock.seconds[k], clock.calls[k]] for k in clock.seconds}}
            if on_system:
                on_system(name, out[name])
            close_memory(system)
    return out


def format_system(name: str, result: dict[str, Any]) -> str:
    """One system's phases, dearest first: ms per request, ms per call, calls."""
    n, steps = max(result["requests"], 1), max(result["steps"], 1)
    lines = [f"{name}: {result['requests']} requests, {result['steps']} steps, "
             f"{result['seconds'] * 1e3 / n:.1f} ms per request, "
             f"{result['seconds'] * 1e3 / steps:.2f} ms per step, of which "
             f"{result.get('host_ms_per_step', 0.0):.2f} ms on the host (neither prefill nor "
             "forward)",
             f"  {'phase':22s} {'ms/request':>10s} {'ms/call':>9s} {'calls':>7s}"]
    for label, (sec, calls) in sorted(result["phases"].items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {label:22s} {sec * 1e3 / n:10.2f} {sec * 1e3 / max(calls, 1):9.3f} "
                     f"{calls:7d}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.phases",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="bfcl-live", help="a shipped name or a .jsonl")
    parser.add_argument("--systems", default="agentspec-pld,agentspec",
                        help=f"comma-separated among {', '.join(SYSTEMS)}")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--measure", type=int, default=None,
                        help="time only the first N measured lines")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA if any)")
    parser.add_argument("--out", type=Path, default=None, help="write the phases here")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    try:
        result = profile(args.workload, systems, model=args.model, measure=args.measure,
                         device=args.device,
                         on_system=lambda name, r: print(format_system(name, r), flush=True))
    except ValueError as e:
        parser.error(str(e))
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
