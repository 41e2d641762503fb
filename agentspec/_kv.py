"""Everything that touches transformers' KV-cache and attention internals (pinned: transformers 5.23).

Three pieces, each exact (same keys, values and attention arithmetic as transformers' own):

- :class:`BufferedLayer`: a ``DynamicLayer`` whose rows live in a buffer with spare capacity.
  ``DynamicLayer.update`` concatenates, copying the whole KV of every layer on every step
  (64 MiB per step at 1,400 tokens of SmolLM2-135M, a quarter of a CPU decode step); here a
  step writes only its new rows.
- :func:`keep_kv_rows`: gather the accepted path's rows into place and crop the rest.
- ``agentspec_sdpa`` attention: transformers' sdpa path, except that a masked multi-token
  forward on a grouped-query model lets SDPA broadcast the key/value heads
  (``enable_gqa=True``) instead of copying them with ``repeat_kv``: verifying a draft then
  reads the KV once, as single-token decoding does. :func:`verifying_attention` switches a
  model to it for one forward and back, so a model shared with other code stays unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from agentspec.errors import UnsupportedModelError

_MIN_CAPACITY = 256


class BufferedLayer(DynamicLayer):
    """A full (non-sliding) KV layer appending in place; ``keys``/``values`` are views of the
    first ``length`` rows of buffers that grow by half again when full."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if self._kbuf is None or end > self._kbuf.shape[-2]:
            self._grow(key_states, value_states, end)
        assert self._kbuf is not None and self._vbuf is not None
        self._kbuf[:, :, self._length : end] = key_states
        self._vbuf[:, :, self._length : end] = value_states
        self.truncate(end)
        return self._kbuf[:, :, :end], self._vbuf[:, :, :end]

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, need: int) -> None:
        capacity = max(_MIN_CAPACITY, need + need // 2)
        kbuf = key_states.new_empty((*key_states.shape[:2], capacity, key_states.shape[-1]))
        vbuf = value_states.new_empty((*value_states.shape[:2], capacity, value_states.shape[-1]))
        if self._kbuf is not None and self._vbuf is not None and self._length:
            kbuf[:, :, : self._length] = self._kbuf[:, :, : self._length]
            vbuf[:, :, : self._length] = self._vbuf[:, :, : self._length]
        self._kbuf, self._vbuf = kbuf, vbuf

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` rows (the buffers keep their capacity)."""
        assert self._kbuf is not None and self._vbuf is not None
        self._length = length
        self.keys = self._kbuf[:, :, :length]
        self.values = self._vbuf[:, :, :length]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of rows to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self.truncate(max(0, self._length + tokens_to_remove))

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self._length = 0
        super().reset()


def new_cache() -> DynamicCache:
    """An empty cache whose layers are :class:`BufferedLayer` (full layers for every model:
    rows can always be rolled back; sliding windows are applied by the masks)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = BufferedLayer
    return cache


def keep_kv_rows(kv: Any, dst: int, src_rows: list[int] | None, new_len: int) -> None:
    """Copy the KV rows ``src_rows`` to rows ``dst, dst + 1, ...`` (when given), then crop every
    layer to ``new_len`` rows. Layer tensors are ``[batch, kv_heads, seq, head_dim]``."""
    for layer in kv.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        if type(layer) not in (BufferedLayer, DynamicLayer):
            raise UnsupportedModelError(f"cannot roll back a {type(layer).__name__} KV layer")
        if src_rows:
            index = torch.tensor(src_rows, device=layer.keys.device)
            layer.keys[:, :, dst : dst + len(src_rows)] = layer.keys.index_select(2, index)
            layer.values[:, :, dst : dst + len(src_rows)] = layer.values.index_select(2, index)
        if isinstance(layer, BufferedLayer):
            layer.truncate(new_len)
        else:
            layer.keys = layer.keys[:, :, :new_len]
            layer.values = layer.values[:, :, :new_len]


_ATTENTION = "agentspec_sdpa"


def _gqa_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
              scaling: float | None = None, is_causal: bool | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = (dropout == 0.0 and kwargs.get("softcap") is None
             and kwargs.get("position_bias") is None and kwargs.get("cache") is None
             and not kwargs.get("output_attentions", False))
    if (groups > 1 and plain and isinstance(attention_mask, torch.Tensor) and query.shape[2] > 1
            and key.shape[-1] == value.shape[-1]):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(_ATTENTION, _gqa_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_ATTENTION, sdpa_mask)


_register()


@contextmanager
def verifying_attention(model: Any) -> Iterator[None]:
    """Run the forwards inside on ``agentspec_sdpa`` when the model is on ``sdpa``."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    config._attn_implementation = _ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
