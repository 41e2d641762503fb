"""One model's forward in each way its weights can be held, side by side in one process.

``python -m agentspec.bench.weights [--model NAME] [--modes gguf,fp32] [--context 1024]``
loads the model once per mode (``gguf``: the file's weights as stored, on the native forward;
``fp32``: dequantised, on the modules; ``bf16``: held in bfloat16, on the native forward
where the model's layers are Llama's), then measures one verification forward of
1, 8 and 64 rows over ``context`` tokens of KV, the modes taking turns forward by forward, and
prints (and with ``--out`` writes) a JSON object: per mode the median ms at each row count,
the ratio to the first mode, the weights held against the file's bytes, and for each mode on
the native forward (gguf; bf16 for a Llama, Mistral or Qwen model) the ms of each part
(``agentspec.engine.quant.native.PARTS``), from forwards of that mode alone after the timed
ones; ``kernels`` names the native kernels' build (``AGENTSPEC_KERNEL_MARCH=x86-64-v3`` measures
the AVX2 build a processor without AVX-512 runs) and its vector lanes.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

from agentspec.engine.load import gguf_file, load_target
from agentspec.engine.plan import draft_member
from agentspec.engine.quant import native
from agentspec.engine.quant.model import weight_bytes
from agentspec.engine.target import HFTarget
from agentspec.types import Draft, Verdict

MODES = {"gguf": "gguf", "fp32": "float32", "bf16": "bfloat16"}
ROWS = (1, 8, 64)


class _Scratch:
    """A sequence of ``context`` committed tokens on one target, rolled back after each
    forward (the pool never caches it)."""

    def __init__(self, target: HFTarget, context: int) -> None:
        self.target, self.context = target, context
        self.prompt = [1 + t % (target.vocab_size - 1) for t in range(context)]
        self.seq = target.new_sequence(cached=False)
        target.prefill(self.seq, self.prompt)

    def forward(self, rows: int) -> float:
        draft = Draft.chain([7] * (rows - 1), "bench") if rows > 1 else Draft()
        t0 = time.perf_counter()
        logits = self.target.run([draft_member(self.seq, self.prompt[-1], draft)])[0]
        assert logits is not None
        float(logits[0, 0])
        seconds = time.perf_counter() - t0
        self.seq.commit(self.prompt[-1], Verdict((), (), self.prompt[-1]))
        self.seq.truncate(self.context - 1)
        return seconds


def measure(model: str, modes: list[str], context: int, repeats: int,
            freeze: bool = True) -> dict[str, Any]:
    """The figures described in the module's docstring."""
    targets = {m: load_target(model, device="cpu", dtype=MODES[m]) for m in modes}
    scratch = {m: _Scratch(t, context) for m, t in targets.items()}
    if freeze:  # what start-up made, out of the collector's passes, as agentspec serve does
        gc.collect()
        gc.freeze()
    times: dict[str, dict[int, list[float]]] = {m: {r: [] for r in ROWS} for m in modes}
    parts: dict[str, dict[int, dict[str, float]]] = {}
    for rows in ROWS:
        for m in modes:  # warm-up
            scratch[m].forward(rows)
        for _ in range(repeats):
            for m in modes:
                times[m][rows].append(scratch[m].forward(rows))
        for m in modes:  # each native mode's parts alone (the counters are the process's)
            if targets[m].forward.native is not None:
                native.spent(reset=True)
                for _ in range(repeats):
                    scratch[m].forward(rows)
                parts.setdefault(m, {})[rows] = {k: round(1000 * v / repeats, 3)
                                                 for k, v in native.spent().items()}
    file_bytes = gguf_file(model).stat().st_size
    out: dict[str, Any] = {"model": model, "context": context, "repeats": repeats, "gc_frozen": freeze,
                           "file_bytes": file_bytes, "processor": _processor(),
                           "kernels": {"march": native.ARCH, "lanes": native.lanes()}, "modes": {}}
    first = modes[0]
    for m in modes:
        ms = {r: round(1000 * statistics.median(times[m][r]), 3) for r in ROWS}
        base = {r: 1000 * statistics.median(times[first][r]) for r in ROWS}
        held = weight_bytes(targets[m].model)
        out["modes"][m] = {"forward_ms": ms,
                           f"time_x_{first}": {r: round(ms[r] / base[r], 3) for r in ROWS},
                           "weights_bytes": held, "weights_x_file": round(held / file_bytes, 3),
                           "native": targets[m].forward.native is not None}
    if parts:
        out["native_parts_ms"] = parts
    return out


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.weights",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a packaged model or a .gguf file")
    parser.add_argument("--modes", default="gguf,fp32",
                        help=f"comma-separated, the first the baseline: {', '.join(MODES)}")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-freeze", action="store_true",
                        help="leave start-up's objects to the garbage collector's passes")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    if args.context < 64 or args.repeats < 1:
        parser.error(f"--context must be >= 64 and --repeats >= 1, got {args.context}, "
                     f"{args.repeats}")
    result = measure(args.model, modes, args.context, args.repeats, freeze=not args.no_freeze)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
