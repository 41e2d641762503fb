"""The full system under two settings, side by side: is a `SpecConfig` change faster?

    python -m agentspec.bench.ab --workload bfcl --b write_behind=false
    python -m agentspec.bench.ab --workload bfcl-live --a prefetch_key=false --b prefetch_key=true
    python -m agentspec.bench.ab --workload bfcl-live --a-widths 2,4,8,16,32,64
    python -m agentspec.bench.ab --workload bfcl --a-prefill-widths 128,256

Two `agentspec` systems (memory, suffix and prompt-lookup drafters, as `agentspec bench` builds
them), one `SpecConfig` each (``--a`` and ``--b``: ``field=value`` pairs over the bench's own
config), each with a memory of its own, on one loaded target (``--a-widths``/``--b-widths``,
``--a-prefill-widths``/``--b-prefill-widths``: that side's forward or prompt-chunk widths
instead of the target's, its cost curve measured for them and not cached). Every
warmup line runs through
both, then every measured line, the order alternating from line to line, so a slow spell of a
shared machine falls on both alike. Prints each setting's seconds and tokens/s, B over A in
aggregate speed and the median of the per-line ratios, and whether the outputs were the same
(they must be at temperature 0: no setting may change an output). ``--out FILE`` writes it all.

A change of a few percent needs this rather than two bench runs: on the 2-core CPU two runs of
one system differ by ~3 %. The sixteenth session's write-behind (1.001x on bfcl) and a
one-thread prefetch (0.991x) were measured this way.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentspec.bench.report import write_json

_BOOLS = {"true": True, "false": False, "on": True, "off": False, "1": True, "0": False}


def parse_settings(text: str) -> dict[str, Any]:
    """``"field=value,field=value"`` as `SpecConfig` keyword arguments.

    Values are read by the field's type: ``true``/``false`` (``on``/``off``, ``1``/``0``) for
    flags, ``none`` for a field that may be None, integers for integer fields.

    Raises:
        ValueError: an unknown field, a pair without ``=``, or a value the field cannot take
            (each message names it).
    """
    from agentspec.config import SpecConfig

    fields = {f.name: f for f in dataclasses.fields(SpecConfig)}
    out: dict[str, Any] = {}
    for pair in (p.strip() for p in text.split(",")):
        if not pair:
            continue
        name, eq, raw = (s.strip() for s in pair.partition("="))
        if not eq:
            raise ValueError(f"expected field=value, got {pair!r}")
        if name not in fields:
            raise ValueError(f"SpecConfig has no field {name!r}; fields: {', '.join(fields)}")
        kind, value = str(fields[name].type), raw.lower()
        if "None" in kind and value == "none":
            out[name] = None
        elif "bool" in kind and value in _BOOLS:
            out[name] = _BOOLS[value]
        elif "int" in kind and value.lstrip("-").isdigit():
            out[name] = int(value)
        else:
            raise ValueError(f"{name}={raw!r}: expected a value of type {kind}")
    return out


def parse_widths(text: str | None) -> tuple[int, ...] | None:
    """``"2,4,8"`` as forward widths (``None`` or empty: the target's own).

    Raises:
        ValueError: a width that is not a positive integer, or widths not strictly increasing.
    """
    from agentspec.engine.widths import ordered_widths

    if not text:
        return None
    try:
        widths = [int(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"widths must be comma-separated integers, got {text!r}") from None
    return ordered_widths(widths, shown=repr(text))


def compare(workload: str, a: dict[str, Any], b: dict[str, Any], *,
            model: str = "smollm2-135m-instruct", measure: int | None = None,
            device: str | None = None,
            widths: dict[str, tuple[int, ...] | None] | None = None,
            prefill_widths: dict[str, tuple[int, ...] | None] | None = None) -> dict[str, Any]:
    """Run both settings over ``workload`` (warmup through both, measured lines alternating);
    ``widths``, ``prefill_widths``: a side's (``"a"``/``"b"``) forward and prompt-chunk
    widths, where not the target's own."""
    from agentspec import SpecConfig, load_target
    from agentspec.bench.harness import SpecSystem, close_memory, memory_speculator, run_requests
    from agentspec.bench.results import BenchConfig
    from agentspec.bench.workload import load_workload, resolve_workload
    from agentspec.engine.cost import measure_cost
    from agentspec.engine.target import HFTarget

    if measure is not None and measure < 1:
        raise ValueError(f"measure must be >= 1, got {measure}")
    configs = {"a": SpecConfig(**{"draft_head": False, **a}),
               "b": SpecConfig(**{"draft_head": False, **b})}
    work = load_workload(resolve_workload(workload), default_max_new_tokens=128)
    kept = set(map(id, work.measure[:measure]))
    work = dataclasses.replace(work, items=tuple(
        i for i in work.items if i.phase == "warmup" or id(i) in kept))
    target = load_target(model, device=device)
    widths, prefill_widths = widths or {}, prefill_widths or {}
    # A side of other widths runs on a target of its own over the same weights, its cost curve
    # measured here for its widths and kept out of the cache (which holds the default's).
    own = {k for k in configs if widths.get(k) is not None or prefill_widths.get(k) is not None}
    targets = {k: HFTarget(target.model, target.tokenizer, name=target.name,
                           widths=widths.get(k), prefill_widths=prefill_widths.get(k))
               if k in own else target for k in configs}
    costs = {k: measure_cost(targets[k]) if k in own else "measure" for k in configs}
    with tempfile.TemporaryDirectory(prefix="agentspec-ab-") as tmp:
        systems = {k: SpecSystem(f"agentspec-{k}", memory_speculator(
            targets[k], f"sqlite:///{Path(tmp) / f'{k}.db'}", config, costs[k]),
            temperature=0.0, record=True) for k, config in configs.items()}
        try:  # the bench's loop: warmup through both, measured lines in alternating order
            results = run_requests(work, dict(systems), BenchConfig(systems=("hf-greedy",)),
                                   encode=systems["a"].spec.encode, warmed=("a", "b"))
        finally:
            for system in systems.values():
                close_memory(system)
    seconds = {k: [r.outcomes[k][0].seconds for r in results] for k in systems}
    tokens = {k: sum(len(r.outcomes[k][0].token_ids) for r in results) for k in systems}
    ratios = [sa / sb for sa, sb in zip(seconds["a"], seconds["b"], strict=True) if sb > 0]
    return {
        "workload": workload, "model": model, "device": str(target.device),
        "a": a, "b": b, "requests": len(results),
        "widths": {k: list(systems[k].spec.target.widths) for k in systems},
        "prefill_widths": {k: list(systems[k].spec.target.prefill_widths) for k in systems},
        "tokens_per_step": {k: tokens[k] / max(1, sum(r.outcomes[k][0].steps or 0 for r in results))
                            for k in systems},
        "seconds": {k: sum(v) for k, v in seconds.items()},
        "tokens_per_second": {k: tokens[k] / sum(seconds[k]) if sum(seconds[k]) else 0.0
                              for k in seconds},
        "b_over_a": sum(seconds["a"]) / sum(seconds["b"]) if sum(seconds["b"]) else 0.0,
        "median_b_over_a": statistics.median(ratios) if ratios else 0.0,
        "same_outputs": all(r.outcomes["a"][0].token_ids == r.outcomes["b"][0].token_ids
                            for r in results),
    }


def format_result(result: dict[str, Any]) -> str:
    def named(settings: dict[str, Any]) -> str:
        return ", ".join(f"{k}={v}" for k, v in settings.items()) or "the bench's settings"

    lines = [f"{result['workload']}: {result['requests']} measured requests on {result['device']}"]
    for k in ("a", "b"):
        shown = named(result[k])
        for field, label in (("widths", "widths"), ("prefill_widths", "prefill widths")):
            sides = result.get(field, {})
            if sides and sides["a"] != sides["b"]:
                shown += f"; {label} {','.join(map(str, sides[k])) or 'none'}"
        lines.append(f"  {k.upper()} ({shown}): {result['seconds'][k]:.2f} s, "
                     f"{result['tokens_per_second'][k]:.2f} tok/s, "
                     f"{result['tokens_per_step'][k]:.2f} tok/step")
    lines.append(f"  B / A: {result['b_over_a']:.3f}x aggregate, "
                 f"{result['median_b_over_a']:.3f}x median per request; same outputs: "
                 f"{'yes' if result['same_outputs'] else 'NO'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.ab",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="bfcl", help="a shipped name or a .jsonl")
    parser.add_argument("--a", default="", help="setting A: field=value,... (default: none)")
    parser.add_argument("--b", default="", help="setting B: field=value,...")
    parser.add_argument("--a-widths", default=None, metavar="W,W,...",
                        help="setting A's forward widths (default: the target's)")
    parser.add_argument("--b-widths", default=None, metavar="W,W,...",
                        help="setting B's forward widths (default: the target's)")
    parser.add_argument("--a-prefill-widths", default=None, metavar="W,W,...",
                        help="setting A's prompt-chunk widths (default: the target's)")
    parser.add_argument("--b-prefill-widths", default=None, metavar="W,W,...",
                        help="setting B's prompt-chunk widths (default: the target's)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--measure", type=int, default=None,
                        help="only the first N measured lines")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA if any)")
    parser.add_argument("--out", type=Path, default=None, help="write the result here")
    args = parser.parse_args(argv)
    try:
        a, b = parse_settings(args.a), parse_settings(args.b)
        widths = {"a": parse_widths(args.a_widths), "b": parse_widths(args.b_widths)}
        prefill = {"a": parse_widths(args.a_prefill_widths),
                   "b": parse_widths(args.b_prefill_widths)}
        result = compare(args.workload, a, b, model=args.model, measure=args.measure,
                         device=args.device, widths=widths, prefill_widths=prefill)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    print(format_result(result), flush=True)
    if args.out:
        write_json(result, args.out)
    return 0 if result["same_outputs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
