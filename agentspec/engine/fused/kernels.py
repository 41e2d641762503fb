"""The fused forward's Triton kernels and their launchers.

A decoder layer is six kernels: RMSNorm fused into the query/key/value product, whose epilogue
applies rotary embedding and writes the keys and values into the KV pool; attention over each
row tile's own sequence in splits of one pool block each; the splits' combination; the output product with the residual
add in its epilogue; RMSNorm fused into the gate/up product with SiLU-and-multiply in its
epilogue; and the down product with the residual add. The output head is one more product with
the final RMSNorm fused in. Each launcher allocates nothing but its outputs, so a forward of
them can be captured as a CUDA graph.

Exactness rules, the engine's own (``docs/architecture.md``): a row's results depend only on
that row's inputs and the keys it may see, never on how many rows its forward has, where the
row sits among them or how long the KV is. Every product here is computed in tiles of a fixed
shape (:data:`BLOCK_M` rows, :data:`BLOCK_K` deep, reduced in order along the inner dimension),
so a row's bits are the same in a forward of 16 rows or of 512; attention reduces keys in
blocks fixed by their position (:data:`BLOCK_N`, :data:`SPLIT`: one pool block a split) and
skips blocks a row sees nothing of (a skipped block leaves that row's state unchanged, so
reading more of the KV never changes a row). A tile's rows are one sequence's, so rows of other
sequences in the same forward change nothing either. Rounding follows transformers' Llama modules (a bf16 rounding wherever they
round), so the fused path stays within bf16 rounding of the module path it replaces.

Without CUDA the kernels run in Triton's interpreter: the tests and the operation counter run
them on the CPU, slowly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from agentspec.engine.fused import interpret_without_gpu

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

BLOCK_N = 64
"""Keys per attention block: a row's scores are reduced block by block from slot 0."""

