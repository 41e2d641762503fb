"""A float checkpoint's weights quantized at load (``quantize="int8"`` or ``"int4"``), then held
and run as a GGUF's are: :class:`~agentspec.engine.quant.formats.QuantWeight` tiles under
:class:`~agentspec.engine.quant.model.QuantLinear` and
:class:`~agentspec.engine.quant.model.QuantEmbedding`, no full-precision copy kept.

Both schemes take groups of 32 inputs of a row, as GGUF's Q8_0 and Q4_1 do, and give
:class:`~agentspec.engine.quant.formats.Unpacked` arrays whose weight is
``fma(scale, q, offset)`` with the scale and offset float16 values:

======  =========================================  ============================  ========
scheme  scale ``d``, offset                        q                             like
======  =========================================  ============================  ========
int8    ``amax / 127`` to float16, 0               ``round(w / d)``, -127..127   Q8_0
int4    ``(max - m) / 15`` to float16, ``m``: the  ``round((w - m) / d)``, 0..15 Q4_1
        group's min to float16
======  =========================================  ============================  ========

Why each weight is within ``d / 2`` of its value, for every group: ``q`` is rounded against
the scale and offset as stored (float16), not the exact ones, so the nearest point of the grid
the products use is the one taken; and the grid is made to cover the group: int8's ``d`` is
float16's nearest to ``amax / 127`` unless that is too small for ``amax`` to round to at most
127 (a subnormal or zero ``d``: then one float16 step up), int4's ``m`` is rounded down to a
float16 and its ``d`` is computed from that ``m`` and stepped up where ``max`` would round
past 15. gguf's own quantizer rounds against the unrounded scale (and Q4_1's offset to the
nearest float16), which can leave a weight more than ``d / 2`` from its grid value: the
scales agree with gguf's (Q8_0: bitwise, wherever the float16 scale is a normal number), and
a quantized value differs by one where ours is the nearer. A weight already on the grid (a
GGUF's Q8_0 dequantised, under int8; Q4_1 under int4) comes back bitwise.

Rounding is half away from zero, in float64 from the float32 weights: deterministic, and exact
in its choice of the nearer grid point. A weight whose inputs are not a multiple of 32 is
refused (a :class:`ValueError` naming it and its shape) rather than kept dense: a model is
quantized whole or not at all, so what :func:`~agentspec.engine.quant.model.weights_mode`
reports holds for every product.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from agentspec.engine import pages
from agentspec.engine.quant.formats import QuantWeight, Unpacked
from agentspec.engine.quant.model import (
    AT_LOAD,
    QuantEmbedding,
    QuantLinear,
    keep,
    set_module,
)

SCHEMES = AT_LOAD
"""What ``quantize`` takes: int8 (symmetric, as Q8_0) or int4 (with an offset, as Q4_1)."""

GROUP = 32
"""Inputs per scale (and offset)."""

_CHUNK = 1 << 20
"""Weights quantized at a time (rows of them): bounds the float64 temporaries."""


def as_scheme(quantize: Any) -> str | None:
    """``quantize`` checked: None stays None, else one of :data:`SCHEMES` (any case).

    Raises:
        ValueError: anything else (the message names it and the choices).
    """
    if quantize is None:
        return None
    if isinstance(quantize, str) and quantize.lower() in SCHEMES:
        return quantize.lower()
    raise ValueError(f"quantize must be one of {', '.join(repr(s) for s in SCHEMES)} or None, "
                     f"got {quantize!r}")


def _round(x: np.ndarray) -> np.ndarray:
    """``x`` rounded half away from zero (``floor(a + 0.5)`` can round up a value just under a
    half; the fraction below is exact)."""
    a = np.abs(x)
    whole = np.floor(a)
    return np.copysign(whole + (a - whole >= 0.5), x)


def _step(values: np.ndarray, where: np.ndarray, toward: float) -> np.ndarray:
    """``values`` (float16) moved one float16 step toward ``toward`` where ``where``."""
    return np.where(where, np.nextafter(values, np.float16(toward)), values)


def _int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A chunk ``[rows, groups, 32]`` (float32) as (q int8, scale, offset float32)."""
    amax = np.abs(w).max(axis=-1)
    with np.errstate(over="ignore"):
        d = (amax / np.float32(127)).astype(np.float16)  # as gguf's Q8_0: float32, then float16
    # Where d is too small for amax to round to 127 (a subnormal or zero d), one step up.
    wide = amax.astype(np.float64)
    d = _step(d, (wide > 0) & (wide >= 127.5 * d.astype(np.float64)), np.inf)
    scale = d.astype(np.float64)[..., None]
    x = np.divide(w, scale, out=np.zeros(w.shape), where=scale > 0)
    q = _round(x).astype(np.int8)
    d32 = d.astype(np.float32)
    return q, d32, np.zeros_like(d32)


