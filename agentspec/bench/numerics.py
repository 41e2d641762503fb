"""How far a GGUF's weights as stored move the logits from the float32 model, and what 8-bit
activations would move them: the figures behind the products' 16-bit choice.

``python -m agentspec.bench.numerics`` loads the model twice (``dtype="gguf"`` and
``"float32"``, the latter the file's blocks dequantised) and runs each of the ``prompts``
workload's first prompts through both models' modules (the products alone: no KV pool), then
the same with each quantized product's inputs rounded to 8 bits per group of 32 (llama.cpp's
activations, emulated over the dequantised weights in float64, as ``tests/unit/test_quant.py``'s
control does); and the model's weights in bfloat16 as ``dtype="bfloat16"`` holds them on the
CPU (``bf16``: float32 activations) and as a bfloat16 torch model (``bf16-modules``:
bfloat16 activations). For each: the largest logit difference over every position, the share of
positions whose greedy choice is the float32 model's, and how many of the prompts' greedy
continuations (``--new`` tokens, the modules' ``generate``) equal the float32 model's.

``--held FILE`` instead reports the bytes each quantized tensor type of a GGUF file is held in
against its bytes in the file (no model is built: any architecture).
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def eight_bit_activations() -> Iterator[None]:
    """Every :class:`QuantLinear` computing over its dequantised weight with each row's
    inputs rounded to 8 bits per group of 32 (amax / 127 a step), in float64."""
    import torch

    from agentspec.engine.quant.model import QuantLinear

    dense: dict[int, torch.Tensor] = {}

    def coarse(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        w = dense.setdefault(id(self), self.qweight.dequantized().double())
        g = x.double().reshape(*x.shape[:-1], -1, 32)
        step = g.abs().amax(-1, keepdim=True) / 127
        xq = torch.where(step > 0, torch.round(g / torch.where(step > 0, step, 1)) * step, 0)
        out = (xq.reshape(x.shape) @ w.T).float()
        return out if self.bias is None else out + self.bias

    kept = QuantLinear.forward
    QuantLinear.forward = coarse  # type: ignore[method-assign]
    try:
        yield
    finally:
        QuantLinear.forward = kept  # type: ignore[method-assign]


def _prompts(count: int) -> list[Any]:
    from agentspec.bench.workload import load_workload, resolve_workload

    items = load_workload(resolve_workload("prompts"), default_max_new_tokens=1).items
    return [i.messages if i.messages is not None else i.prompt for i in items[:count]]


def compare(model: str, count: int, new: int) -> dict[str, Any]:
    """The figures described in the module's docstring."""
    import torch

    from agentspec.engine.load import load_target
    from agentspec.text import encode_prompt

    quant = load_target(model, device="cpu", dtype="gguf")
    plain = load_target(model, device="cpu", dtype="float32")
    ids = [torch.tensor([encode_prompt(plain.tokenizer, p)]) for p in _prompts(count)]

    def run(m: Any) -> tuple[list[torch.Tensor], list[list[int]]]:
        with torch.inference_mode():
            logits = [m(x).logits[0] for x in ids]
            outs = [m.generate(x, max_new_tokens=new, do_sample=False)[0, x.shape[1]:].tolist()
                    for x in ids]
        return logits, outs

    ref_logits, ref_outs = run(plain.model)
    out: dict[str, Any] = {"model": model, "prompts": len(ids), "new_tokens": new}
    for name in ("16-bit", "8-bit", "bf16", "bf16-modules"):
        if name == "8-bit":
            with eight_bit_activations():
                logits, outs = run(quant.model)
        elif name == "bf16":  # load_target's bfloat16: bfloat16 weights, float32 activations
            logits, outs = run(load_target(model, device="cpu", dtype="bfloat16").model)
        elif name == "bf16-modules":  # a bfloat16 torch model: its activations bfloat16 too
            logits, outs = run(copy.deepcopy(plain.model).to(torch.bfloat16))
            logits = [a.float() for a in logits]
        else:
            logits, outs = run(quant.model)
        positions = sum(a.shape[0] for a in logits)
        same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(logits, ref_logits,
                                                                            strict=True))
        out[name] = {
            "max_logit_diff": round(max(float((a - b).abs().max())
                                        for a, b in zip(logits, ref_logits, strict=True)), 5),
            "greedy_choice_same": f"{same}/{positions}",
            "continuations_equal": f"{sum(a == b for a, b in zip(outs, ref_outs, strict=True))}"
                                   f"/{len(outs)}",
        }
    return out


def held(path: Path) -> dict[str, Any]:
    """Bytes held against bytes in the file, per quantized tensor type of ``path``."""
    import gguf
    import numpy as np

    from agentspec.engine.quant.formats import FORMATS, QuantWeight, unpack

    per: dict[str, list[int]] = {}
    for t in gguf.GGUFReader(path).tensors:
        kind = t.tensor_type.name
        if kind not in FORMATS:
            continue
        k, n = int(t.shape[0]), int(np.prod(t.shape[1:]))
        w = QuantWeight(unpack(kind, np.asarray(t.data), n, k), kind)
        sums = per.setdefault(kind, [0, 0])
        sums[0] += w.nbytes
        sums[1] += int(t.n_bytes)
    total = [sum(v[0] for v in per.values()), sum(v[1] for v in per.values())]
    return {"file": str(path), "file_bytes": path.stat().st_size,
            **{kind: {"held": h, "in_file": f, "x": round(h / f, 3)}
               for kind, (h, f) in {**per, "all quantized": total}.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.numerics",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a packaged model or a .gguf file")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=32, help="greedy tokens a continuation")
    parser.add_argument("--held", type=Path, default=None,
                        help="a .gguf file: the bytes its quantized tensors are held in")
    args = parser.parse_args(argv)
    result = held(args.held) if args.held else compare(args.model, args.prompts, args.new)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
