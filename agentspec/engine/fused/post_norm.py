"""The kernels OLMo 2's norm placement adds to the fused forward.

OLMo 2 normalises after its products rather than before them: the queries and keys each over
their whole projection (every head at once), the attention's output and the MLP's output each
before its residual add, and nothing before the products. A norm over a whole row cannot sit in
the epilogue of a product tiled by columns, so each such product writes its rounded output
(:func:`~agentspec.engine.fused.kernels.norm_matmul` without a norm) and one of these kernels
follows: :func:`qk_norm_rope` (the queries' and keys' norms, rotary embedding, the KV write) or
:func:`norm_add` (the norm, then the residual add). Both keep the fixed tiles of
:mod:`.kernels` (a program reads only its own rows, in an order fixed by the shapes), and round
as ``Olmo2RMSNorm`` does (the weight's product in float32, one rounding).
"""

from __future__ import annotations

import torch

from agentspec.engine.fused import kernels
from agentspec.engine.fused.kernels import BLOCK_M, SPLIT, Norm, launch, rows_of

if kernels.AVAILABLE:
    import triton
    import triton.language as tl

    from agentspec.engine.fused.kernels import rope_store, row_rstd, scaled_norm

    @triton.jit
    def _section_rstd(at, first, heads, eps, D: tl.constexpr, BM: tl.constexpr):
        # 1 / sqrt(mean(x^2) + eps) over `heads` heads of the rows from column `first` on,
        # summed head by head in order (`at`: the rows' starts).
        half: tl.constexpr = D // 2
        dims = tl.arange(0, half)
        sq = tl.zeros([BM], tl.float32)
        for j in range(0, heads):
            c = first + j * D
            y1 = tl.load(at + c + dims[None, :]).to(tl.float32)
            y2 = tl.load(at + c + half + dims[None, :]).to(tl.float32)
            sq += tl.sum(y1 * y1, axis=1) + tl.sum(y2 * y2, axis=1)
        return 1.0 / tl.sqrt(sq / (heads * D) + eps)

    @triton.jit
    def _qk_norm_rope(qkv_ptr, qn_ptr, kn_ptr, eps, ins_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr,
                      v_ptr, W, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                      BM: tl.constexpr, SLOTS: tl.constexpr, F32_DOT: tl.constexpr):
        # Program (row tile, head): the head's columns of the rows' query/key/value product
        # (stacked q, k, v); a query or key head normalised over the whole projection it is a
        # part of (all query heads, or all key heads), then written out rotated (rope_store).
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        head = tl.program_id(1)
        half: tl.constexpr = D // 2
        dims = tl.arange(0, half)
        at = qkv_ptr + rows[:, None] * ((H + 2 * KVH) * D)
        x1 = tl.load(at + head * D + dims[None, :]).to(tl.float32)
        x2 = tl.load(at + head * D + half + dims[None, :]).to(tl.float32)
        if head < H:
            rstd = _section_rstd(at, 0, H, eps, D, BM)[:, None]
            w1 = tl.load(qn_ptr + head * D + dims)[None, :]
            w2 = tl.load(qn_ptr + head * D + half + dims)[None, :]
            x1 = scaled_norm(x1, rstd, w1, True).to(tl.float32)
            x2 = scaled_norm(x2, rstd, w2, True).to(tl.float32)
        elif head < H + KVH:
            rstd = _section_rstd(at, H * D, KVH, eps, D, BM)[:, None]
            w1 = tl.load(kn_ptr + (head - H) * D + dims)[None, :]
            w2 = tl.load(kn_ptr + (head - H) * D + half + dims)[None, :]
            x1 = scaled_norm(x1, rstd, w1, True).to(tl.float32)
            x2 = scaled_norm(x2, rstd, w2, True).to(tl.float32)
        rope_store(x1, x2, head, rows, ins_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, W,
                   H, KVH, D, SLOTS)

    @triton.jit
    def _norm_add(x_ptr, norm_ptr, eps, res_ptr, K: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, F32_DOT: tl.constexpr):
        # Program (row tile, column tile): res += RMSNorm(x) on the tile's columns, x's rows'
        # rstd over the whole row (then a bf16 residual add).
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        rstd = row_rstd(x_ptr, rows, eps, K, BM, BN)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :]).to(tl.float32)
        w = tl.load(norm_ptr + cols)[None, :]
        h = scaled_norm(x, rstd[:, None], w, True).to(tl.float32)
        at = res_ptr + rows[:, None] * K + cols[None, :]
        r = tl.load(at)
        tl.store(at, (r.to(tl.float32) + h).to(r.dtype))


def qk_norm_rope(qkv: torch.Tensor, q_norm: Norm, k_norm: Norm, ins: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 heads: int, kv_heads: int) -> torch.Tensor:
    """The queries and keys of ``qkv`` ``[width, (heads + 2 * kv_heads) * dim]`` (a query/key/
    value product's output) RMSNormed over their whole projections (``q_norm``, ``k_norm``:
    weights of ``heads * dim`` and ``kv_heads * dim``, with one epsilon), rotated at the
    rows' positions; keys and values written into the pool layer at the rows' slots (``ins``:
    the staging, :func:`~agentspec.engine.fused.kernels.staging`). Returns the queries
    ``[width, heads * dim]``."""
    width = rows_of(qkv)
    dim = cos.shape[-1]
    q = torch.empty((width, heads * dim), dtype=qkv.dtype, device=qkv.device)
    (qn, _), (kn, eps) = q_norm, k_norm  # one epsilon (unsupported() checks)
    launch(_qk_norm_rope, (width // BLOCK_M, heads + 2 * kv_heads), qkv, qn, kn, eps, ins,
           cos, sin, q, keys, values, width, H=heads, KVH=kv_heads, D=dim, BM=BLOCK_M,
           SLOTS=SPLIT)
    return q


def norm_add(x: torch.Tensor, norm: Norm, residual: torch.Tensor) -> None:
    """``residual += RMSNorm(x)`` in place (``x``: a product's rounded output ``[width,
    hidden]``; the norm rounded as OLMo 2's, then the bf16 add)."""
    width, hidden = rows_of(x), x.shape[1]
    kernels.check_depth(hidden, "hidden sizes")
    block = kernels.BLOCK_K
    weight, eps = norm
    launch(_norm_add, (width // BLOCK_M, hidden // block), x, weight, eps, residual,
           K=hidden, BM=BLOCK_M, BN=block)
