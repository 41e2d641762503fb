"""The engine's KV cache and attention (transformers' side of them: :mod:`agentspec.engine.compat`).

Two pieces:

- :class:`FixedKV`: per-layer key and value buffers of a fixed capacity (static addresses, so a
  forward can be captured as a CUDA graph). A forward writes its rows at the slots in
  ``FixedKV.slots`` (a device tensor) and attends through its mask (a captured graph over all
  ``capacity`` rows, an eager forward over the blocks up to its last row): rows past the
  committed length hold stale values that the mask hides. Rolling back a chain is
  moving the committed length; nothing is copied.
- ``agentspec_sdpa`` attention: for the masked forwards of the engine, attention as products
  in float32 reduced in fixed blocks of keys (every query row computed alike, wherever it sits
  in its forward and however long the KV),
  reading grouped key/value heads once per group instead of copying the whole fixed-capacity
  KV with ``repeat_kv``.
  :func:`verifying_attention` switches a model to it for one forward and back, so a model
  shared with other code (the bench's ``hf-*`` baselines) stays unchanged.

Why fixed shapes: a row's logits must not depend on how many other rows its forward had, or
on how long the KV was, or drafts would change outputs (see ``docs/architecture.md``). With
attention reduced in fixed key blocks and the query width from one measured reduction class,
every row meets the same kernels in the same order, whatever the draft (``tests/integration/test_invariance.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from agentspec.engine import compat


class FixedKV:
    """Key and value buffers ``[1, kv_heads, capacity, head_dim]`` per layer.

    Duck-types the part of transformers' ``Cache`` that a decoder layer calls (``update``);
    the model always gets explicit position ids and a 4-D mask, so nothing else is asked.
    Buffers are allocated on the first forward (zeros: stale rows are always finite).
    """

    is_compileable = True

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.slots: torch.Tensor | None = None  # [width]: where the next forward's rows go
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self.keys):
            shape = (*key_states.shape[:2], self.capacity)
            self.keys.append(key_states.new_zeros((*shape, key_states.shape[-1])))
            self.values.append(value_states.new_zeros((*shape, value_states.shape[-1])))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        assert self.slots is not None and self.slots.shape[0] == key_states.shape[-2]
        keys.index_copy_(2, self.slots, key_states)
        values.index_copy_(2, self.slots, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.capacity

    def resized(self, capacity: int, rows: int) -> FixedKV:
        """A KV of another capacity holding this one's first ``rows`` rows."""
        if not 0 <= rows <= min(capacity, self.capacity):
            raise ValueError(f"cannot keep {rows} rows when resizing {self.capacity} -> {capacity}")
        out = FixedKV(capacity)
        for old, new in ((self.keys, out.keys), (self.values, out.values)):
            for buf in old:
                grown = buf.new_zeros((*buf.shape[:2], capacity, buf.shape[-1]))
                grown[:, :, :rows] = buf[:, :, :rows]
                new.append(grown)
        return out


ATTENTION = "agentspec_sdpa"
"""The name the engine's attention (:func:`agentspec_sdpa`) is registered under with
transformers: what :func:`verifying_attention` switches a model to (and where the bench hangs
a counting wrapper)."""


KEY_BLOCK = 256
"""Keys per attention block: every row's attention is reduced block by block in this fixed
size, so neither the KV capacity nor how much of it a forward reads can change its bits."""

PER_HEAD_BLOCKS = 8
"""From this many live key blocks on, attention on the CPU multiplies key/value head by head:
no copy of the live KV, which on a long context costs more than the extra products (on a short
one it saves less than they cost; BENCHMARKS.md). Not on other devices: there the copy is cheap
and each product is a kernel of the step's graph (three products and a stack in place of one,
twice a layer)."""

_LIVE_KEYS: ContextVar[int | None] = ContextVar("agentspec_live_keys", default=None)


