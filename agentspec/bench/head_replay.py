"""The draft head's training replay: records in the order of their tokens against the store's.

    python -m agentspec.bench.head_replay --db sqlite:////path/memory.db --scope bfcl-GorillaFileSystem

``agentspec head train`` runs every completion recorded without kept rows through the target
to get its hidden rows (:func:`~agentspec.drafters.head_train.replay`), reusing the KV of the
prefix it shares with the record run before it. This times that replay over one scope's
records as it runs now (sorted by their token ids, so each record continues the longest prefix
any record shares with it) and in the store's order (how it ran before), the two taking turns
round by round in one process, the first of each round alternating. Prints, per order, the
median seconds, the tokens run through the target, and the largest difference of a hidden row
from the first sorted run's (the two orders reuse other prefixes: float rounding, no more).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch


def timed_replay(target: Any, records: Sequence[Any], vocab: torch.Tensor, *,
                 sort: bool) -> tuple[float, int, list[Any]]:
    """``(seconds, tokens run through the target, replays)`` of one replay."""
    from agentspec.drafters.head_train import replay
    from agentspec.engine import compat

    ran: list[int] = []

    def count(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ran.append(int(kwargs["input_ids"].shape[1]))

    hook = compat.base_model(target.model).register_forward_pre_hook(count, with_kwargs=True)
    try:
        started = time.perf_counter()
        out = replay(target.model, target.tokenizer, records, vocab, sort=sort)
        seconds = time.perf_counter() - started
    finally:
        hook.remove()
    return seconds, sum(ran), out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.head_replay",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="the memory (SQLAlchemy URL)")
    parser.add_argument("--scope", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--limit", type=int, default=None, help="the first N records only")
    parser.add_argument("--rounds", type=int, default=1, help="replays of each order")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")

    from agentspec.drafters.head_train import vocabulary
    from agentspec.engine.load import load_target
    from agentspec.stores import SQLStore

    target = load_target(args.model, device="cpu")
    store = SQLStore(args.db)
    records = list(store.iter(scope=args.scope, model=target.fingerprint))[: args.limit]
    if not records:
        parser.error(f"no records of scope {args.scope!r} and model {target.fingerprint} in {args.db}")
    vocab = vocabulary(records, target.tokenizer)
    runs: dict[str, list[float]] = {"sorted": [], "store order": []}
    tokens: dict[str, int] = {}
    diff: dict[str, float] = {}
    reference: list[Any] | None = None
    for r in range(args.rounds):
        orders = [True, False] if r % 2 == 0 else [False, True]
        for sort in orders:
            name = "sorted" if sort else "store order"
            seconds, ran, out = timed_replay(target, records, vocab, sort=sort)
            runs[name].append(seconds)
            tokens[name] = ran
            if reference is None:
                reference = out
            diff[name] = max(diff.get(name, 0.0), max(
                (float((a.hidden - b.hidden).abs().max()) for a, b in zip(reference, out, strict=True)),
                default=0.0))
            print(f"round {r + 1}: {name} {seconds:.1f} s, {ran} tokens", flush=True)
    medians = {name: statistics.median(times) for name, times in runs.items()}
    print(json.dumps({
        "records": len(records), "scope": args.scope, "rounds": args.rounds,
        "orders": {name: {"median_s": round(medians[name], 1), "runs_s": [round(t, 1) for t in runs[name]],
                          "tokens": tokens[name], "max_row_diff": diff[name]} for name in runs},
        "speedup": round(medians["store order"] / medians["sorted"], 2),
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
