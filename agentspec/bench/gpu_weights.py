"""``python -m agentspec.bench.gpu_weights [--shape llama-3.1-8b] [--modes bf16,int4]``: the fused
forward of a model in a real model's shapes, on the weights' read time.

The model (:data:`agentspec.bench.synthetic.SHAPES`) is made on the device with random weights,
nothing read from disk: ``bf16`` holds every matrix in bfloat16; ``int4`` holds them as the
fused forward holds a GGUF's 4-bit weights (:class:`~agentspec.engine.quant.tiles.TileWeight`:
two values a byte, a float16 scale and offset per 32 inputs, Q4_1's bits), each tile
dequantised as a product loads it. For each mode: one verification forward's median ms at 1, 8
and 64 rows over ``--context`` tokens of KV (:func:`agentspec.bench.engine.forward_ms`, graph
replays), the weights' bytes, and their read time: bytes over the device's memory bandwidth,
measured here as a device-to-device copy (read and write) of ``--probe-mib`` MiB. At one row a
forward reads every weight once, so ``x_read`` there says how close it runs to the memory's
speed. Prints (and with ``--out`` writes) JSON; the modes run one after the other, each model
freed before the next is made. On a machine without CUDA it runs in Triton's interpreter
(the ``tiny`` shape, as its test does), its times meaningless.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from agentspec.bench.engine import forward_ms
from agentspec.bench.synthetic import SHAPES, Shape
from agentspec.engine.quant.model import QuantEmbedding, QuantLinear, set_module, weight_bytes
from agentspec.engine.quant.tiles import TileWeight
from agentspec.engine.target import HFTarget

MODES = ("bf16", "int4")
ROWS = (1, 8, 64)


class _Ids:
    """The least tokenizer a target takes: ids only, the last the end of sequence."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.eos_token_id = vocab, vocab - 1

    def __len__(self) -> int:
        return self.vocab


def _int4(n: int, k: int, device: torch.device, gen: torch.Generator) -> TileWeight:
    """Random 4-bit weights of ``n`` rows and ``k`` inputs (values spread about
    ``1 / sqrt(k)``, mean zero: scale * (q - 8))."""
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    scale = torch.full((n, k // 32), 0.28 / math.sqrt(k), dtype=torch.float16, device=device)
    return TileWeight(codes, scale, -8 * scale, 4, 32, "Q4_1")


def build(shape: Shape, mode: str, device: torch.device, positions: int, seed: int = 0) -> Any:
    """A Llama of ``shape`` on ``device`` with random weights held as ``mode`` says."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         head_dim=shape.head_dim,
                         rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
                         rms_norm_eps=shape.rms_eps, max_position_embeddings=positions,
                         tie_word_embeddings=shape.tied)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        mats = [(n, m) for n, m in model.named_modules()
                if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
        if mode == "int4":
            tied = None
            for name, module in mats:
                if shape.tied and module is model.lm_head and tied is not None:
                    set_module(model, name, QuantLinear(tied))
                    continue
                n, k = module.weight.shape
                w = _int4(n, k, device, gen)
                if isinstance(module, torch.nn.Embedding):
                    tied = w
                set_module(model, name, QuantEmbedding(w) if isinstance(module, torch.nn.Embedding)
                           else QuantLinear(w))
        model.to_empty(device=device)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:  # bf16 mode's matrices
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]), generator=gen)
        base = model.model
        base.rotary_emb = type(base.rotary_emb)(config=config).to(device)
    return model.eval()


def bandwidth(device: torch.device, mib: int) -> float:
    """Bytes a second a device-to-device copy moves (read plus write), median of five."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() / statistics.median(times[2:])


def measure(shape: str | Shape, modes: list[str], context: int, repeats: int, probe_mib: int,
            device: torch.device, rows: tuple[int, ...] = ROWS,
            width: int | None = None) -> dict[str, Any]:
    """The figures the module's docstring describes (``shape``: a :data:`SHAPES` name, or the
    dimensions themselves), at ``rows``; ``width``: every forward at that one width, no
    widths probed (default: the engine's widths)."""
    dims = shape if isinstance(shape, Shape) else SHAPES[shape]
    name = shape if isinstance(shape, str) else "custom"
    rate = bandwidth(device, probe_mib)
    out: dict[str, Any] = {"shape": name, "context": context, "device": _device_name(device),
                           "bandwidth_gb_s": round(rate / 1e9, 1), "modes": {}}
    for mode in modes:
        model = build(dims, mode, device, context + 256)
        held = weight_bytes(model)
        fixed: dict[str, Any] = {} if width is None else {"widths": (width,),
                                                           "prefill_widths": ()}
        target = HFTarget(model, _Ids(dims.vocab), name=f"{name}-{mode}", reuse_prefix=False,
                          fused=True, **fixed)
        ms = forward_ms(target, tuple(r - 1 for r in rows), context, repeats)
        read_ms = 1000 * held / rate
        out["modes"][mode] = {"forward_ms": ms, "weights_bytes": held,
                              "read_ms": float(f"{read_ms:.4g}"),
                              "x_read": {r: round(t / read_ms, 2) for r, t in ms.items()},
                              "fused": target.forward.fused is not None}
        del target, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu (Triton's interpreter)"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.gpu_weights",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--probe-mib", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = measure(args.shape, modes, args.context, args.repeats, args.probe_mib, device)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