@contextmanager
def live_keys(n: int | None) -> Iterator[None]:
    """Attend only the first ``n`` KV slots (rounded up to whole blocks) in the forwards inside.

    Exact: the slots past a forward's last row are masked for every row, and a block holding
    only masked keys adds exact zeros (see :func:`agentspec_sdpa`). Eager forwards only: a
    captured CUDA graph reads the whole capacity.
    """
    token = _LIVE_KEYS.set(n)
    try:
        yield
    finally:
        _LIVE_KEYS.reset(token)


def agentspec_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                   scaling: float | None = None, is_causal: bool | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention in float32, reduced in blocks of :data:`KEY_BLOCK` keys in a fixed order
    (registered as :data:`ATTENTION`).

    Not SDPA: the CPU flash kernel splits a forward's queries into blocks, and the same query
    row gave other bits at row 27 than at row 47 of a forward. And not one softmax and one
    product over the whole KV either: their reductions over the keys are blocked by the
    kernels according to the KV's length, so growing the capacity (or reading less of it)
    changed every row's bits. Here each row's scores are maxed over all keys (a max is exact in
    any order), exponentiated, and summed and multiplied with the values within blocks of a
    fixed size; the blocks' sums are added in a fixed tree (:func:`_fold_blocks`), and the
    output is divided by the sum at the end. A block past a row's keys holds only masked
    scores and adds exact zeros, so the result is the same bits for any capacity.

    Grouped key/value heads are read once per group of query heads (no ``repeat_kv`` copy of
    the fixed-capacity KV). Any other call (no boolean mask, dropout, softcap, ...) takes
    transformers' own sdpa path.
    """
    plain = (dropout == 0.0 and kwargs.get("softcap") is None
             and kwargs.get("position_bias") is None and kwargs.get("cache") is None
             and not kwargs.get("output_attentions", False))
    if not (plain and isinstance(attention_mask, torch.Tensor)
            and attention_mask.dtype == torch.bool and key.shape[-1] == value.shape[-1]):
        return compat.sdpa_attention(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    batch, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim ** -0.5
    live = _LIVE_KEYS.get()
    length = key.shape[2] if live is None else min(key.shape[2], -(-live // KEY_BLOCK) * KEY_BLOCK)
    key, value = key[:, :, :length], value[:, :, :length]
    pad = -length % KEY_BLOCK
    if pad:  # a capacity off the block size: masked zero keys make up the last block
        key = torch.nn.functional.pad(key, (0, 0, 0, pad))
        value = torch.nn.functional.pad(value, (0, 0, 0, pad))
    blocks = (length + pad) // KEY_BLOCK
    # [b, 1, blocks, g * w, KEY_BLOCK], and the range of blocks holding any masked key
    forbidden, (lo, hi) = _forbidden(attention_mask, groups, length, pad)
    # Query heads j * groups .. j * groups + groups - 1 share key/value head j (repeat_kv's order).
    q = query.reshape(batch, kv_heads, 1, groups * width, dim).float()  # [b, kvh, 1, g * w, dim]
    k = key.float().reshape(batch, kv_heads, blocks, KEY_BLOCK, dim)
    v = value.float().reshape(batch, kv_heads, blocks, KEY_BLOCK, dim)
    per_head = batch == 1 and blocks >= PER_HEAD_BLOCKS and key.device.type == "cpu"
    if per_head:
        # One product per key/value head: its blocks are one evenly strided batch, so nothing
        # of the KV is copied (one product over all heads copies the live KV: heads lie a
        # capacity apart, blocks a block apart). The same products, the same bits; more
        # operations, so only where the copy costs more (a long context).
        scores = torch.stack([torch.matmul(q[0, j], k[0, j].transpose(-1, -2))
                              for j in range(kv_heads)])[None]
    else:
        scores = torch.matmul(q, k.transpose(-1, -2))  # [b, kvh, blocks, g * w, KEY_BLOCK]
    # In place from here on: the same elementwise kernels, the same bits, but no temporaries
    # (the scores of a 256-row prompt chunk fill many MB a layer; each copy is a pass over them).
    scores.mul_(scale)
    # Only the blocks with a masked key are filled (on the CPU a prompt chunk's or a step's
    # earlier blocks are fully visible: filling them wrote nothing, in a pass over them).
    scores[:, :, lo:hi].masked_fill_(forbidden[:, :, lo:hi], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).amax(dim=2, keepdim=True)  # [b, kvh, 1, g * w, 1]
    weights = scores.sub_(top).exp_()  # every row attends itself: ``top`` is finite
    sums = weights.sum(dim=-1)  # [b, kvh, blocks, g * w]
    if per_head:
        parts = torch.stack([torch.matmul(weights[0, j], v[0, j]) for j in range(kv_heads)])[None]
    else:
        parts = torch.matmul(weights, v)  # [b, kvh, blocks, g * w, dim]
    total, out = _fold_blocks(sums), _fold_blocks(parts)
    out = (out / total[..., None]).reshape(batch, heads, width, dim).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _fold_blocks(x: torch.Tensor) -> torch.Tensor:
    """The sum over dim 2 (the key blocks) in one fixed order: a complete binary tree over the
    blocks padded with zeros to a power of two, neighbours first (``(x0 + x1) + (x2 + x3)``).
    Appending blocks of zeros (a larger capacity, a forward that reads more of the KV) leaves
    every partial sum's bits as they were, so the result does not depend on the number of
    blocks; and ``log2(blocks)`` additions where adding the blocks one after the other takes
    ``blocks - 1`` (on CUDA each addition is a kernel of the step's graph)."""
    n = x.shape[2]
    if n & (n - 1):  # not a power of two
        pad = [0, 0] * (x.dim() - 3) + [0, (1 << n.bit_length()) - n]
        x = torch.nn.functional.pad(x, pad)
    while x.shape[2] > 1:
        x = x[:, :, 0::2] + x[:, :, 1::2]
    return x[:, :, 0]


# The last forward's mask, as the blocks' "forbidden" tensor: every layer of a forward gets the
# same mask object, so it is laid out once per forward, not once per layer.
_LAST_MASK: tuple[torch.Tensor, tuple[int, int, int],
                  tuple[torch.Tensor, tuple[int, int]]] | None = None


def _forbidden(mask: torch.Tensor, groups: int, length: int,
               pad: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """``~mask`` over the first ``length`` keys (padded by ``pad`` masked keys) in the
    scores' layout: ``[b, 1, blocks, groups * width, KEY_BLOCK]``, and ``(lo, hi)``: the
    blocks outside ``lo:hi`` mask no key. On CUDA (forwards captured as graphs, where no
    value may be read back to the host) every block is in the range."""
    global _LAST_MASK
    last = _LAST_MASK  # one read: another thread may replace it
    if last is not None and last[0] is mask and last[1] == (groups, length, pad):
        return last[2]
    cut = mask[..., :length]
    if pad:
        cut = torch.nn.functional.pad(cut, (0, pad), value=False)
    width, blocks = cut.shape[-2], (length + pad) // KEY_BLOCK
    out = (~cut[:, :, None].expand(-1, -1, groups, -1, -1)  # [b, 1, g, w, keys]
           .reshape(cut.shape[0], 1, groups * width, blocks, KEY_BLOCK).transpose(2, 3)).contiguous()
    if out.device.type == "cpu":
        masked = out.flatten(3).any(dim=3).any(dim=0)[0].tolist()  # per block
        first = masked.index(True) if True in masked else blocks
        span = (first, blocks - masked[::-1].index(True)) if first < blocks else (0, 0)
    else:
        span = (0, blocks)
    _LAST_MASK = (mask, (groups, length, pad), (out, span))
    return out, span


compat.register_attention(ATTENTION, agentspec_sdpa)


@contextmanager
def verifying_attention(model: Any) -> Iterator[None]:
    """Run the forwards inside on ``agentspec_sdpa`` when the model is on ``sdpa``."""
    with compat.attention_switched(model, ATTENTION, when="sdpa"):
        yield
