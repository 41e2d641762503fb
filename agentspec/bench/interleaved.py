"""Interleaved streams on one Speculator, with the target's prefix cache off and on.

    python -m agentspec.bench.interleaved --workload bfcl-live --streams 2 --rounds 2

Several callers streaming through one ``Speculator`` take turns step by step: each step finds
the KV holding another call's tokens and restores its own (``HFTarget.start``). Without the
prefix cache that means prefilling the whole prompt and output so far again, every step; with
it, copying the rows back. Takes the first measured request of ``--streams`` different scopes,
then per round and setting (off and on taking turns, the order swapped every round): one
stream per request, pulled one text delta at a time in turn until all end. Every output must
equal the same request generated alone. Prints each setting's fastest round and the ratio.
Prompt lookup only (no memory), greedy, each request under its grammar.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

SETTINGS = ("off", "on")


def interleave(spec: Any, calls: Sequence[dict[str, Any]]) -> list[str]:
    """Stream every call at once, one delta of each in turn; the texts."""
    streams = [spec.stream(**call) for call in calls]
    texts: list[list[str]] = [[] for _ in calls]
    live = list(range(len(calls)))
    while live:
        for i in list(live):
            try:
                texts[i].append(next(streams[i]))
            except StopIteration:
                live.remove(i)
    return ["".join(t) for t in texts]


def main(argv: Sequence[str] | None = None) -> int:
    from agentspec import SamplingParams, Speculator
    from agentspec.bench.results import grammar_of, prompt_of
    from agentspec.bench.workload import in_turn, load_workload, resolve_workload
    from agentspec.engine.load import load_target
    from agentspec.engine.target import HFTarget

    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.interleaved",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="bfcl-live", help="shipped name or JSONL path")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=2, help="requests streamed at once")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("streams", "max_new_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    items = load_workload(resolve_workload(args.workload),
                          default_max_new_tokens=args.max_new_tokens).measure
    scopes = len({item.scope for item in items})
    if scopes < args.streams:
        parser.error(f"--streams {args.streams}: the workload has {scopes} scopes")
    calls = [{"prompt": prompt_of(item), "max_new_tokens": args.max_new_tokens,
              "sampling": SamplingParams(grammar=grammar_of(item)), "scope": item.scope}
             for item in in_turn(items)[: args.streams]]  # each scope's first request
    base = load_target(args.model)
    specs = {s: Speculator(HFTarget(base.model, base.tokenizer, name=base.name,
                                    prefix_cache_bytes=0 if s == "off" else None), memory=None)
             for s in SETTINGS}
    alone: list[str] = []
    for setting, spec in specs.items():
        spec.warmup()
        texts = [spec.generate(**call).text for call in calls]
        alone = alone or texts
        assert texts == alone, f"prefix cache {setting}: an output differs"
    best = {s: float("inf") for s in SETTINGS}
    for round_ in range(args.rounds):
        for setting in (SETTINGS if round_ % 2 == 0 else SETTINGS[::-1]):
            started = time.perf_counter()
            texts = interleave(specs[setting], calls)
            seconds = time.perf_counter() - started
            if texts != alone:
                raise SystemExit(f"prefix cache {setting}: an interleaved output differs from "
                                 "the same request alone")
            best[setting] = min(best[setting], seconds)
            print(f"round {round_ + 1}, prefix cache {setting}: {seconds:.2f} s")
    print(f"{args.streams} interleaved streams of {args.workload}, {args.max_new_tokens} "
          f"tokens each: prefix cache off {best['off']:.2f} s, on {best['on']:.2f} s "
          f"({best['off'] / best['on']:.1f}x); outputs equal to each request alone")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
