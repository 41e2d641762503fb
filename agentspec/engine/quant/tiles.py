"""A GGUF weight as the fused forward's products read it on the GPU (:class:`TileWeight`).

The CPU's products read a weight in ``qmm.cpp``'s units of 32 output rows
(:class:`~agentspec.engine.quant.formats.QuantWeight`). The fused forward's Triton products
(:mod:`agentspec.engine.fused.kernels`) load a tile of ``[inputs, outputs]`` at a time, as they
load a bfloat16 weight's, and dequantise it as they load it; so here a weight is held row by
row: 4-bit values two a byte along the inputs (input 2i in the low nibble, 2i + 1 in the high
one), every wider format's a signed byte each (Q5_x's 0..31, Q6_K's -32..31, Q8_0's), and per
output row and group of inputs a scale and an offset (float16 where every one is a float16,
as a simple format's are, else float32: a K-quant's ``d * sc`` products). A loaded tile's
weight is ``scale * q + offset`` in float32, then rounded to the activations' dtype: the product
``scale * q`` is exact for every held format but Q6_K's, which has no offset, so the value is
gguf's own dequantisation, fused into an fma or not, and the tile is bitwise the bfloat16 model's
weights (the dequantised file rounded to bfloat16). The fused forward over these weights gives
the bfloat16 model's bits, at about a quarter of its weight bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from agentspec.engine.quant.formats import ROWS_AT_ONCE, Unpacked, unpack


class TileWeight:
    """A weight of ``n`` output rows and ``k`` inputs held quantized for the fused products
    (see the module's docstring); ``dtype`` is the activations' (the model's bfloat16 or
    float16), what :meth:`rows` and :meth:`matmul` return."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 bits: int, group: int, kind: str, dtype: torch.dtype = torch.bfloat16) -> None:
        self.codes, self.scale, self.offset = codes, scale, offset
        self.bits, self.group, self.kind, self.dtype = bits, group, kind, dtype
        self.n = int(codes.shape[0])
        self.k = int(codes.shape[1]) * (2 if bits == 4 else 1)

    @classmethod
    def of(cls, u: Unpacked, kind: str = "", *, device: torch.device | str = "cpu",
           dtype: torch.dtype = torch.bfloat16) -> TileWeight:
        """The weight ``u`` (its values, scales and offsets per row) in this layout."""
        q = u.q
        if u.bits == 4:
            pairs = q.astype(np.uint8).reshape(q.shape[0], -1, 2)
            codes = pairs[..., 0] | (pairs[..., 1] << 4)
        else:
            codes = q.astype(np.int8)
        params = [np.ascontiguousarray(p, dtype=np.float32) for p in (u.scale, u.offset)]
        exact16 = all(np.array_equal(p.astype(np.float16).astype(np.float32), p) for p in params)
        params = [p.astype(np.float16) if exact16 else p for p in params]
        none = not params[1].any() and not np.signbit(params[1]).any()  # every offset +0
        held = [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (codes, *params)]
        return cls(held[0], held[1], None if none else held[2], 4 if u.bits == 4 else 8,
                   u.group, kind, dtype)

    @classmethod
    def of_blocks(cls, kind: str, data: np.ndarray, n: int, k: int,
                  order: np.ndarray | None = None, *, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.bfloat16) -> TileWeight:
        """A ``kind`` tensor of ``n`` rows and ``k`` inputs from its raw blocks (``data``,
        ``[n, bytes a row]``; its rows in ``order`` where given), :data:`ROWS_AT_ONCE` rows
        unpacked at a time, each slice moved to ``device`` as it is made."""
        rows = np.asarray(data).reshape(n, -1)
        if order is not None:
            rows = rows[order]
        parts = [cls.of(unpack(kind, rows[r0 : r0 + ROWS_AT_ONCE], min(ROWS_AT_ONCE, n - r0), k),
                        kind, device=device, dtype=dtype) for r0 in range(0, n, ROWS_AT_ONCE)]
        return cls.stacked(parts) if len(parts) > 1 else parts[0]

    @classmethod
    def stacked(cls, weights: Sequence[TileWeight]) -> TileWeight:
        """The weights' rows one after another (a layer's query, key and value; its gate and
        up), of one input size. Weights of different formats (a Q4_K_M file's Q4_K query and
        Q6_K value) are stacked in the widest layout, a byte a value and the smallest group
        (the same values, more bytes); scales float32 where any is."""
        if any(w.k != weights[0].k for w in weights):
            raise ValueError("stacked weights take one input size, got "
                             f"{[(w.kind, w.k) for w in weights]}")
        if len({(w.bits, w.group) for w in weights}) > 1:
            group = min(w.group for w in weights)
            weights = [w.widened(group) for w in weights]
        first = weights[0]
        wide = any(w.scale.dtype == torch.float32 for w in weights)
        as_dtype = torch.float32 if wide else torch.float16
        scale = torch.cat([w.scale.to(as_dtype) for w in weights])
        offset = None
        if any(w.offset is not None for w in weights):
            offset = torch.cat([w.offset.to(as_dtype) if w.offset is not None
                                else torch.zeros_like(w.scale, dtype=as_dtype) for w in weights])
        kinds = {w.kind for w in weights}
        return cls(torch.cat([w.codes for w in weights]), scale, offset, first.bits, first.group,
                   kinds.pop() if len(kinds) == 1 else "mixed", first.dtype)

    def widened(self, group: int) -> TileWeight:
        """The same weight with a byte a value and groups of ``group`` inputs (a divisor of
        its own): each scale and offset repeated over its smaller groups."""
        codes = self._values(self.codes).to(torch.int8) if self.bits == 4 else self.codes
        times = self.group // group

        offset = None if self.offset is None else self.offset.repeat_interleave(times, dim=1)
        return TileWeight(codes, self.scale.repeat_interleave(times, dim=1), offset, 8, group,
                          self.kind, self.dtype)

    def view_rows(self, start: int, stop: int) -> TileWeight:
        """Rows ``[start, stop)``, sharing this weight's memory (a stacked weight's parts)."""
        return TileWeight(self.codes[start:stop], self.scale[start:stop],
                          None if self.offset is None else self.offset[start:stop],
                          self.bits, self.group, self.kind, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        held = [self.codes, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        if self.bits == 4:
            low, high = codes & 0x0F, codes >> 4
            return torch.stack([low, high], dim=-1).reshape(*codes.shape[:-1], -1).float()
        return codes.float()

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor,
                    offset: torch.Tensor | None) -> torch.Tensor:
        w = scale.float().repeat_interleave(self.group, -1) * self._values(codes)
        if offset is not None:
            w = w + offset.float().repeat_interleave(self.group, -1)
        return w

    def dequantized(self) -> torch.Tensor:
        """The whole weight in float32 ``[n, k]``: gguf's values (a reference, and what reads
        a weight outside a forward)."""
        return self._dequantize(self.codes, self.scale, self.offset)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight (an embedding's lookup) in ``dtype``: ``[..., k]``."""
        flat = ids.reshape(-1).to(self.codes.device, torch.int64)
        offset = None if self.offset is None else self.offset[flat]
        out = self._dequantize(self.codes[flat], self.scale[flat], offset).to(self.dtype)
        return out.reshape(*ids.shape, self.k)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` as the bfloat16 model's linear computes it (the weight
        dequantised for the call, then dropped): the modules' path, where the fused forward
        does not run."""
        w = self.dequantized().to(x.dtype)
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


def kernel_args(weight: torch.Tensor | TileWeight) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """A fused product's weight as its kernel takes it: the pointers (values, scales, offsets;
    a dense weight's own three times) and the constants (``WB``: 0 dense, else the bits;
    ``GS``: the group; ``OFS``: whether it has offsets)."""
    if isinstance(weight, TileWeight):
        offset = weight.offset if weight.offset is not None else weight.scale
        return ((weight.codes, weight.scale, offset),
                {"WB": weight.bits, "GS": weight.group, "OFS": weight.offset is not None})
    return (weight, weight, weight), {"WB": 0, "GS": 1, "OFS": False}


def outputs(weight: torch.Tensor | TileWeight) -> int:
    """A fused product's weight's output rows."""
    return weight.n if isinstance(weight, TileWeight) else int(weight.shape[0])
