"""Synthetic GGUF files at the sizes users run, and the command that loads and measures them.

:func:`write_synthetic` writes a llama-architecture GGUF of random weights in a real model's
shapes (:data:`SHAPES`: Llama-3.2-1B's, Llama-3.1-8B's, and a tiny one for tests), its
quantized tensors written directly as random blocks in GGML's layout (no float tensor is ever
made or quantized, so an 8B file costs its disk write and little else), one tensor at a time
(the file's size is never held in memory). Each block's scale is drawn so that a weight's
spread is about ``1 / sqrt(inputs)``: a row's product keeps its input's scale, so the
activations stay finite through every layer and the logits vary, as a trained model's do. The
tokenizer is the packaged SmolLM2's (its ``tokenizer.ggml.*`` fields copied), its token list
padded to the shape's vocabulary with unused ``<|reserved_N|>`` tokens, so transformers' GGUF
tokenizer and config both load from the file.

What the files leave out, as nothing measured here depends on it: the context length written
is at most :data:`CONTEXT_WRITTEN` (the config stays light; the real models say 131072), and
Llama 3's rope scaling (its ``rope_freqs`` tensor) is not written, so positions take plain
rope. Random weights answer gibberish: the answer shows the model runs end to end, not what
it says.

``python -m agentspec.bench.synthetic --shape llama-3.1-8b --qtype Q4_0`` writes the file
(once: a file of the same shape and type is reused) under ``$AGENTSPEC_HOME/synthetic``, loads
it with its weights held as stored (``load_target(path, dtype="gguf", device="cpu")``) and
reports the file's size, the load's time, the weights held, the process's resident memory
after the load and at its peak, one forward's milliseconds at each row count over a KV of
``--context`` tokens (:func:`agentspec.bench.engine.forward_ms`), and a short greedy answer's
tokens and time, as JSON (``--json PATH`` writes it too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from agentspec.home import agentspec_home

CONTEXT_WRITTEN = 8192
"""The most context length a synthetic file states (see the module's docstring)."""


@dataclass(frozen=True)
class Shape:
    """A llama model's dimensions, as its GGUF metadata states them."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    context: int = CONTEXT_WRITTEN
    tied: bool = True
    """Whether the output layer is the token embedding (no ``output.weight`` in the file)."""


SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64,
                          intermediate=8192, vocab=128256, tied=True),
    "llama-3.1-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                          intermediate=14336, vocab=128256, tied=False),
    # The tokenizer's vocabulary and a few reserved tokens past it (the padding's path).
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                  vocab=49152 + 128, rope_theta=10000.0, tied=True),
}

# Bytes a block, inputs a block, and the spread of a block's values before its scale (a weight
# is about ``d * spread`` wide: the scale that gives ``1 / sqrt(inputs)`` follows).
BLOCKS: dict[str, tuple[int, int, float]] = {
    "Q8_0": (34, 32, math.sqrt((256**2 - 1) / 12)),  # int8 values
    "Q4_0": (18, 32, math.sqrt((16**2 - 1) / 12)),  # nibbles less 8
    # d * sc * q - dmin * m with sc, m in 0..63, q in 0..15 and dmin = 7.5 d (mean zero).
    "Q4_K": (144, 256, 263.0),
    # The same with q in 0..31 and dmin = 15.5 d.
    "Q5_K": (176, 256, 527.0),
}
QTYPES = tuple(BLOCKS)
# llama.cpp's general.file_type (Q4_K_M, Q5_K_M)
_FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K": 15, "Q5_K": 17}
_UNUSED = 5  # tokenizer.ggml.token_type of a reserved token (llama.cpp's UNUSED)


def _shape(shape: str | Shape) -> Shape:
    if isinstance(shape, Shape):
        return shape
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return SHAPES[shape]


def _qtype(qtype: str) -> str:
    if qtype not in BLOCKS:
        raise ValueError(f"qtype must be one of {', '.join(QTYPES)}, got {qtype!r}")
    return qtype


def tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``(name, [outputs, inputs])`` of every tensor of a llama file of ``shape``, in the
    order llama.cpp writes them; a norm's is ``[inputs]``."""
    s = shape
    yield "token_embd.weight", (s.vocab, s.hidden)
    for i in range(s.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (s.hidden,)
        yield b + "attn_q.weight", (s.heads * s.head_dim, s.hidden)
        yield b + "attn_k.weight", (s.kv_heads * s.head_dim, s.hidden)
        yield b + "attn_v.weight", (s.kv_heads * s.head_dim, s.hidden)
        yield b + "attn_output.weight", (s.hidden, s.heads * s.head_dim)
        yield b + "ffn_norm.weight", (s.hidden,)
        yield b + "ffn_gate.weight", (s.intermediate, s.hidden)
        yield b + "ffn_up.weight", (s.intermediate, s.hidden)
        yield b + "ffn_down.weight", (s.hidden, s.intermediate)
    yield "output_norm.weight", (s.hidden,)
    if not s.tied:
        yield "output.weight", (s.vocab, s.hidden)


def _scale_table(qtype: str, inputs: int) -> np.ndarray:
    """256 float16 scales around the one that gives a weight a spread of ``1/sqrt(inputs)``
    (half to one and a half times it), as their bytes ``[256, 2]``."""
    _, _, spread = BLOCKS[qtype]
    d = 1.0 / (math.sqrt(inputs) * spread)
    return (d * np.linspace(0.5, 1.5, 256)).astype("<f2").view(np.uint8).reshape(256, 2)


def random_blocks(qtype: str, rows: int, inputs: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` rows of ``inputs`` inputs of random ``qtype`` blocks, as their bytes
    ``[rows, bytes a row]``: random values and scales drawn from :func:`_scale_table`.

    Raises:
        ValueError: ``inputs`` is no whole number of the type's blocks (the message names both).
    """
    size, per, _ = BLOCKS[_qtype(qtype)]
    if inputs % per:
        raise ValueError(f"{qtype} stores inputs in blocks of {per}; {inputs} inputs is not a "
                         "whole number of blocks")
    count = rows * (inputs // per)
    data = np.frombuffer(rng.bytes(count * size), dtype=np.uint8).reshape(count, size).copy()
    table = _scale_table(qtype, inputs)
    data[:, 0:2] = table[rng.integers(0, 256, count, dtype=np.uint8)]
    if qtype in ("Q4_K", "Q5_K"):  # dmin: the values' mean times d, so the offsets cancel it
        d = data[:, 0:2].copy().view("<f2").astype(np.float32)
        mean = np.float32(7.5 if qtype == "Q4_K" else 15.5)
        data[:, 2:4] = (d * mean).astype("<f2").view(np.uint8)
    return data.reshape(rows, -1)


@lru_cache(maxsize=1)
def _smollm2_tokenizer() -> tuple[tuple[str, Any, Any], ...]:
    """The packaged SmolLM2 GGUF's ``tokenizer.*`` fields: ``(key, value, GGUF types)``."""
    import gguf

    from agentspec.engine.load import gguf_file

    reader = gguf.GGUFReader(str(gguf_file("smollm2-135m-instruct")))
    return tuple((key, field.contents(), tuple(field.types))
                 for key, field in reader.fields.items() if key.startswith("tokenizer."))


def _add_tokenizer(writer: Any, vocab: int) -> None:
    """The packaged SmolLM2's tokenizer into ``writer``, its token list (and types) padded to
    ``vocab`` tokens with unused ``<|reserved_N|>`` ones."""
    import gguf

    fields = _smollm2_tokenizer()
    tokens = next(v for k, v, _ in fields if k == gguf.Keys.Tokenizer.LIST)
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} is below the tokenizer's {len(tokens)} tokens")
    pad = vocab - len(tokens)
    for key, value, types in fields:
        if types[0] == gguf.GGUFValueType.ARRAY:
            if key == gguf.Keys.Tokenizer.LIST:
                value = [*value, *(f"<|reserved_{i}|>" for i in range(pad))]
            elif key == gguf.Keys.Tokenizer.TOKEN_TYPE:
                value = [*value, *([_UNUSED] * pad)]
            writer.add_key_value(key, value, types[0], sub_type=types[-1])
        else:
            writer.add_key_value(key, value, types[0])


def synthetic_name(shape_name: str, qtype: str, seed: int = 0) -> str:
    """The ``general.name`` of a synthetic file (what a reuse checks)."""
    return f"agentspec synthetic {shape_name} {qtype} seed {seed}"


def write_synthetic(path: str | os.PathLike[str], shape: str | Shape, qtype: str,
                    seed: int = 0, *, progress: bool | None = None) -> Path:
    """Write a llama GGUF of random weights of ``shape`` (a :data:`SHAPES` name or a
    :class:`Shape`) in ``qtype`` (:data:`QTYPES`) to ``path``, atomically (a temporary name in
    the same folder, then a rename); ``path`` is returned.

    Every linear layer and the token embedding are ``qtype``; norms are float32 near 1. The
    tensors are made and written one at a time (see the module's docstring); ``progress``
    (default: more than a hundred tensors) shows a bar over them.

    Raises:
        ValueError: an unknown shape or qtype, or a shape whose widths the qtype's blocks do
            not divide (the message names them).
    """
    import gguf
    from tqdm import tqdm

    dims, qtype = _shape(shape), _qtype(qtype)
    name = shape if isinstance(shape, str) else "custom"
    specs = list(tensors(dims))
    per = BLOCKS[qtype][1]
    odd = [(n, s) for n, s in specs if len(s) == 2 and s[1] % per]
    if odd:
        raise ValueError(f"{qtype} stores inputs in blocks of {per}; these tensors' inputs are "
                         f"not whole blocks: {odd[:3]}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    raw = gguf.GGMLQuantizationType[qtype]
    size = BLOCKS[qtype][0]
    writer = gguf.GGUFWriter(str(tmp), "llama")
    try:
        writer.add_name(synthetic_name(name, qtype, seed))
        writer.add_type("model")
        writer.add_block_count(dims.layers)
        writer.add_context_length(dims.context)
        writer.add_embedding_length(dims.hidden)
        writer.add_feed_forward_length(dims.intermediate)
        writer.add_head_count(dims.heads)
        writer.add_head_count_kv(dims.kv_heads)
        writer.add_rope_freq_base(dims.rope_theta)
        writer.add_layer_norm_rms_eps(dims.rms_eps)
        writer.add_file_type(_FILE_TYPES[qtype])
        writer.add_vocab_size(dims.vocab)
        writer.add_rope_dimension_count(dims.head_dim)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_tokenizer(writer, dims.vocab)
        for tname, tshape in specs:
            if len(tshape) == 1:
                writer.add_tensor_info(tname, tshape, np.dtype(np.float32), 4 * tshape[0])
            else:
                rows, inputs = tshape
                nbytes = rows * inputs // per * size
                writer.add_tensor_info(tname, (rows, nbytes // rows), np.dtype(np.uint8),
                                       nbytes, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        show = len(specs) > 100 if progress is None else progress
        for _, tshape in tqdm(specs, desc=f"writing {out.name}", unit="tensor",
                              disable=not show, leave=False):
            if len(tshape) == 1:
                data = (1.0 + rng.uniform(-0.05, 0.05, tshape[0])).astype(np.float32)
            else:
                data = random_blocks(qtype, tshape[0], tshape[1], rng)
            writer.write_tensor_data(data)
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out


def synthetic_file(out_dir: Path, shape_name: str, qtype: str, seed: int = 0) -> tuple[Path, bool]:
    """The synthetic file of ``shape_name`` and ``qtype`` under ``out_dir``, written unless one
    of the same shape, type and seed (its ``general.name``) is there: ``(path, written now)``."""
    import gguf

    path = out_dir / f"synthetic-{shape_name}-{qtype}.gguf"
    try:
        field = gguf.GGUFReader(str(path)).fields.get("general.name") if path.exists() else None
    except (ValueError, OSError):  # a file cut short, or no GGUF: written again
        field = None
    if field is not None and field.contents() == synthetic_name(shape_name, qtype, seed):
        return path, False
    return write_synthetic(path, shape_name, qtype, seed), True


def memory() -> dict[str, int]:
    """This process's resident bytes now (``VmRSS``) and at its peak (``VmHWM``)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Start ``VmHWM`` again from the resident size now (Linux ``clear_refs``): the peak then
    covers what follows only. Whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def processor() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def answer(target: Any, question: str, max_new: int) -> dict[str, Any]:
    """Greedy decoding of ``question`` (in the tokenizer's chat template) one token a forward,
    up to ``max_new`` tokens or an end token: its text, tokens and seconds (prefill apart)."""
    import torch

    from agentspec.engine import compat
    from agentspec.engine.plan import draft_member
    from agentspec.types import Draft, Verdict

    tok = target.tokenizer
    prompt = list(tok.apply_chat_template([{"role": "user", "content": question}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False))
    eos = compat.eos_token_ids(target.model)
    stops = {eos} if isinstance(eos, int) else set(eos or ())
    seq = target.new_sequence(cached=False)
    try:
        t0 = time.perf_counter()
        target.prefill(seq, prompt)
        t1 = time.perf_counter()
        last, out = prompt[-1], list[int]()
        while len(out) < max_new:
            logits = target.run([draft_member(seq, last, Draft())])[0]
            token = int(torch.argmax(logits[0]))
            if not torch.isfinite(logits[0]).all():
                raise RuntimeError(f"non-finite logits at answer token {len(out)}")
            seq.commit(last, Verdict((), (), token))
            out.append(token)
            last = token
            if token in stops:
                break
        t2 = time.perf_counter()
    finally:
        seq.release()
    return {"prompt_tokens": len(prompt), "prefill_s": round(t1 - t0, 3),
            "tokens": len(out), "decode_s": round(t2 - t1, 3),
            "tokens_per_s": round(len(out) / (t2 - t1), 2) if out else 0.0,
            "text": tok.decode(out)}


def measure(path: Path, rows: tuple[int, ...], context: int, repeats: int,
            max_new: int = 16) -> dict[str, Any]:
    """Load ``path`` with its weights held as stored and measure it (see the module's
    docstring): the figures as a dict."""
    import torch

    from agentspec.bench.engine import forward_ms
    from agentspec.engine.load import load_target
    from agentspec.engine.quant.model import weight_bytes

    before = memory()
    t0 = time.perf_counter()
    target = load_target(str(path), dtype="gguf", device="cpu")
    load_s = time.perf_counter() - t0
    after = memory()
    cfg = target.model.config
    t0 = time.perf_counter()
    widths = target.check_widths()
    probe_s = time.perf_counter() - t0
    reply = answer(target, "What is the capital of France?", max_new)
    too_wide = [r for r in rows if r < 1 or r > target.max_draft_nodes + 1]
    if too_wide:
        raise ValueError(f"rows must be in [1, {target.max_draft_nodes + 1}], got {too_wide}")
    ms = forward_ms(target, tuple(r - 1 for r in rows), context, repeats)
    return {
        "file": str(path), "file_bytes": path.stat().st_size,
        "config": {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                   "num_attention_heads": cfg.num_attention_heads,
                   "num_key_value_heads": cfg.num_key_value_heads,
                   "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
                   "tie_word_embeddings": bool(cfg.tie_word_embeddings)},
        "load_s": round(load_s, 2), "weight_bytes": weight_bytes(target.model),
        "rss_before_load_bytes": before["rss"], "rss_after_load_bytes": after["rss"],
        "peak_rss_after_load_bytes": after["peak"],
        "width_probe_s": round(probe_s, 2), "widths": list(widths),
        "context": context, "repeats": repeats,
        "forward_ms": {str(k): v for k, v in ms.items()},
        "peak_rss_end_bytes": memory()["peak"],
        "answer": reply, "threads": torch.get_num_threads(), "processor": processor(),
    }


def _rows(text: str) -> tuple[int, ...]:
    try:
        rows = tuple(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        rows = ()
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"--rows takes comma-separated counts >= 1, got {text!r}")
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.synthetic",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--qtype", choices=list(QTYPES), default="Q4_0")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of the file (default $AGENTSPEC_HOME/synthetic)")
    parser.add_argument("--rows", type=_rows, default=(1, 8, 64),
                        help="comma-separated rows of one forward (default 1,8,64)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    if args.context < 2 or args.repeats < 1:
        parser.error(f"--context takes at least 2 tokens and --repeats at least 1, got "
                     f"{args.context} and {args.repeats}")
    out_dir = args.out or agentspec_home() / "synthetic"
    t0 = time.perf_counter()
    path, written = synthetic_file(out_dir, args.shape, args.qtype, args.seed)
    write_s = time.perf_counter() - t0
    peak_reset = reset_peak()
    result = {"shape": args.shape, "qtype": args.qtype, "written_now": written,
              "write_s": round(write_s, 2) if written else None,
              "shape_dims": dataclasses.asdict(SHAPES[args.shape]),
              "peak_covers_load_only": peak_reset or not written,
              **measure(path, args.rows, args.context, args.repeats, args.max_new_tokens)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
