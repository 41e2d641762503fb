"""The fused forward's Triton kernels and their launchers (attention's are in
:mod:`.attention`, the kernels OLMo 2's norm placement adds in :mod:`.post_norm`).

A Llama decoder layer is six kernels: RMSNorm fused into the query/key/value product, whose
epilogue applies rotary embedding (after each head's RMSNorm, for Qwen3) and writes the keys
and values into the KV pool; attention and the combination of its splits; the output product
with the residual add in its epilogue (after Granite's residual multiplier); RMSNorm fused into
the gate/up product with SiLU-and-multiply in its epilogue; the down product with the residual
add. The output head is one more product with the final RMSNorm fused in (Granite's logits
scaling in its epilogue). Each launcher allocates nothing but its outputs, so a forward of them
can be captured as a CUDA graph.

Exactness (``docs/architecture.md``): a row's bits depend on neither its forward's width nor
its place in it: every product is computed in tiles of a fixed shape (:data:`BLOCK_M` rows,
:data:`BLOCK_K` deep, reduced in order along the inner dimension); attention's rules are in
:mod:`.attention`. Rounding follows transformers' modules (a bf16 rounding wherever they
round), within bf16 rounding of the module path. Without CUDA the kernels run in Triton's
interpreter (the tests and the operation counter), slowly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from agentspec.engine.fused import interpret_without_gpu
from agentspec.engine.quant.tiles import TileWeight, kernel_args, outputs

INTERPRETED = interpret_without_gpu()
"""Whether the kernels run in Triton's interpreter (on the CPU's tensors)."""

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the module path runs without Triton
    triton = None
    tl = None

AVAILABLE = triton is not None
"""Whether Triton is installed (the fused forward needs it)."""

BLOCK_M = 16
"""Rows per program in every kernel (a tensor-core tile's least height): widths are multiples."""

BLOCK_K = 64
"""Depth of one step of a product's reduction (the inner dimensions are multiples)."""

SPLIT = 256
"""Positions per attention split and per pool block (:data:`agentspec.engine.pool.BLOCK`)."""

Norm = tuple[torch.Tensor, float]
"""An RMSNorm as the kernels take it: its weight and its epsilon."""

_LISTENERS: list[Callable[[str], None]] = []
_INSIDE = threading.local()


@contextmanager
def launches_seen(listener: Callable[[str], None], *, run: bool = True) -> Iterator[None]:
    """Call ``listener(kernel name)`` at every launch inside (the operation counter's hook).
    ``run=False``: launch nothing (outputs are allocated, never written): the kernels of a
    forward counted without running them, which the interpreter does slowly."""
    _LISTENERS.append(listener)
    dry = getattr(_INSIDE, "dry", False)
    _INSIDE.dry = dry or not run
    try:
        yield
    finally:
        _LISTENERS.remove(listener)
        _INSIDE.dry = dry


def inside_launch() -> bool:
    """Whether this thread is inside a kernel launch (the interpreter runs tensor operations
    of its own there, which are the kernel's and not the forward's)."""
    return bool(getattr(_INSIDE, "depth", 0))


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Launch ``kernel`` over ``grid`` (every kernel of the fused forward goes through here:
    the listeners of :func:`launches_seen` see it, and the interpreter gets float32 products)."""
    for listener in list(_LISTENERS):
        listener(getattr(kernel, "__name__", str(kernel)))
    if getattr(_INSIDE, "dry", False):
        return
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        kernel[grid](*args, **meta, F32_DOT=INTERPRETED)
    finally:
        _INSIDE.depth -= 1


if AVAILABLE:

    @triton.jit
    def dot(a, b, F32_DOT: tl.constexpr):
        # bf16 operands, float32 accumulation. The interpreter's products would read bf16
        # operands as integers, so there they are widened first (the same products, exactly).
        if F32_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32))
        return tl.dot(a, b)

    @triton.jit
    def weight_tile(w_ptr, s_ptr, o_ptr, cols, ks, inside, K: tl.constexpr, WB: tl.constexpr,
                    GS: tl.constexpr, OFS: tl.constexpr, dt: tl.constexpr):
        # The [BK, BN] tile of w.T at inputs ks and outputs cols (outputs not inside: zeros),
        # in dt. WB 0: a dense weight [N, K]. Else a TileWeight (agentspec.engine.quant.tiles):
        # WB 4, two 4-bit values a byte along K; WB 8, a signed byte each; per output row and
        # group of GS inputs a scale (and with OFS an offset): scale * q + offset in float32,
        # rounded to dt, to nearest even (to bfloat16 in integers: Triton's interpreter
        # truncates a cast, and its rounding cast is not to nearest even).
        mask = inside[None, :]
        if WB == 0:
            return tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=mask, other=0.0)
        if WB == 4:
            byte = tl.load(w_ptr + cols[None, :] * (K // 2) + ks[:, None] // 2, mask=mask,
                           other=0).to(tl.int32)
            q = ((byte >> ((ks[:, None] % 2) * 4)) & 15).to(tl.float32)
        else:
            q = tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=mask, other=0).to(tl.float32)
        at = cols[None, :] * (K // GS) + ks[:, None] // GS
        w = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32) * q
        if OFS:
            w = w + tl.load(o_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if dt == tl.bfloat16:
            bits = w.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return w.to(dt)

    @triton.jit
    def row_rstd(x_ptr, rows, eps, K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
        # 1 / sqrt(mean(x^2) + eps) of BM rows, summed over the row in BK chunks, in order.
        sq = tl.zeros([BM], tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rows[:, None] * K + cols[None, :]).to(tl.float32)
            sq += tl.sum(x * x, axis=1)
        return 1.0 / tl.sqrt(sq / K + eps)

    @triton.jit
    def scaled_norm(x, rstd, w, ONE_ROUNDING: tl.constexpr):
        # RMSNorm's output from x (float32 values of the dtype's), its rows' rstd and the
        # weight, rounded as the family's module rounds: Llama's (x * rstd) to the dtype, then
        # times the weight, to the dtype; OLMo 2's the product in float32, rounded once.
        dt = w.dtype
        if ONE_ROUNDING:
            return (w.to(tl.float32) * (x * rstd)).to(dt)
        n = (x * rstd).to(dt)
        return (w.to(tl.float32) * n.to(tl.float32)).to(dt)

    @triton.jit
    def _chunk(x_ptr, norm_ptr, rows, rstd, k0, K: tl.constexpr, BK: tl.constexpr,
               NORM: tl.constexpr, ONE_ROUNDING: tl.constexpr):
        # A BK-wide chunk of the rows, RMSNormed where NORM (the product's input).
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :])
        if NORM:
            w = tl.load(norm_ptr + cols)
            x = scaled_norm(x.to(tl.float32), rstd[:, None], w[None, :], ONE_ROUNDING)
        return x

    @triton.jit
    def rope_store(x1, x2, head, rows, ins_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, W,
                   H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr):
        # One head of BM rows written out, its halves x1 and x2 (float32 values of the
        # dtype's): queries and keys rotated at the rows' positions as apply_rotary_pos_emb
        # rounds, queries to q, keys and values into the pool at the rows' slots
        # (block * SLOTS + offset; a junk row's slot is -1: not written).
        half: tl.constexpr = D // 2
        dims = tl.arange(0, half)
        dt = q_ptr.dtype.element_ty
        slot = tl.load(ins_ptr + 2 * W + rows)
        keep = slot >= 0
        at_kv = ((slot // SLOTS) * KVH) * SLOTS * D + (slot % SLOTS) * D  # [BM], head 0
        if head < H + KVH:
            pos = tl.load(ins_ptr + W + rows)
            c = tl.load(cos_ptr + pos[:, None] * D + dims[None, :]).to(tl.float32)
            s = tl.load(sin_ptr + pos[:, None] * D + dims[None, :]).to(tl.float32)
            out1 = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
            out2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
            if head < H:
                at = q_ptr + rows[:, None] * H * D + head * D + dims[None, :]
                tl.store(at, out1)
                tl.store(at + half, out2)
            else:
                at = k_ptr + at_kv[:, None] + (head - H) * SLOTS * D + dims[None, :]
                tl.store(at, out1, mask=keep[:, None])
                tl.store(at + half, out2, mask=keep[:, None])
        else:
            at = v_ptr + at_kv[:, None] + (head - H - KVH) * SLOTS * D + dims[None, :]
            tl.store(at, x1.to(dt), mask=keep[:, None])
            tl.store(at + half, x2.to(dt), mask=keep[:, None])

    @triton.jit
    def _qkv_rope(x_ptr, norm_ptr, eps, w_ptr, s_ptr, o_ptr, bias_ptr, qn_ptr, kn_ptr, head_eps,
                  ins_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, W, K: tl.constexpr,
                  H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                  BK: tl.constexpr, SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HEAD_NORM: tl.constexpr, WB: tl.constexpr, GS: tl.constexpr,
                  OFS: tl.constexpr, F32_DOT: tl.constexpr):
        # Program (row tile, head): RMSNorm of the rows, their product with the head's
        # weights (its two halves apart, for the rotation), with HEAD_NORM the head's RMSNorm
        # over its own dimensions (Qwen3's q_norm and k_norm), then the head written out
        # rotated (rope_store).
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        head = tl.program_id(1)
        half: tl.constexpr = D // 2
        dims = tl.arange(0, half)
        rstd = row_rstd(x_ptr, rows, eps, K, BM, BK)
        lo = tl.zeros([BM, half], tl.float32)
        hi = tl.zeros([BM, half], tl.float32)
        w_rows = head * D + dims
        for k0 in range(0, K, BK):
            x = _chunk(x_ptr, norm_ptr, rows, rstd, k0, K, BK, True, False)
            cols = k0 + tl.arange(0, BK)
            every = w_rows >= 0
            w_lo = weight_tile(w_ptr, s_ptr, o_ptr, w_rows, cols, every, K, WB, GS, OFS,
                               x.dtype)  # [BK, half]
            w_hi = weight_tile(w_ptr, s_ptr, o_ptr, w_rows + half, cols, every, K, WB, GS, OFS,
                               x.dtype)
            lo = lo + dot(x, w_lo, F32_DOT)
            hi = hi + dot(x, w_hi, F32_DOT)
        if HAS_BIAS:
            lo += tl.load(bias_ptr + w_rows)[None, :].to(tl.float32)
            hi += tl.load(bias_ptr + w_rows + half)[None, :].to(tl.float32)
        dt = q_ptr.dtype.element_ty
        x1 = lo.to(dt).to(tl.float32)  # the product's output, rounded as a bf16 linear's
        x2 = hi.to(dt).to(tl.float32)
        if HEAD_NORM:
            if head < H + KVH:
                sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
                head_rstd = (1.0 / tl.sqrt(sq / D + head_eps))[:, None]
                if head < H:
                    w1 = tl.load(qn_ptr + dims)[None, :]
                    w2 = tl.load(qn_ptr + half + dims)[None, :]
                else:
                    w1 = tl.load(kn_ptr + dims)[None, :]
                    w2 = tl.load(kn_ptr + half + dims)[None, :]
                x1 = scaled_norm(x1, head_rstd, w1, False).to(tl.float32)
                x2 = scaled_norm(x2, head_rstd, w2, False).to(tl.float32)
        rope_store(x1, x2, head, rows, ins_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, W,
                   H, KVH, D, SLOTS)

    @triton.jit
    def _matmul_add(a_ptr, w_ptr, s_ptr, o_ptr, res_ptr, mult, K: tl.constexpr, N: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    SCALED: tl.constexpr, WB: tl.constexpr, GS: tl.constexpr,
                    OFS: tl.constexpr, F32_DOT: tl.constexpr):
        # Program (row tile, column tile): res += a @ w.T as a bf16 linear then a bf16 add (the
        # product rounded; SCALED: then times mult, rounded: Granite's residual multiplier).
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        inside = cols < N
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(a_ptr + rows[:, None] * K + ks[None, :])
            w = weight_tile(w_ptr, s_ptr, o_ptr, cols, ks, inside, K, WB, GS, OFS, a.dtype)
            acc = acc + dot(a, w, F32_DOT)
        at = res_ptr + rows[:, None] * N + cols[None, :]
        r = tl.load(at, mask=inside[None, :], other=0.0)
        prod = acc.to(r.dtype)
        if SCALED:
            prod = (prod.to(tl.float32) * mult).to(r.dtype)
        out = prod.to(tl.float32) + r.to(tl.float32)
        tl.store(at, out.to(r.dtype), mask=inside[None, :])

    @triton.jit
    def _norm_gate_up(x_ptr, norm_ptr, eps, w_ptr, s_ptr, o_ptr, out_ptr, K: tl.constexpr,
                      N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      NORM: tl.constexpr, WB: tl.constexpr, GS: tl.constexpr,
                      OFS: tl.constexpr, F32_DOT: tl.constexpr):
        # Program (row tile, column tile): RMSNorm of the rows (where NORM), their gate and up
        # products (weights stacked gate first), and silu(gate) * up rounded as LlamaMLP rounds.
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        inside = cols < N
        if NORM:
            rstd = row_rstd(x_ptr, rows, eps, K, BM, BK)
        else:
            rstd = tl.zeros([BM], tl.float32)
        gate = tl.zeros([BM, BN], tl.float32)
        up = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            x = _chunk(x_ptr, norm_ptr, rows, rstd, k0, K, BK, NORM, False)
            ks = k0 + tl.arange(0, BK)
            w_g = weight_tile(w_ptr, s_ptr, o_ptr, cols, ks, inside, K, WB, GS, OFS, x.dtype)
            w_u = weight_tile(w_ptr, s_ptr, o_ptr, cols + N, ks, inside, K, WB, GS, OFS, x.dtype)
            gate = gate + dot(x, w_g, F32_DOT)
            up = up + dot(x, w_u, F32_DOT)
        dt = out_ptr.dtype.element_ty
        g = gate.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        out = act * up.to(dt).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(dt), mask=inside[None, :])

    @triton.jit
    def _norm_matmul(x_ptr, norm_ptr, eps, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr, row0, divisor,
                     K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, NORM: tl.constexpr, ONE_ROUNDING: tl.constexpr,
                     HAS_BIAS: tl.constexpr, DIVIDED: tl.constexpr, WB: tl.constexpr,
                     GS: tl.constexpr, OFS: tl.constexpr, F32_DOT: tl.constexpr):
        # Program (row tile, column tile): RMSNorm of the rows from row0 on (where NORM) and
        # their product with w (the output head, or a plain linear), plus the bias, rounded to
        # the dtype; DIVIDED: then divided by divisor, rounded (Granite's logits scaling).
        rows = row0 + tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        inside = cols < N
        if NORM:
            rstd = row_rstd(x_ptr, rows, eps, K, BM, BK)
        else:
            rstd = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            x = _chunk(x_ptr, norm_ptr, rows, rstd, k0, K, BK, NORM, ONE_ROUNDING)
            ks = k0 + tl.arange(0, BK)
            w = weight_tile(w_ptr, s_ptr, o_ptr, cols, ks, inside, K, WB, GS, OFS, x.dtype)
            acc = acc + dot(x, w, F32_DOT)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=inside, other=0.0)[None, :].to(tl.float32)
        dt = out_ptr.dtype.element_ty
        out = acc.to(dt)
        if DIVIDED:
            out = (out.to(tl.float32) / divisor).to(dt)
        out_rows = rows - row0
        tl.store(out_ptr + out_rows[:, None] * N + cols[None, :], out, mask=inside[None, :])


def rows_of(x: torch.Tensor) -> int:
    """``x``'s rows, refused unless whole row tiles (:data:`BLOCK_M`)."""
    rows = x.shape[0]
    if rows % BLOCK_M:
        raise ValueError(f"the fused kernels take rows in multiples of {BLOCK_M}, got {rows}")
    return rows


def check_depth(k: int, what: str) -> None:
    """Refuse an inner dimension that is not whole reduction steps."""
    if k % BLOCK_K:
        raise ValueError(f"the fused kernels take {what} in multiples of {BLOCK_K}, got {k}")


def qkv_rope(x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor | TileWeight,
             bias: torch.Tensor | None, ins: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             keys: torch.Tensor, values: torch.Tensor, heads: int, kv_heads: int, *,
             head_norms: tuple[Norm, Norm] | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` ``[width, hidden]``, its query/key/value product (``weight`` stacked
    q, k, v), rotary embedding at the rows' positions, keys and values written into the pool
    layer ``[blocks, kv_heads, SLOTS, dim]`` at the rows' slots (``ins``: :func:`staging`).
    ``head_norms``: the queries' and keys' RMSNorms over each head, before the rotation
    (Qwen3). Returns the queries ``[width, heads * dim]``."""
    width, hidden = rows_of(x), x.shape[1]
    check_depth(hidden, "hidden sizes")
    dim = cos.shape[-1]
    q = torch.empty((width, heads * dim), dtype=x.dtype, device=x.device)
    (qn, _), (kn, head_eps) = head_norms if head_norms is not None else ((norm, 0.0), (norm, 0.0))
    ptrs, meta = kernel_args(weight)
    launch(_qkv_rope, (width // BLOCK_M, heads + 2 * kv_heads), x, norm, eps, *ptrs,
           bias if bias is not None else norm, qn, kn, head_eps, ins, cos, sin, q, keys,
           values, width, K=hidden, H=heads, KVH=kv_heads, D=dim, BM=BLOCK_M, BK=BLOCK_K,
           SLOTS=SPLIT, HAS_BIAS=bias is not None, HEAD_NORM=head_norms is not None, **meta)
    return q


def staging_size(width: int, splits: int) -> int:
    """int64 entries of a forward's staging (:func:`staging`)."""
    tiles = width // BLOCK_M
    return 3 * width + 3 * tiles + tiles * splits


def staging(ids: list[int], positions: list[int], slots: list[int],
            tiles: list[tuple[int, int, int, list[int]]], splits: int) -> list[int]:
    """A fused forward's int64 inputs, in one buffer: per row its token id, position and pool
    slot (``block * SLOTS + offset``; -1: not written), then per row tile of
    :data:`BLOCK_M` rows its sequence's committed length, first forward row and row count (0:
    a junk tile), then each tile's block table (``splits`` entries, the sequence's blocks in
    position order)."""
    kv = [t[0] for t in tiles]
    row0 = [t[1] for t in tiles]
    rows = [t[2] for t in tiles]
    table: list[int] = []
    for t in tiles:
        table += t[3][:splits] + [0] * (splits - len(t[3][:splits]))
    return [*ids, *positions, *slots, *kv, *row0, *rows, *table]


def matmul_add(a: torch.Tensor, weight: torch.Tensor | TileWeight, residual: torch.Tensor, *,
               scale: float = 1.0) -> None:
    """``residual += a @ weight.T`` in place (the product rounded first, as a linear's; with
    ``scale`` other than 1 then multiplied by it and rounded, Granite's residual multiplier)."""
    width, k = rows_of(a), a.shape[1]
    check_depth(k, "product depths")
    n = outputs(weight)
    block = 32
    ptrs, meta = kernel_args(weight)
    launch(_matmul_add, (width // BLOCK_M, -(-n // block)), a, *ptrs, residual, scale, K=k,
           N=n, BM=BLOCK_M, BN=block, BK=BLOCK_K, SCALED=scale != 1.0, **meta)


def norm_gate_up(x: torch.Tensor, norm: Norm | None,
                 weight: torch.Tensor | TileWeight) -> torch.Tensor:
    """``silu(gate) * up`` of RMSNorm(``x``) (``weight`` stacked gate, up; ``norm`` None: of
    ``x`` itself, as OLMo 2's MLP takes it): ``[width, n]``."""
    width, hidden = rows_of(x), x.shape[1]
    check_depth(hidden, "hidden sizes")
    n = outputs(weight) // 2
    out = torch.empty((width, n), dtype=x.dtype, device=x.device)
    block = 64
    w, eps = norm if norm is not None else (x, 0.0)
    ptrs, meta = kernel_args(weight)
    launch(_norm_gate_up, (width // BLOCK_M, -(-n // block)), x, w, eps, *ptrs, out,
           K=hidden, N=n, BM=BLOCK_M, BN=block, BK=BLOCK_K, NORM=norm is not None, **meta)
    return out


def norm_matmul(x: torch.Tensor, norm: Norm | None, weight: torch.Tensor | TileWeight,
                first: int | None = None, *, one_rounding: bool = False,
                bias: torch.Tensor | None = None, divisor: float = 1.0) -> torch.Tensor:
    """RMSNorm(``x``) ``@ weight.T`` (+ ``bias``): ``[rows, n]``, for every row or the tiles of
    the first ``first`` rows only. ``norm`` None: a plain linear of ``x``; ``one_rounding``: the
    norm rounded as OLMo 2's; ``divisor`` other than 1: the output divided by it and rounded
    (Granite's logits scaling)."""
    width, hidden = rows_of(x), x.shape[1]
    check_depth(hidden, "product depths")
    n = outputs(weight)
    rows = width if first is None else max(-(-first // BLOCK_M), 1) * BLOCK_M
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = 64
    w, eps = norm if norm is not None else (x, 0.0)
    ptrs, meta = kernel_args(weight)
    launch(_norm_matmul, (rows // BLOCK_M, -(-n // block)), x, w, eps, *ptrs,
           bias if bias is not None else x, out, 0, divisor, K=hidden, N=n, BM=BLOCK_M,
           BN=block, BK=BLOCK_K, NORM=norm is not None, ONE_ROUNDING=one_rounding,
           HAS_BIAS=bias is not None, DIVIDED=divisor != 1.0, **meta)
    return out
