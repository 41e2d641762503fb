"""The cache internals (agentspec/_kv.py): buffered layers, row keeping, GQA attention."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from agentspec._kv import (
    BufferedLayer,
    _gqa_sdpa,
    keep_kv_rows,
    new_cache,
    verifying_attention,
)
from agentspec.errors import UnsupportedModelError


def _rows(n: int, start: int = 0) -> torch.Tensor:
    # [batch 1, kv_heads 2, n rows, head_dim 3]; row r holds the value r everywhere
    return torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 2, n, 3)


def _both() -> tuple[BufferedLayer, DynamicLayer]:
    return BufferedLayer(), DynamicLayer()


def test_buffered_layer_appends_like_dynamic_layer_and_grows():
    buffered, dynamic = _both()
    start = 0
    for n in (5, 1, 300, 2, 700):  # crosses the initial capacity and one growth
        kb, vb = buffered.update(_rows(n, start), _rows(n, start) + 0.5)
        kd, vd = dynamic.update(_rows(n, start), _rows(n, start) + 0.5)
        start += n
        assert torch.equal(kb, kd) and torch.equal(vb, vd)
        assert buffered.get_seq_length() == dynamic.get_seq_length() == start


def test_keep_kv_rows_gathers_a_path_then_crops_on_both_layer_kinds():
    for layer in _both():
        cache = types.SimpleNamespace(layers=[layer])
        layer.update(_rows(10), _rows(10))
        keep_kv_rows(cache, 4, [6, 8], 6)  # rows 6 and 8 move to 4 and 5
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 6, 8]
        assert layer.values[0, 1, :, 2].tolist() == [0, 1, 2, 3, 6, 8]
        layer.update(_rows(1, 42), _rows(1, 42))  # appends after the kept rows
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 6, 8, 42]
        keep_kv_rows(cache, 3, None, 3)
        assert layer.keys.shape[2] == 3


def test_buffered_crop_and_reset():
    layer = BufferedLayer()
    layer.update(_rows(8), _rows(8))
    layer.crop(-3)
    assert layer.get_seq_length() == 5
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)
    layer.reset()
    assert layer.get_seq_length() == 0
    layer.update(_rows(2, 7), _rows(2, 7))
    assert layer.keys[0, 0, :, 0].tolist() == [7, 8]


def test_keep_kv_rows_refuses_other_layer_kinds():
    class Other(DynamicLayer):
        pass

    layer = Other()
    layer.update(_rows(4), _rows(4))
    with pytest.raises(UnsupportedModelError, match="Other"):
        keep_kv_rows(types.SimpleNamespace(layers=[layer]), 2, None, 2)


def test_new_cache_builds_buffered_layers():
    cache = new_cache()
    cache.update(_rows(3), _rows(3), layer_idx=0)
    assert isinstance(cache.layers[0], BufferedLayer) and cache.get_seq_length() == 3


@pytest.mark.parametrize("q_len", [1, 5])
def test_gqa_attention_equals_transformers_sdpa(q_len):
    gen = torch.Generator().manual_seed(0)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    query = torch.randn(1, 6, q_len, 8, generator=gen)
    key = torch.randn(1, 2, 20, 8, generator=gen)
    value = torch.randn(1, 2, 20, 8, generator=gen)
    mask = torch.rand(1, 1, q_len, 20, generator=gen) > 0.3
    mask[..., 0] = True
    ours, _ = _gqa_sdpa(module, query, key, value, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == ref.shape == (1, q_len, 6, 8)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # A deliberately wrong grouping (heads paired with the wrong kv head) is caught.
    wrong, _ = sdpa_attention_forward(module, query, key.flip(1), value.flip(1), mask, scaling=0.3)
    assert not torch.allclose(ours, wrong, atol=1e-3)


def test_verifying_attention_switches_sdpa_models_only_and_restores():
    sdpa = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="sdpa"))
    with verifying_attention(sdpa):
        assert sdpa.config._attn_implementation == "agentspec_sdpa"
    assert sdpa.config._attn_implementation == "sdpa"
    eager = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="eager"))
    with verifying_attention(eager):
        assert eager.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError), verifying_attention(sdpa):
        raise RuntimeError("a failing forward")
    assert sdpa.config._attn_implementation == "sdpa"
