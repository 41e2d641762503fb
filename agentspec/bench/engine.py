"""``python -m agentspec.bench.engine``: the engine on one device, in two figures.

1. The cost of one verification forward per draft size, eager and (on CUDA) as a CUDA graph,
   at ``--context`` tokens of KV: the median of ``--repeats`` timed forwards.
2. Draft invariance: greedy outputs of plain decoding (no prefix reuse) against prompt-lookup
   speculation with prefix reuse, and eager against graphed forwards, on the core prompts.

Writes a JSON file with ``--json``. A figure, not a test: GPU tests live in ``tests/gpu``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from agentspec.bench.prompts import ALL_PROMPTS
from agentspec.drafters.policy import DEFAULT_COST
from agentspec.speculator import Speculator
from agentspec.target import HFTarget, load_target
from agentspec.types import Draft, Verdict

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def forward_ms(target: HFTarget, sizes: tuple[int, ...], context: int, repeats: int) -> dict[int, float]:
    """Median milliseconds of one ``score`` over ``1 + n`` rows, rolled back after each."""
    prompt = [1 + t % (target.vocab_size - 1) for t in range(context)]
    target.start(prompt)
    out: dict[int, float] = {}
    for n in sizes:
        draft = Draft.chain([7] * n, "cost") if n else Draft()
        times = []
        for i in range(repeats + 2):  # two warm-up forwards (the first captures the graph)
            t0 = time.perf_counter()
            float(target.score(prompt[-1], draft)[0, 0])  # waits for the device
            if i >= 2:
                times.append(time.perf_counter() - t0)
            target.commit(draft, Verdict((), (), prompt[-1]))
            target.crop(context - 1)
        out[n + 1] = round(1000 * statistics.median(times), 3)
    return out


def invariance(base: HFTarget, max_new: int) -> dict[str, Any]:
    """Identical outputs out of ``len(ALL_PROMPTS)``, against plain decoding without reuse."""
    def twin(**kw: Any) -> HFTarget:
        return HFTarget(base.model, base.tokenizer, name=base.name, **kw)

    plain = Speculator(twin(reuse_prefix=False), speculate=False, cost=DEFAULT_COST)
    runs = {"prompt lookup, prefix reuse": Speculator(twin(), memory=None, cost=DEFAULT_COST)}
    if base.device.type == "cuda":
        runs["plain, eager forwards"] = Speculator(twin(cuda_graphs=False, reuse_prefix=False),
                                                   speculate=False, cost=DEFAULT_COST)
    refs = [plain.generate(p, max_new).token_ids for p in ALL_PROMPTS]
    result: dict[str, Any] = {"prompts": len(ALL_PROMPTS)}
    for name, spec in runs.items():
        outs = [spec.generate(p, max_new) for p in ALL_PROMPTS]
        result[name] = sum(o.token_ids == r for o, r in zip(outs, refs, strict=True))
        steps = sum(o.stats.steps for o in outs)
        result[f"{name}: tokens per step"] = round(sum(len(o.token_ids) for o in outs) / steps, 2)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    base = load_target(args.model, device=args.device, dtype=DTYPES[dtype])
    sizes = (0, 3, 7, 15, 31, 63)
    result: dict[str, Any] = {
        "model": args.model, "device": args.device, "dtype": dtype, "context": args.context,
        "gpu_name": torch.cuda.get_device_name() if base.device.type == "cuda" else None,
        "widths": list(base.check_widths()),
        "forward_ms_eager": forward_ms(HFTarget(base.model, base.tokenizer, cuda_graphs=False),
                                       sizes, args.context, args.repeats)}
    if base.device.type == "cuda":
        result["forward_ms_graph"] = forward_ms(HFTarget(base.model, base.tokenizer), sizes,
                                                args.context, args.repeats)
    result["invariance"] = invariance(base, args.max_new_tokens)
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
