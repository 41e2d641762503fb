"""GGUF's quantized blocks, read into the layout the native products take (``qmm.cpp``).

Each format's blocks are read into three per-row arrays: the quantized values (one integer an
input), and a scale and an offset per group of inputs, such that the weight is
``fma(scale, q, offset)``: bitwise the value gguf's own dequantisation (``gguf.quants``) gives,
because its product of a scale and a quantized value is exact in float32 and rounds once, as
the fma does:

======  ==========  =====================================  ================================
format  group       q                                      scale, offset
======  ==========  =====================================  ================================
Q4_0    32          0..15                                  d, -8d
Q4_1    32          0..15                                  d, m
Q5_0    32          0..31                                  d, -16d
Q5_1    32          0..31                                  d, m
Q8_0    32          -128..127                              d, 0
Q4_K    32 (of 256) 0..15                                  d * sc, -(dmin * m)
Q5_K    32 (of 256) 0..31                                  d * sc, -(dmin * m)
Q6_K    16 (of 256) -32..31                                d * sc, 0
======  ==========  =====================================  ================================

The values are held in their bits: 4 and 8 as they are; 5 and 6 (Q5_x, Q5_K; Q6_K, held as
q + 32) as 4-bit low nibbles laid out as the 4-bit formats' and one or two planes of their high
bits. The scales and offsets are held as float16 where every one of a tensor's is a float16 value
(the file's own: Q4_0, Q4_1, Q5_x, Q8_0); a K-quant's as the file's factors, a float16 scale per
256 inputs and a small integer per group, whose product is its scale exactly; else float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from agentspec.engine.quant import native

TILE = 64
"""Output rows per tile: a tile is computed whole by one thread."""

ROWS_AT_ONCE = 8192
"""Rows of a tensor unpacked at a time as it is held (a multiple of :data:`TILE`): a whole
vocabulary's output matrix unpacked at once would take several times its held bytes."""

FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
WIDER = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")
FORMATS = (*FOUR_BIT, *WIDER)
"""The GGUF quantization types held as stored."""


@dataclass(frozen=True)
class Unpacked:
    """A quantized weight as per-row arrays: ``q`` ``[N, K]`` integers, ``scale`` and
    ``offset`` ``[N, K / group]`` float32, the weight ``fma(scale, q, offset)``.

    ``factors``, for the K-quants: ``(d, sc, dm, m)``, the scale the exact float32 product of
    a float16 ``d`` per 256 inputs and an integer ``sc`` per group (``[N, K / 256]``,
    ``[N, K / group]``), the offset that of ``dm`` and ``m``: held so, a K-quant takes about
    its file's bytes."""

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    group: int
    bits: int
    factors: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def unpack(kind: str, data: np.ndarray, n: int, k: int) -> Unpacked:
    """The blocks of a ``kind`` tensor of ``n`` rows and ``k`` inputs (``data``: its raw bytes,
    ``[n, bytes a row]``) as :class:`Unpacked`.

    Raises:
        ValueError: a type not in :data:`FORMATS` (the message names it).
    """
    rows = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return _simple(kind, rows, n, k)
    if kind in ("Q4_K", "Q5_K"):
        return _q45_k(kind, rows, n, k)
    if kind == "Q6_K":
        return _q6_k(rows, n, k)
    raise ValueError(f"GGUF type {kind} is not held as stored (held: {', '.join(FORMATS)}); "
                     "load the model with dtype='float32' or 'bfloat16'")