SPLIT = 256
"""Keys per attention split, the pool's block (:data:`agentspec.engine.pool.BLOCK`): each split
is a program of its own (a long context spreads over more of the GPU); a row's splits are
combined in position order."""

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


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
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
    def _dot(a, b, F32_DOT: tl.constexpr):
        # bf16 operands, float32 accumulation. The interpreter's products would read bf16
        # operands as integers, so there they are widened first (the same products, exactly).
        if F32_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32))
        return tl.dot(a, b)

    @triton.jit
    def _rstd(x_ptr, rows, eps, K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
        # 1 / sqrt(mean(x^2) + eps) of BM rows, summed over the row in BK chunks, in order.
        sq = tl.zeros([BM], tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rows[:, None] * K + cols[None, :]).to(tl.float32)
            sq += tl.sum(x * x, axis=1)
        return 1.0 / tl.sqrt(sq / K + eps)

    @triton.jit
    def _normed(x_ptr, norm_ptr, rows, rstd, k0, K: tl.constexpr, BK: tl.constexpr):
        # A chunk of RMSNorm's output, rounded as LlamaRMSNorm rounds: (x * rstd) to the
        # dtype, times the weight, to the dtype.
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :])
        n = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        w = tl.load(norm_ptr + cols)
        return (w[None, :].to(tl.float32) * n.to(tl.float32)).to(x.dtype)

    @triton.jit
    def _qkv_rope(x_ptr, norm_ptr, eps, w_ptr, bias_ptr, ins_ptr, cos_ptr, sin_ptr,
                  q_ptr, k_ptr, v_ptr, W, K: tl.constexpr, H: tl.constexpr,
                  KVH: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                  BK: tl.constexpr, SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  F32_DOT: tl.constexpr):
        # Program (row tile, head): RMSNorm of the rows, their product with the head's
        # weights (its two halves apart, for the rotation), rotary embedding at the rows'
        # positions, and the head written out: queries to q, keys and values into the pool at
        # the rows' slots (block * SLOTS + offset; a junk row's slot is -1: not written).
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        head = tl.program_id(1)
        half: tl.constexpr = D // 2
        dims = tl.arange(0, half)
        rstd = _rstd(x_ptr, rows, eps, K, BM, BK)
        lo = tl.zeros([BM, half], tl.float32)
        hi = tl.zeros([BM, half], tl.float32)
        w_rows = head * D + dims
        for k0 in range(0, K, BK):
            x = _normed(x_ptr, norm_ptr, rows, rstd, k0, K, BK)
            cols = k0 + tl.arange(0, BK)
            w_lo = tl.load(w_ptr + w_rows[None, :] * K + cols[:, None])  # [BK, half]
            w_hi = tl.load(w_ptr + (w_rows[None, :] + half) * K + cols[:, None])
            lo = lo + _dot(x, w_lo, F32_DOT)
            hi = hi + _dot(x, w_hi, F32_DOT)
        if HAS_BIAS:
            lo += tl.load(bias_ptr + w_rows)[None, :].to(tl.float32)
            hi += tl.load(bias_ptr + w_rows + half)[None, :].to(tl.float32)
        dt = q_ptr.dtype.element_ty
        x1 = lo.to(dt).to(tl.float32)  # the product's output, rounded as a bf16 linear's
        x2 = hi.to(dt).to(tl.float32)
        slot = tl.load(ins_ptr + 2 * W + rows)
        keep = slot >= 0
        at_kv = ((slot // SLOTS) * KVH) * SLOTS * D + (slot % SLOTS) * D  # [BM], head 0
        if head < H + KVH:  # queries and keys: rotated as apply_rotary_pos_emb rounds
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
    def _tile(ins_ptr, W, tile, BM: tl.constexpr):
        # A row tile's sequence: its committed length, the forward row its rows start at, and
        # how many rows it has in this forward (0: a junk tile); where its block table starts.
        tiles = W // BM
        base = 3 * W
        kv_len = tl.load(ins_ptr + base + tile)
        row0 = tl.load(ins_ptr + base + tiles + tile)
        n = tl.load(ins_ptr + base + 2 * tiles + tile)
        return kv_len, row0, n, base + 3 * tiles

    @triton.jit
    def _attention_split(q_ptr, k_ptr, v_ptr, anc_ptr, ins_ptr, m_ptr, l_ptr, acc_ptr, scale,
                         W, H: tl.constexpr, KVH: tl.constexpr, GROUPS: tl.constexpr,
                         D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         SLOTS: tl.constexpr, SPLITS: tl.constexpr, F32_DOT: tl.constexpr):
        # Program (head, row tile, split): the online softmax of BM query rows over the keys
        # of one block of their sequence (positions split * SLOTS on, read from the pool block
        # its table names), BN keys at a time from the block's first. A key block where a row
        # sees no key leaves that row's max, sum and accumulator as they were (bitwise), so the
        # result does not depend on how far the loop reads. Writes the split's partial state.
        head = tl.program_id(0)
        tile = tl.program_id(1)
        rows = tile * BM + tl.arange(0, BM)
        split = tl.program_id(2)
        kvh = head // GROUPS
        kv_len, row0, n, table = _tile(ins_ptr, W, tile, BM)
        end = kv_len + n  # positions past the tile's sequence's last row hold nothing it sees
        if split * SLOTS < end:
            block = tl.load(ins_ptr + table + tile * SPLITS + split)
            base = (block * KVH + kvh) * SLOTS * D
            dims = tl.arange(0, D)
            q = tl.load(q_ptr + rows[:, None] * H * D + head * D + dims[None, :])
            m = tl.full([BM], float("-inf"), tl.float32)
            total = tl.zeros([BM], tl.float32)
            acc = tl.zeros([BM, D], tl.float32)
            for b in range(0, SLOTS // BN):
                start = split * SLOTS + b * BN
                if start < end:
                    offs = b * BN + tl.arange(0, BN)
                    cols = split * SLOTS + offs  # the keys' positions
                    k = tl.load(k_ptr + base + offs[None, :] * D + dims[:, None])  # [D, BN]
                    scores = _dot(q, k, F32_DOT) * scale
                    rel = cols - kv_len
                    mine = (rel >= 0) & (rel < n)
                    anc = tl.load(anc_ptr + rows[:, None] * W + row0 + rel[None, :],
                                  mask=mine[None, :], other=0)
                    seen = (cols[None, :] < kv_len) | (anc != 0)
                    scores = tl.where(seen, scores, float("-inf"))
                    top = tl.max(scores, axis=1)
                    any_seen = top > float("-inf")
                    new_m = tl.where(any_seen, tl.maximum(m, top), 0.0)
                    alpha = tl.where(any_seen, tl.exp(m - new_m), 1.0)
                    p = tl.where(seen, tl.exp(scores - new_m[:, None]), 0.0)
                    v = tl.load(v_ptr + base + offs[:, None] * D + dims[None, :])
                    part = _dot(p.to(v.dtype), v, F32_DOT)
                    acc = tl.where(any_seen[:, None], acc * alpha[:, None] + part, acc)
                    total = tl.where(any_seen, total * alpha + tl.sum(p, axis=1), total)
                    m = tl.where(any_seen, new_m, m)
            at = (split * W + rows) * H + head
            tl.store(m_ptr + at, m)
            tl.store(l_ptr + at, total)
            tl.store(acc_ptr + at[:, None] * D + dims[None, :], acc)

    @triton.jit
    def _attention_combine(m_ptr, l_ptr, acc_ptr, out_ptr, ins_ptr, W,
                           H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                           SLOTS: tl.constexpr, BM: tl.constexpr, F32_DOT: tl.constexpr):
        # Program (row tile, head): the splits' partial states added in position order. A
        # split a row sees nothing of adds nothing, so more splits (a longer table) change no
        # row. A junk tile (no sequence) writes zeros.
        tile = tl.program_id(0)
        rows = tile * BM + tl.arange(0, BM)
        head = tl.program_id(1)
        dims = tl.arange(0, D)
        kv_len, row0, n, table = _tile(ins_ptr, W, tile, BM)
        end = kv_len + n
        top = tl.full([BM], float("-inf"), tl.float32)
        for s in range(0, SPLITS):
            if s * SLOTS < end:
                top = tl.maximum(top, tl.load(m_ptr + (s * W + rows) * H + head))
        total = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for s in range(0, SPLITS):
            if s * SLOTS < end:
                at = (s * W + rows) * H + head
                ms = tl.load(m_ptr + at)
                seen = ms > float("-inf")
                scale = tl.where(seen, tl.exp(ms - top), 0.0)
                total = tl.where(seen, total + tl.load(l_ptr + at) * scale, total)
                part = tl.load(acc_ptr + at[:, None] * D + dims[None, :])
                acc = tl.where(seen[:, None], acc + part * scale[:, None], acc)
        out = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
        tl.store(out_ptr + rows[:, None] * H * D + head * D + dims[None, :],
                 out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _matmul_add(a_ptr, w_ptr, res_ptr, K: tl.constexpr, N: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    F32_DOT: tl.constexpr):
        # Program (row tile, column tile): res += a @ w.T, the product rounded to the dtype
        # and then the sum (a bf16 linear, then a bf16 residual add).
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        inside = cols < N
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(a_ptr + rows[:, None] * K + ks[None, :])
            w = tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=inside[None, :], other=0.0)
            acc = acc + _dot(a, w, F32_DOT)
        at = res_ptr + rows[:, None] * N + cols[None, :]
        r = tl.load(at, mask=inside[None, :], other=0.0)
        out = acc.to(r.dtype).to(tl.float32) + r.to(tl.float32)
        tl.store(at, out.to(r.dtype), mask=inside[None, :])

    @triton.jit
    def _norm_gate_up(x_ptr, norm_ptr, eps, w_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      F32_DOT: tl.constexpr):
        # Program (row tile, column tile): RMSNorm of the rows, their gate and up products
        # (weights stacked gate first), and silu(gate) * up rounded as LlamaMLP rounds.
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        inside = cols < N
        rstd = _rstd(x_ptr, rows, eps, K, BM, BK)
        gate = tl.zeros([BM, BN], tl.float32)
        up = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            x = _normed(x_ptr, norm_ptr, rows, rstd, k0, K, BK)
            ks = k0 + tl.arange(0, BK)
            w_g = tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=inside[None, :], other=0.0)
            w_u = tl.load(w_ptr + (cols[None, :] + N) * K + ks[:, None], mask=inside[None, :],
                          other=0.0)
            gate = gate + _dot(x, w_g, F32_DOT)
            up = up + _dot(x, w_u, F32_DOT)
        dt = out_ptr.dtype.element_ty
        g = gate.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        out = act * up.to(dt).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(dt), mask=inside[None, :])

    @triton.jit
    def _norm_matmul(x_ptr, norm_ptr, eps, w_ptr, out_ptr, row0, K: tl.constexpr,
                     N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     F32_DOT: tl.constexpr):
        # Program (row tile, column tile): RMSNorm of the rows from row0 on and their product
        # with w (the output head), rounded to the dtype.
        rows = row0 + tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        inside = cols < N
        rstd = _rstd(x_ptr, rows, eps, K, BM, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            x = _normed(x_ptr, norm_ptr, rows, rstd, k0, K, BK)
            ks = k0 + tl.arange(0, BK)
            w = tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=inside[None, :], other=0.0)
            acc = acc + _dot(x, w, F32_DOT)
        out_rows = rows - row0
        tl.store(out_ptr + out_rows[:, None] * N + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=inside[None, :])


def _rows(x: torch.Tensor) -> int:
    rows = x.shape[0]
    if rows % BLOCK_M:
        raise ValueError(f"the fused kernels take rows in multiples of {BLOCK_M}, got {rows}")
    return rows


def _inner(k: int, what: str) -> None:
    if k % BLOCK_K:
        raise ValueError(f"the fused kernels take {what} in multiples of {BLOCK_K}, got {k}")


def qkv_rope(x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor,
             bias: torch.Tensor | None, ins: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             keys: torch.Tensor, values: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """RMSNorm of ``x`` ``[width, hidden]``, its query/key/value product (``weight`` stacked
    q, k, v), rotary embedding at the rows' positions, keys and values written into the pool
    layer ``[blocks, kv_heads, SLOTS, dim]`` at the rows' slots (``ins``: the forward's staging,
    :func:`staging`). Returns the queries ``[width, heads * dim]``."""
    width, hidden = _rows(x), x.shape[1]
    _inner(hidden, "hidden sizes")
    dim = cos.shape[-1]
    q = torch.empty((width, heads * dim), dtype=x.dtype, device=x.device)
    _launch(_qkv_rope, (width // BLOCK_M, heads + 2 * kv_heads), x, norm, eps, weight,
            bias if bias is not None else weight, ins, cos, sin, q, keys, values, width,
            K=hidden, H=heads, KVH=kv_heads, D=dim, BM=BLOCK_M, BK=BLOCK_K, SLOTS=SPLIT,
            HAS_BIAS=bias is not None)
    return q


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, anc: torch.Tensor,
              ins: torch.Tensor, scale: float, scratch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Attention of ``q`` ``[width, heads * dim]`` over the pool layer ``[blocks, kv_heads,
    SLOTS, dim]``: a row tile's rows see every position of their sequence below its committed
    length, and the sequence's forward rows ``c`` where ``anc[r, row0 + c]`` (``ins``: the
    staging, :func:`staging`). ``scratch``: the splits' partial state
    (:func:`attention_scratch`). Returns ``[width, heads * dim]``."""
    width = _rows(q)
    kv_heads, dim = keys.shape[1], keys.shape[3]
    heads = q.shape[1] // dim
    m, total, acc = scratch
    splits = m.shape[0]
    _launch(_attention_split, (heads, width // BLOCK_M, splits), q, keys, values, anc, ins,
            m, total, acc, scale, width, H=heads, KVH=kv_heads, GROUPS=heads // kv_heads, D=dim,
            BM=BLOCK_M, BN=BLOCK_N, SLOTS=SPLIT, SPLITS=splits)
    out = torch.empty_like(q)
    _launch(_attention_combine, (width // BLOCK_M, heads), m, total, acc, out, ins, width,
            H=heads, D=dim, SPLITS=splits, SLOTS=SPLIT, BM=BLOCK_M)
    return out


def attention_scratch(width: int, heads: int, dim: int, splits: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partial state of attention's splits for sequences of up to ``splits`` blocks
    (maxima, sums, accumulators), allocated once per forward shape."""
    return (torch.empty((splits, width, heads), dtype=torch.float32, device=device),
            torch.empty((splits, width, heads), dtype=torch.float32, device=device),
            torch.empty((splits, width, heads, dim), dtype=torch.float32, device=device))


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


def matmul_add(a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> None:
    """``residual += a @ weight.T`` in place (the product rounded first, as a linear's)."""
    width, k = _rows(a), a.shape[1]
    _inner(k, "product depths")
    n = weight.shape[0]
    block = 32
    _launch(_matmul_add, (width // BLOCK_M, -(-n // block)), a, weight, residual, K=k, N=n,
            BM=BLOCK_M, BN=block, BK=BLOCK_K)


def norm_gate_up(x: torch.Tensor, norm: torch.Tensor, eps: float,
                 weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of RMSNorm(``x``) (``weight`` stacked gate, up): ``[width, n]``."""
    width, hidden = _rows(x), x.shape[1]
    _inner(hidden, "hidden sizes")
    n = weight.shape[0] // 2
    out = torch.empty((width, n), dtype=x.dtype, device=x.device)
    block = 64
    _launch(_norm_gate_up, (width // BLOCK_M, -(-n // block)), x, norm, eps, weight, out,
            K=hidden, N=n, BM=BLOCK_M, BN=block, BK=BLOCK_K)
    return out


def norm_matmul(x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor,
                first: int | None = None) -> torch.Tensor:
    """RMSNorm(``x``) ``@ weight.T`` (the output head): ``[rows, n]``, for every row or the
    tiles of the first ``first`` rows only."""
    width, hidden = _rows(x), x.shape[1]
    _inner(hidden, "hidden sizes")
    n = weight.shape[0]
    rows = width if first is None else max(-(-first // BLOCK_M), 1) * BLOCK_M
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = 64
    _launch(_norm_matmul, (rows // BLOCK_M, -(-n // block)), x, norm, eps, weight, out,
            0, K=hidden, N=n, BM=BLOCK_M, BN=block, BK=BLOCK_K)
    return out
