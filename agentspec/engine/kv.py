"""The engine's attention over the KV pool (transformers' side of it: :mod:`agentspec.engine.compat`).

Two pieces:

- :class:`PoolCache`: what a decoder layer is handed as its cache. Its ``update`` writes the
  forward's real rows into the pool at their sequences' slots (:mod:`agentspec.engine.pool`)
  and hands back the layer's whole pool buffers, which only the engine's attention reads.
- ``agentspec_sdpa`` attention (registered under :data:`ATTENTION`): for the engine's
  forwards, attention as products in float32 reduced in fixed blocks of keys, each sequence's
  rows over that sequence's own blocks, read in place (:mod:`agentspec.engine.plan` lays out
  who sees what). :func:`verifying_attention` switches a model to it for one forward and back,
  so a model shared with other code (the bench's ``hf-*`` baselines) stays unchanged.

Why fixed shapes: a row's logits must not depend on how many other rows its forward had, whose
they were, or how long any KV was, or drafts and neighbours would change outputs (see
``docs/architecture.md``). Each row's scores are maxed over all its keys (a max is exact in any
order), exponentiated, and summed and multiplied with the values within blocks of
:data:`KEY_BLOCK` keys fixed by their position; the blocks' sums are added in a fixed tree
(:func:`fold_blocks`), and the output divided by the sum at the end. A block past a row's keys
holds only masked scores and adds exact zeros, so neither the pool's size, nor how many blocks
a group reads, nor the group's other members change a row's bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch

from agentspec.engine import compat
from agentspec.engine.pool import BLOCK, KVPool

if TYPE_CHECKING:
    from agentspec.engine.plan import Group, Layout

KEY_BLOCK = BLOCK
"""Keys per attention block: every row's attention is reduced block by block in this fixed
size (the pool's block), so neither the pool nor how much of it a forward reads changes it."""

ATTENTION = "agentspec_sdpa"
"""The name the engine's attention (:func:`agentspec_sdpa`) is registered under with
transformers: what :func:`verifying_attention` switches a model to (and where the bench hangs
a counting wrapper)."""

REPLACED = ("sdpa", "eager")
"""The model attention implementations the engine's attention stands in for during its
forwards: their arithmetic is its arithmetic (eager's logit cap, Gemma 2's, included)."""

# The forward in progress on this thread: its layout, the pool, and the two masks' sentinels.
_FORWARD: ContextVar[tuple[Layout, KVPool] | None] = ContextVar("agentspec_forward", default=None)

FULL = torch.ones(1, 1, 1, 1, dtype=torch.bool)
"""The attention mask handed to full-attention layers: a sentinel (the layout holds the masks)."""
SLIDING = torch.ones(1, 1, 1, 1, dtype=torch.bool)
"""The attention mask handed to sliding-window layers."""


@contextmanager
def laid_out(layout: Layout, pool: KVPool) -> Iterator[None]:
    """Run the forward inside with ``layout`` (its rows, slots and attention groups)."""
    token = _FORWARD.set((layout, pool))
    try:
        yield
    finally:
        _FORWARD.reset(token)


class PoolCache:
    """The cache a decoder layer is handed: ``update`` writes the forward's real rows into the
    pool and returns the layer's pool buffers ``[blocks, kv_heads, KEY_BLOCK, head_dim]``.
    Duck-types the part of transformers' ``Cache`` that the layers call; the model always gets
    explicit position ids and the engine's masks, so nothing else is asked."""

    is_compileable = True

    def __init__(self, pool: KVPool, layout: Layout) -> None:
        self.pool, self.layout = pool, layout

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        lay = self.layout
        if lay.write_rows.numel():
            # [1, kv_heads, width, dim] -> the real rows [rows, kv_heads, dim] at their slots
            rows = lay.write_rows
            keys[lay.write_blocks, :, lay.write_offsets] = key_states[0, :, rows].transpose(0, 1)
            values[lay.write_blocks, :, lay.write_offsets] = value_states[0, :, rows].transpose(0, 1)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def agentspec_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                   scaling: float | None = None, is_causal: bool | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention in float32, each sequence's rows over its own blocks of the pool, reduced in
    blocks of :data:`KEY_BLOCK` keys in a fixed order (registered as :data:`ATTENTION`).

    Not SDPA: the CPU flash kernel splits a forward's queries into blocks, and the same query
    row gave other bits at row 27 than at row 47 of a forward. And not one softmax and one
    product over the whole KV either: their reductions over the keys are blocked by the
    kernels according to the KV's length. Any call outside an engine forward (no layout, or a
    mask that is not one of the engine's) takes transformers' own sdpa path.

    ``softcap`` (Gemma 2's ``attn_logit_softcapping``) caps the scaled scores as transformers'
    eager attention does: ``softcap * tanh(scores / softcap)``.
    """
    current = _FORWARD.get()
    plain = (dropout == 0.0 and kwargs.get("position_bias") is None and kwargs.get("cache") is None
             and not kwargs.get("output_attentions", False))
    if current is None or not plain or (attention_mask is not FULL and attention_mask is not SLIDING):
        return compat.sdpa_attention(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, is_causal=is_causal, **kwargs)
    layout, _ = current
    _, heads, width, dim = query.shape
    scale = scaling if scaling is not None else dim ** -0.5
    out = query.new_zeros((width, heads, dim))  # junk rows keep zeros
    q = query[0].transpose(0, 1)  # [width, heads, dim]
    for group in layout.groups:
        rows = group_attention(q, key, value, group, scale, attention_mask is SLIDING,
                               softcap=kwargs.get("softcap"))
        out.index_copy_(0, group.out_rows, rows.to(out.dtype))  # type: ignore[arg-type]
    return out[None], None


def group_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: Group,
                    scale: float, window: bool = False, *,
                    softcap: float | None = None) -> torch.Tensor:
    """One group's attention: ``q`` ``[width, heads, dim]`` (the forward's rows), the pool's
    ``keys``/``values`` ``[blocks, kv_heads, KEY_BLOCK, dim]``. Returns the members' real rows
    ``[rows, heads, dim]`` in the order of ``group.out_rows``. ``softcap``: scores capped to
    ``softcap * tanh(scores / softcap)`` after scaling (elementwise: no order to fix)."""
    n, wq, blocks = len(group.members), group.wq, group.blocks
    kv_heads, dim = keys.shape[1], keys.shape[3]
    heads = q.shape[1]
    g = heads // kv_heads
    assert group.q_index is not None and group.out_index is not None
    # Query heads j * g .. j * g + g - 1 share key/value head j (repeat_kv's order).
    qg = (q.index_select(0, group.q_index).float()  # [n * wq, heads, dim]
          .view(n, wq, kv_heads, g, dim).permute(0, 2, 3, 1, 4)
          .reshape(n, 1, kv_heads, g * wq, dim))
    scores = qg.new_empty((n, blocks, kv_heads, g * wq, KEY_BLOCK))
    for i, runs in enumerate(group.runs):
        for start, count, at in runs:  # a run of consecutive blocks: one strided batch, no copy
            k = keys[start : start + count].float()  # [count, kv_heads, KEY_BLOCK, dim]
            torch.matmul(qg[i], k.transpose(-1, -2), out=scores[i, at : at + count])
    # In place from here on: the same elementwise kernels, the same bits, no temporaries.
    scores.mul_(scale)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    forbidden, lo = ((group.forbidden_window, group.lo_window) if window
                     else (group.forbidden, group.lo))
    assert forbidden is not None
    view = scores.view(n, blocks, kv_heads, g, wq, KEY_BLOCK)
    view[:, lo:].masked_fill_(forbidden[:, lo:], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).amax(dim=1, keepdim=True)  # [n, 1, kvh, g*wq, 1]
    weights = scores.sub_(top).exp_()  # every row sees a key: ``top`` is finite
    sums = weights.sum(dim=-1)  # [n, blocks, kv_heads, g * wq]
    parts = qg.new_empty((n, blocks, kv_heads, g * wq, dim))
    for i, runs in enumerate(group.runs):
        for start, count, at in runs:
            v = values[start : start + count].float()
            torch.matmul(weights[i, at : at + count], v, out=parts[i, at : at + count])
    if group.short is not None:  # blocks past a member's keys: no product wrote them
        parts.masked_fill_(group.short, 0.0)
    total, acc = fold_blocks(sums), fold_blocks(parts)  # [n, kvh, g*wq], [n, kvh, g*wq, dim]
    out = (acc / total[..., None]).view(n, kv_heads, g, wq, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(n * wq, heads, dim).index_select(0, group.out_index)


def fold_blocks(x: torch.Tensor) -> torch.Tensor:
    """The sum over dim 1 (the key blocks) in one fixed order: a complete binary tree over the
    blocks padded with zeros to a power of two, neighbours first (``(x0 + x1) + (x2 + x3)``).
    Appending blocks of zeros (a group that reads more blocks) leaves every partial sum's bits
    as they were, so the result does not depend on the number of blocks; and
    ``log2(blocks)`` additions where adding the blocks one after the other takes
    ``blocks - 1`` (on CUDA each addition is a kernel of the step's graph)."""
    n = x.shape[1]
    if n & (n - 1):  # not a power of two
        pad = [0, 0] * (x.dim() - 2) + [0, (1 << n.bit_length()) - n]
        x = torch.nn.functional.pad(x, pad)
    while x.shape[1] > 1:
        x = x[:, 0::2] + x[:, 1::2]
    return x[:, 0]


compat.register_attention(ATTENTION, agentspec_sdpa)


@contextmanager
def verifying_attention(model: Any) -> Iterator[None]:
    """Run the forwards inside on ``agentspec_sdpa`` when the model is on one of
    :data:`REPLACED` (Gemma 2 loads on eager: sdpa has no logit cap)."""
    with compat.attention_switched(model, ATTENTION, when=REPLACED):
        yield