def _simple(kind: str, rows: np.ndarray, n: int, k: int) -> Unpacked:
    size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[kind]
    b = rows.reshape(n, k // 32, size)
    d = _f16(b[..., 0:2]).reshape(n, k // 32)
    at = 2
    m = None
    if kind in ("Q4_1", "Q5_1"):
        m = _f16(b[..., 2:4]).reshape(n, k // 32)
        at = 4
    if kind == "Q8_0":
        q = b[..., at:].view(np.int8).reshape(n, k)
        return Unpacked(q, d, np.zeros_like(d), 32, 8)
    high = None
    if kind in ("Q5_0", "Q5_1"):
        high = b[..., at : at + 4].copy().view("<u4").reshape(n, k // 32, 1)
        at += 4
    qs = b[..., at : at + 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint8)  # [n, groups, 32]
    if high is not None:
        bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = q | (bits << 4)
    offset = m if m is not None else d * np.float32(-8.0 if high is None else -16.0)
    return Unpacked(q.reshape(n, k), d, offset, 32, 4 if high is None else 5)


def _q45_k(kind: str, rows: np.ndarray, n: int, k: int) -> Unpacked:
    """Q4_K (144 bytes per 256 inputs: d, dmin, the 6-bit scales and mins, 4-bit values) and
    Q5_K (176: the same, then a fifth bit of each value in 32 bytes before the low nibbles)."""
    five = kind == "Q5_K"
    b = rows.reshape(n, k // 256, 176 if five else 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [n, supers, 1]
    s = b[..., 4:16].astype(np.uint8)
    sc = np.empty((*s.shape[:2], 8), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    at = 48 if five else 16
    qs = b[..., at:].reshape(n, k // 256, 4, 32)  # 64 inputs a chunk: low nibbles, then high
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k // 256, 8, 32)
    if five:  # group g's fifth bits: bit g of the 32 bytes
        high = b[..., 16:48].reshape(n, k // 256, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        q = q | ((high & 1) << 4)
    scale = (d * sc.astype(np.float32)).reshape(n, k // 32)
    offset = (-dmin * mn.astype(np.float32)).reshape(n, k // 32)
    factors = (d.reshape(n, -1), sc.reshape(n, k // 32), -dmin.reshape(n, -1),
               mn.reshape(n, k // 32))
    return Unpacked(q.reshape(n, k).astype(np.uint8), scale, offset, 32, 5 if five else 4,
                    factors)


def _q6_k(rows: np.ndarray, n: int, k: int) -> Unpacked:
    b = rows.reshape(n, k // 256, 210)
    ql = b[..., 0:128].reshape(n, -1, 2, 64)  # per half: 64 bytes
    qh = b[..., 128:192].reshape(n, -1, 2, 32)
    sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [n, supers, 16]
    d = _f16(b[..., 208:210])
    lo = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F,
                         ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)  # [n, s, 2, 128]
    hi = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=-1)
    q = (lo.astype(np.int16) | (hi.astype(np.int16) << 4)) - 32
    scale = (d * sc).reshape(n, k // 16)
    zeros = np.zeros_like(d.reshape(n, -1))
    factors = (d.reshape(n, -1), sc.reshape(n, k // 16).astype(np.int8), zeros,
               np.zeros((n, k // 16), dtype=np.int8))
    return Unpacked(q.reshape(n, k).astype(np.int8), scale, np.zeros_like(scale), 16, 6, factors)


def _factored(u: Unpacked, units: int, pad: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A K-quant's scales and offsets as ``qmm.cpp`` holds them: per unit of 32 rows the
    float16 ``d`` per 256 inputs (``[supers][32]``), then the int8 ``sc`` per group
    (``[groups][32]``); the same for the offsets. None where the factors do not give the
    scales and offsets exactly (then they are held in float32)."""
    if u.factors is None:
        return None
    d, sc, dm, m = u.factors
    n, k = u.q.shape
    supers, groups = k // 256, k // u.group
    per = 256 // u.group
    exact = (all(np.array_equal(x.astype(np.float16).astype(np.float32), x) for x in (d, dm))
             and all(-128 <= int(x.min(initial=0)) and int(x.max(initial=0)) <= 127
                     for x in (sc, m))
             and np.array_equal(np.repeat(d, per, 1) * sc.astype(np.float32), u.scale)
             and np.array_equal(np.repeat(dm, per, 1) * m.astype(np.float32), u.offset))
    if not exact:
        return None
    out = []
    for big, small in ((d, sc), (dm, m)):
        big = np.pad(big, ((0, pad), (0, 0))).reshape(units, 32, supers).transpose(0, 2, 1)
        small = np.pad(small, ((0, pad), (0, 0))).reshape(units, 32, groups).transpose(0, 2, 1)
        out.append(np.concatenate(
            [np.ascontiguousarray(big.astype(np.float16)).view(np.uint8).reshape(units, -1),
             np.ascontiguousarray(small.astype(np.int8)).view(np.uint8).reshape(units, -1)],
            axis=1).reshape(-1))
    return out[0], out[1]


def _values(q: np.ndarray, bits: int, units: int, pad: int, groups: int, gs: int) -> np.ndarray:
    """A weight's values ``[n, k]`` in ``qmm.cpp``'s layout, as bytes: per unit of 32 rows,
    block of 16, group and chunk, the chunk's inputs of the block's rows, each row's two inputs
    in one 32-bit lane as the products widen them. 8 bits: chunk j inputs 2j, 2j + 1. 4 bits:
    chunk j inputs 4j, 4j + 1 in low nibbles, 4j + 2, 4j + 3 in high ones. 5 and 6 bits (6
    holds q + 32): the 4-bit chunk of the values' low nibbles, then per high bit an 8-byte plane,
    bit 2r + i of its first 4 bytes that bit of row r's input 4j + i, of the next 4 of 4j + 2 + i."""
    q = np.pad(q, ((0, pad), (0, 0)))
    if bits == 8:  # [units, blocks, 16 rows, groups, chunks, 2 inputs] -> rows inside chunks
        q = q.astype(np.int8).reshape(units, 2, 16, groups, gs // 2, 2)
        return np.ascontiguousarray(q.transpose(0, 1, 3, 4, 2, 5)).view(np.uint8).reshape(-1)
    v = (q.astype(np.int16) + (32 if bits == 6 else 0)).astype(np.uint8)
    v = v.reshape(units, 2, 16, groups, gs // 4, 2, 2)  # pair (low / high nibble), input
    low = v & 0x0F
    nibbles = (low[..., 0, :] | (low[..., 1, :] << 4)).transpose(0, 1, 3, 4, 2, 5)
    chunk = [np.ascontiguousarray(nibbles).reshape(units, 2, groups, gs // 4, 32)]
    for plane in range(bits - 4):
        bit = (v >> (4 + plane)) & 1  # -> [units, blocks, groups, chunks, pair, 16 rows, 2]
        bit = np.ascontiguousarray(bit.transpose(0, 1, 3, 4, 5, 2, 6))
        chunk.append(np.packbits(bit.reshape(units, 2, groups, gs // 4, 2, 32), axis=-1,
                                 bitorder="little").reshape(units, 2, groups, gs // 4, 8))
    return np.ascontiguousarray(np.concatenate(chunk, axis=-1)).reshape(-1)


class QuantWeight:
    """A weight of ``n`` output rows and ``k`` inputs, held quantized in units of 32 output
    rows (tiles of :data:`TILE`, see ``qmm.cpp``): :meth:`matmul` and :meth:`rows` run on it,
    nothing holds it in full precision."""

    def __init__(self, unpacked: Unpacked, kind: str = "") -> None:
        u = unpacked
        n, k = u.q.shape
        self.n, self.k, self.group, self.bits, self.kind = n, k, u.group, u.bits, kind
        units, groups, gs = 2 * -(-n // TILE), k // u.group, u.group
        pad = units * 32 - n
        self.q = torch.from_numpy(_values(u.q, u.bits, units, pad, groups, gs))
        scale = np.pad(u.scale, ((0, pad), (0, 0)))
        offset = np.pad(u.offset, ((0, pad), (0, 0)))
        # No offsets at all where every one is +0 (Q8_0, Q6_K): the products add none.
        none = np.array_equal(u.offset, np.zeros_like(u.offset)) and not np.signbit(u.offset).any()
        factored = _factored(u, units, pad)
        if factored is not None:  # d per 256 inputs and sc per group, per unit: see qmm.cpp
            self.params = 2
            self.scale, self.offset = (torch.from_numpy(f) for f in factored)
            if none:
                self.offset = self.offset[:0]
            return
        params = [p.reshape(units, 32, groups).transpose(0, 2, 1) for p in (scale, offset)]
        exact16 = all(np.array_equal(p.astype(np.float16).astype(np.float32), p) for p in params)
        dtype = np.float16 if exact16 else np.float32
        self.params = 0 if exact16 else 1
        self.scale, self.offset = (torch.from_numpy(np.ascontiguousarray(p.astype(dtype)))
                                   for p in params)
        if none:
            self.offset = self.offset.reshape(-1)[:0]

    @classmethod
    def of_blocks(cls, kind: str, data: np.ndarray, n: int, k: int,
                  order: np.ndarray | None = None) -> QuantWeight:
        """A ``kind`` tensor of ``n`` rows and ``k`` inputs held from its raw blocks (``data``,
        ``[n, bytes a row]``; its rows in ``order`` where given), :data:`ROWS_AT_ONCE` rows
        unpacked at a time: bitwise ``QuantWeight(unpack(kind, data[order], n, k))``, whose layout is
        unit by unit, at a fraction of its peak memory. Where the slices would hold their
        scales differently (float16 in one, float32 in another) the tensor is held whole."""
        rows = np.asarray(data).reshape(n, -1)
        if order is not None:
            rows = rows[order]
        parts = [cls(unpack(kind, rows[r0 : r0 + ROWS_AT_ONCE], min(ROWS_AT_ONCE, n - r0), k), kind)
                 for r0 in range(0, n, ROWS_AT_ONCE)]
        first = parts[0]
        if len(parts) > 1 and any((p.params, p.offset.numel() == 0)
                                  != (first.params, first.offset.numel() == 0) for p in parts):
            return cls(unpack(kind, rows, n, k), kind)
        out = cls.__new__(cls)
        out.n, out.k, out.group, out.bits, out.kind, out.params = (
            n, k, first.group, first.bits, kind, first.params)
        out.q, out.scale, out.offset = (torch.cat([getattr(p, a) for p in parts])
                                        for a in ("q", "scale", "offset"))
        return out

    @classmethod
    def bfloat16(cls, weight: torch.Tensor, kind: str = "bf16") -> QuantWeight:
        """A float weight ``[N, K]`` (K even) held in bfloat16 (rounded to nearest even where
        it is not bfloat16 already), in ``qmm.cpp``'s bits-16 layout: per unit of 32 rows and
        block of 16, each pair of inputs a run of 16 32-bit lanes. No scales."""
        w = weight.detach().to("cpu", torch.bfloat16).contiguous()
        if w.dim() != 2 or w.shape[1] % 2 or not w.shape[1]:
            raise ValueError(f"a bfloat16 weight takes a 2-D weight with an even number of "
                             f"inputs, got shape {tuple(w.shape)}")
        n, k = w.shape
        units = 2 * -(-n // TILE)
        halves = np.pad(w.view(torch.int16).numpy().view(np.uint16), ((0, units * 32 - n), (0, 0)))
        # [units, blocks, 16 rows, pairs, 2] -> [units, blocks, pairs, 16 rows, 2]
        q = halves.reshape(units, 2, 16, k // 2, 2).transpose(0, 1, 3, 2, 4)
        out = cls.__new__(cls)
        out.n, out.k, out.group, out.bits, out.kind, out.params = n, k, 2, 16, kind, 0
        out.q = torch.from_numpy(np.ascontiguousarray(q).view(np.uint8).reshape(-1))
        out.scale = torch.zeros(0, dtype=torch.float16)
        out.offset = torch.zeros(0, dtype=torch.float16)
        return out

    @property
    def offset_ptr(self) -> int | None:
        """The offsets' address, None where the weight has none (all +0)."""
        return self.offset.data_ptr() if self.offset.numel() else None

    @property
    def f32(self) -> bool:
        """Whether the scales and offsets are held as float32 (neither the file's float16 ones
        nor a K-quant's factors)."""
        return self.params == 1

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset))

    def _args(self) -> tuple[int, int, int, int, int | None, int]:
        return (self.q.data_ptr(), self.bits, self.group, self.scale.data_ptr(),
                self.offset_ptr, self.params)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` in float32: ``x`` ``[..., k]`` -> ``[..., n]``, each row of
        ``x`` quantized alone to 16 bits per group of 32 inputs and summed in integers (a
        bfloat16 weight's: two float32 fma chains per output, ``qmm.cpp``)."""
        rows = x.reshape(-1, self.k).float().contiguous()
        out = torch.empty((rows.shape[0], self.n), dtype=torch.float32)
        if rows.shape[0]:
            native.library().as_qmm(
                rows.data_ptr(), rows.shape[0], self.k, self.n, *self._args(),
                None if bias is None else bias.data_ptr(), out.data_ptr(), native.threads())
        return out.reshape(*x.shape[:-1], self.n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, dequantised (an embedding's lookup): ``[..., k]``."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.n):
            raise IndexError(f"row ids must be in [0, {self.n}), got {flat.min()}..{flat.max()}")
        out = torch.empty((flat.numel(), self.k), dtype=torch.float32)
        native.library().as_qrows(flat.data_ptr(), flat.numel(), self.k, *self._args(),
                                  out.data_ptr())
        return out.reshape(*ids.shape, self.k)

    def dequantized(self) -> torch.Tensor:
        """The whole weight in float32 ``[n, k]`` (a reference for tests)."""
        return self.rows(torch.arange(self.n))