def _int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A chunk ``[rows, groups, 32]`` (float32) as (q uint8 0..15, scale, offset float32)."""
    low, high = w.min(axis=-1), w.max(axis=-1)
    with np.errstate(over="ignore"):
        m = low.astype(np.float16)
        m = _step(m, m.astype(np.float32) > low, -np.inf)  # at or below the group's min
        span = high.astype(np.float64) - m.astype(np.float64)
        d = (span / 15).astype(np.float16)
    d = _step(d, (span > 0) & (span >= 15.5 * d.astype(np.float64)), np.inf)  # max: q <= 15
    scale = d.astype(np.float64)[..., None]
    x = np.divide(w - m.astype(np.float64)[..., None], scale, out=np.zeros(w.shape),
                  where=scale > 0)
    q = _round(x).astype(np.uint8)
    return q, d.astype(np.float32), m.astype(np.float32)


def quantize_weight(weight: torch.Tensor | np.ndarray, scheme: str,
                    name: str = "weight") -> Unpacked:
    """A float weight ``[N, K]`` quantized by ``scheme`` (:data:`SCHEMES`) per group of
    :data:`GROUP` inputs, as :class:`Unpacked` (q: int8 for int8, uint8 0..15 for int4).

    Raises:
        ValueError: an unknown scheme, a weight that is not 2-D with K a multiple of 32, or one
            with values that are not finite or beyond what a float16 scale covers (each
            message names ``name`` and the shape).
    """
    scheme = as_scheme(scheme) or ""
    if not scheme:
        raise ValueError(f"quantize must be one of {', '.join(SCHEMES)}, got None")
    if isinstance(weight, torch.Tensor):
        weight = weight.detach().to("cpu", torch.float32).numpy()
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % GROUP or not w.shape[1]:
        raise ValueError(f"{name}: shape {tuple(w.shape)} cannot be quantized to {scheme}: "
                         f"it takes a 2-D weight whose inputs are a multiple of {GROUP}")
    n, k = w.shape
    groups = k // GROUP
    q = np.empty((n, k), dtype=np.int8 if scheme == "int8" else np.uint8)
    scale = np.empty((n, groups), dtype=np.float32)
    offset = np.empty((n, groups), dtype=np.float32)
    step = max(1, _CHUNK // k)
    quantize = _int8 if scheme == "int8" else _int4
    for start in range(0, n, step):
        chunk = w[start : start + step]
        if not np.isfinite(chunk).all():
            raise ValueError(f"{name}: shape {tuple(w.shape)} holds values that are not finite "
                             f"(a row from {start}); it cannot be quantized to {scheme}")
        cq, cs, co = quantize(chunk.reshape(-1, groups, GROUP))
        if not (np.isfinite(cs).all() and np.isfinite(co).all()):
            raise ValueError(f"{name}: shape {tuple(w.shape)} holds values too large for a "
                             f"float16 scale (up to {float(np.abs(chunk).max()):.3g}); it "
                             f"cannot be quantized to {scheme}")
        q[start : start + step] = cq.reshape(-1, k)
        scale[start : start + step] = cs
        offset[start : start + step] = co
    return Unpacked(q, scale, offset, GROUP, 8 if scheme == "int8" else 4)


def quantize_model(model: Any, scheme: str) -> Any:
    """``model`` (a float32 causal LM on the CPU) with every ``nn.Linear`` replaced by a
    :class:`QuantLinear` over its weight quantized by ``scheme``, and its embedding, where it
    is a plain ``nn.Embedding``, by a :class:`QuantEmbedding`: a head tied to that embedding
    shares its one quantized table, as a GGUF's does. An embedding that is more than a lookup
    (Gemma's scales its rows) stays in float32, and a head tied to it gets its own quantized
    copy. Each float weight is dropped as its module is replaced. Returns ``model``.

    Raises:
        ValueError: an unknown scheme, a model that is not float32 on the CPU, or a weight that
            cannot be quantized (:func:`quantize_weight`). Shapes are checked for every weight
            before any is replaced (a refused shape leaves the model as it was); a weight
            holding values that are not finite is refused when it is reached, the model then
            part replaced (``load_target`` drops it).
    """
    scheme = as_scheme(scheme) or ""
    if not scheme:
        raise ValueError(f"quantize must be one of {', '.join(SCHEMES)}, got None")
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        raise ValueError(f"quantize={scheme!r} takes a float32 model on the CPU, got "
                         f"{str(param.dtype).removeprefix('torch.')} on {param.device}")
    todo, head_name = _weights(model, GROUP, f"cannot be quantized to {scheme}: its inputs "
                                             f"are not a multiple of {GROUP}")
    _replace(model, todo, head_name,
             lambda w, name: QuantWeight(quantize_weight(w, scheme, name), scheme))
    return model


def hold_bfloat16(model: Any) -> Any:
    """``model`` (a causal LM on the CPU, in bfloat16 or float32) with every ``nn.Linear`` and
    its plain ``nn.Embedding`` held as bfloat16 :class:`QuantWeight` tables (qmm.cpp's bits
    16: ``QuantWeight.bfloat16``; a tied head shares the embedding's one table), and every
    other parameter and buffer (norms, biases) in float32: what ``dtype="bfloat16"`` loads on
    the CPU where the native forward runs the model's layers. Its products read the bfloat16
    weights and take their input rows in float32, two fma chains per output. Returns
    ``model``.

    Raises:
        ValueError: a model off the CPU, or a weight whose inputs are odd (checked for every
            weight before any is replaced).
    """
    param = next(model.parameters())
    if param.device.type != "cpu":
        raise ValueError(f"bfloat16 weights held for the native forward are on the CPU, got "
                         f"{param.device}")
    todo, head_name = _weights(model, 2, "cannot be held in bfloat16 pairs: its inputs are odd")
    _replace(model, todo, head_name, lambda w, name: QuantWeight.bfloat16(w))
    return model.float()  # the rest (norms, biases): float32, as the native forward reads them


def hold_bfloat16_where_native(model: Any) -> bool:
    """A bfloat16 model on the CPU whose layers the native forward runs, its weights held in
    bfloat16 tables for it (:func:`hold_bfloat16`); any other model (or no C++ compiler to
    build the kernels) stays on its modules, in bfloat16. Whether it was held."""
    from agentspec.engine.quant import native
    from agentspec.engine.quant.runner import unsupported

    if unsupported(model, held=False) is not None:
        return False
    try:
        native.library()
    except (native.KernelBuildError, OSError):
        return False
    hold_bfloat16(model)
    return True


def _weights(model: Any, multiple: int, refusal: str) -> tuple[list[tuple[str, Any]], str | None]:
    """The modules whose weights are to be held: the embedding first where it is a plain
    ``nn.Embedding``, then every ``nn.Linear``; and the name of a head tied to that embedding
    (None where there is none). Every weight's shape is checked first: a ValueError naming it,
    its shape and ``refusal`` where it is not 2-D with inputs a multiple of ``multiple``."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    plain_embed = type(embed) is torch.nn.Embedding
    todo = [(n, m) for n, m in model.named_modules() if m is embed] if plain_embed else []
    todo += linears
    for name, module in todo:
        shape = tuple(module.weight.shape)
        if len(shape) != 2 or shape[1] % multiple:
            raise ValueError(f"{name}.weight: shape {shape} {refusal}")
    tied = plain_embed and head is not None and head.weight is embed.weight
    return todo, next((n for n, m in linears if m is head), None) if tied else None


def _replace(model: Any, todo: list[tuple[str, Any]], head_name: str | None, make: Any) -> None:
    """``todo``'s modules (the embedding first, where it is plain) replaced by
    :class:`QuantEmbedding` / :class:`QuantLinear` over ``make(weight, name)``, each moved
    into one arena of huge pages as it is made; the head ``head_name`` (tied to the embedding)
    shares its table. Each float weight goes once its module is replaced."""
    todo.reverse()
    shared: QuantWeight | None = None
    arena = pages.Arena()  # each weight moved in as it is made (model.keep)
    with torch.inference_mode(False), torch.no_grad():
        while todo:
            name, module = todo.pop()
            if isinstance(module, torch.nn.Embedding):
                shared = keep(make(module.weight, f"{name}.weight"), arena)
                set_module(model, name, QuantEmbedding(shared))
                continue
            if name == head_name and shared is not None:
                weight = shared  # tied to the embedding: the one table, held once
            else:
                weight = keep(make(module.weight, f"{name}.weight"), arena)
            bias = None if module.bias is None else module.bias.detach()
            set_module(model, name, QuantLinear(weight, bias))
