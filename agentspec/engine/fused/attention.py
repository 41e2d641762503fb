"""The fused forward's attention: each row tile's queries over its own sequence's keys in the
KV pool, in splits of one pool block each, then the splits combined in position order.

Keys are reduced in blocks fixed by their position (:data:`BLOCK_N` keys, one pool block of
:data:`~agentspec.engine.fused.kernels.SPLIT` positions a split); a block a row sees nothing of
leaves that row's running state as it was, and a split a row sees nothing of adds nothing to
the combination, so neither how far the loops read nor how many splits a forward launches
changes a row. A row tile holds one sequence's rows and reads only its blocks, so the rows of
other sequences in the same forward change nothing either.
"""

from __future__ import annotations

import torch

from agentspec.engine.fused import kernels
from agentspec.engine.fused.kernels import BLOCK_M, SPLIT, launch, rows_of

BLOCK_N = 64
"""Keys per attention block: a row's scores are reduced block by block from slot 0."""

if kernels.AVAILABLE:
    import triton
    import triton.language as tl

    from agentspec.engine.fused.kernels import dot

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
                    scores = dot(q, k, F32_DOT) * scale
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
                    part = dot(p.to(v.dtype), v, F32_DOT)
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


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, anc: torch.Tensor,
              ins: torch.Tensor, scale: float, scratch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Attention of ``q`` ``[width, heads * dim]`` over the pool layer ``[blocks, kv_heads,
    SLOTS, dim]``: a row tile's rows see every position of their sequence below its committed
    length, and the sequence's forward rows ``c`` where ``anc[r, row0 + c]`` (``ins``: the
    staging, :func:`~agentspec.engine.fused.kernels.staging`). ``scratch``: the splits'
    partial state (:func:`attention_scratch`). Returns ``[width, heads * dim]``."""
    width = rows_of(q)
    kv_heads, dim = keys.shape[1], keys.shape[3]
    heads = q.shape[1] // dim
    m, total, acc = scratch
    splits = m.shape[0]
    launch(_attention_split, (heads, width // BLOCK_M, splits), q, keys, values, anc, ins,
           m, total, acc, scale, width, H=heads, KVH=kv_heads, GROUPS=heads // kv_heads, D=dim,
           BM=BLOCK_M, BN=BLOCK_N, SLOTS=SPLIT, SPLITS=splits)
    out = torch.empty_like(q)
    launch(_attention_combine, (width // BLOCK_M, heads), m, total, acc, out, ins, width,
           H=heads, D=dim, SPLITS=splits, SLOTS=SPLIT, BM=BLOCK_M)
    return out


def attention_scratch(width: int, heads: int, dim: int, splits: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partial state of attention's splits for sequences of up to ``splits`` blocks
    (maxima, sums, accumulators), allocated once per forward shape."""
    return (torch.empty((splits, width, heads), dtype=torch.float32, device=device),
            torch.empty((splits, width, heads), dtype=torch.float32, device=device),
            torch.empty((splits, width, heads, dim), dtype=torch.float32, device=device))
