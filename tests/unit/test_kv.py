"""The cache internals (agentspec/_kv.py): the fixed-capacity KV and GQA attention."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from agentspec.engine.kv import FixedKV, agentspec_sdpa, live_keys, verifying_attention


def _rows(n: int, start: int = 0) -> torch.Tensor:
    # [batch 1, kv_heads 2, n rows, head_dim 3]; row r holds the value r everywhere
    return torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 2, n, 3)


def test_fixed_kv_writes_rows_at_their_slots_and_returns_the_whole_buffer():
    kv = FixedKV(8)
    kv.slots = torch.tensor([2, 3, 4])
    keys, values = kv.update(_rows(3, 10), _rows(3, 20), 0)
    assert keys.shape == (1, 2, 8, 3) and kv.get_seq_length() == 8
    assert keys[0, 0, :, 0].tolist() == [0, 0, 10, 11, 12, 0, 0, 0]
    assert values[0, 1, 4, 2] == 22
    kv.slots = torch.tensor([0])
    kv.update(_rows(1, 5), _rows(1, 5), 0)  # in place: the same buffer, other rows kept
    assert keys[0, 0, :5, 0].tolist() == [5, 0, 10, 11, 12]
    kv.update(_rows(1, 7), _rows(1, 7), 1)  # a second layer gets buffers of its own
    assert len(kv.keys) == 2 and kv.keys[1][0, 0, 0, 0] == 7 and keys[0, 0, 0, 0] == 5


def test_fixed_kv_resized_keeps_the_committed_rows_only():
    kv = FixedKV(4)
    kv.slots = torch.arange(4)
    kv.update(_rows(4, 1), _rows(4, 1), 0)
    grown = kv.resized(8, 3)
    assert grown.capacity == 8 and grown.keys[0][0, 0, :, 0].tolist() == [1, 2, 3, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="cannot keep 5 rows"):
        kv.resized(8, 5)
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        FixedKV(0)


@pytest.mark.parametrize("q_len", [1, 5])
def test_gqa_attention_equals_transformers_sdpa(q_len):
    gen = torch.Generator().manual_seed(0)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    query = torch.randn(1, 6, q_len, 8, generator=gen)
    key = torch.randn(1, 2, 20, 8, generator=gen)
    value = torch.randn(1, 2, 20, 8, generator=gen)
    mask = torch.rand(1, 1, q_len, 20, generator=gen) > 0.3
    mask[..., 0] = True
    ours, _ = agentspec_sdpa(module, query, key, value, mask, scaling=0.3)
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


def _one_softmax_attention(query, key, value, mask, scale):
    """The deliberately wrong attention (the engine's before 2026-11-23): one softmax and one
    product over the whole KV, whose reduction is blocked by the KV's length. Whether a
    library's single product blocks by length depends on the CPU (it did on the machine the
    defect was found on; on an AMD EPYC with AVX-512 it did not), so the blocking is written
    out: the product over the keys is summed in two halves of the capacity."""
    batch, heads, width, dim = query.shape
    kv_heads, capacity = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * width, dim)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale
    allowed = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * width, capacity)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    half = capacity // 2
    out = (torch.matmul(probs[..., :half], value[:, :, :half])
           + torch.matmul(probs[..., half:], value[:, :, half:]))
    return out.reshape(batch, heads, width, dim).transpose(1, 2)


LIVE = 1120  # the keys a row attends: a BFCL prompt's length, where the wrong one differs


def _at_capacity(capacity: int):
    """The same 16 query rows (SmolLM2's 9 query and 3 key/value heads) over the same ``LIVE``
    keys in a KV of ``capacity`` slots; the other slots hold stale values, masked."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 9, 16, 64, generator=gen)
    key, value = torch.randn(1, 3, capacity, 64), torch.randn(1, 3, capacity, 64)
    key[:, :, :LIVE] = torch.randn(1, 3, LIVE, 64, generator=gen)
    value[:, :, :LIVE] = torch.randn(1, 3, LIVE, 64, generator=gen)
    mask = torch.zeros(1, 1, 16, capacity, dtype=torch.bool)
    mask[..., : LIVE - 16] = True
    mask[..., LIVE - 16 : LIVE] = torch.ones(16, 16, dtype=torch.bool).tril()
    return query, key, value, mask


def test_gqa_attention_rows_do_not_depend_on_the_kv_capacity_or_the_keys_read():
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    outs, wrong = [], []
    for capacity in (1280, 1536, 4096):
        query, key, value, mask = _at_capacity(capacity)
        outs.append(agentspec_sdpa(module, query, key, value, mask, scaling=0.125)[0])
        with live_keys(LIVE):  # only the blocks up to the last live key
            outs.append(agentspec_sdpa(module, query, key, value, mask, scaling=0.125)[0])
        wrong.append(_one_softmax_attention(query, key, value, mask, 0.125))
    assert all(torch.equal(o, outs[0]) for o in outs)
    torch.testing.assert_close(outs[0], wrong[0], atol=1e-5, rtol=1e-5)  # the same attention
    assert not all(torch.equal(w, wrong[0]) for w in wrong)  # the wrong one fails the check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_attention_head_by_head_gives_the_all_heads_bits(monkeypatch, dtype) -> None:
    """Long contexts multiply key/value head by head (``PER_HEAD_BLOCKS``): the same bits as
    one product over all heads, at every width, for every mask (a tree's, a causal chunk's)."""
    from agentspec.engine import kv as _kv

    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    gen = torch.Generator().manual_seed(0)
    for width, capacity, live in ((1, 2304, 2100), (2, 4096, 3000), (17, 2560, 2560), (64, 2048, 900)):
        query = torch.randn(1, 9, width, 64, generator=gen).to(dtype)
        key, value = (torch.randn(1, 3, capacity, 64, generator=gen).to(dtype) for _ in range(2))
        mask = torch.rand(1, 1, width, capacity, generator=gen) < 0.7
        mask[..., 0] = True
        outs = []
        for blocks in (1, 1 << 30):  # head by head everywhere; never
            monkeypatch.setattr(_kv, "PER_HEAD_BLOCKS", blocks)
            with live_keys(live):
                outs.append(agentspec_sdpa(module, query, key, value, mask, scaling=0.125)[0])
        assert torch.equal(outs[0], outs[1]), (width, capacity)


def _halves_fold(x: torch.Tensor) -> torch.Tensor:
    """The deliberately wrong fold: a balanced tree split at the middle of the blocks there
    are, whose shape (hence its rounding) changes with their number."""
    n = x.shape[2]
    if n == 1:
        return x[:, :, 0]
    return _halves_fold(x[:, :, : n // 2]) + _halves_fold(x[:, :, n // 2 :])


def test_block_fold_gives_the_same_bits_whatever_zero_blocks_follow():
    from agentspec.engine.kv import _fold_blocks

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 9, 5, 4, generator=gen) * 100
    broken = 0
    for n in range(1, 10):
        for fold in (_fold_blocks, _halves_fold):
            want = fold(x[:, :, :n])
            for extra in (1, 2, 3, 7, 12):
                padded = torch.cat([x[:, :, :n], torch.zeros(1, 3, extra, 5, 4)], dim=2)
                same = torch.equal(fold(padded), want)
                if fold is _fold_blocks:
                    assert same, (n, extra)
                else:
                    broken += not same
        torch.testing.assert_close(_fold_blocks(x[:, :, :n]), x[:, :, :n].sum(2), atol=1e-3, rtol=1e-5)
    assert broken  # the wrong fold fails the same check


def test_only_the_cpu_multiplies_head_by_head(monkeypatch):
    """Off the CPU (here the meta device, shapes only) a long context still takes one product
    over all heads: no per-head products stacked."""
    from agentspec.engine import kv as _kv

    stacks = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacks.append(1) or real_stack(*a, **k))
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    for device, expected in (("cpu", 2), ("meta", 0)):
        stacks.clear()
        query = torch.zeros(1, 9, 4, 64, device=device)
        key, value = (torch.zeros(1, 3, 256 * _kv.PER_HEAD_BLOCKS, 64, device=device) for _ in range(2))
        mask = torch.ones(1, 1, 4, key.shape[2], dtype=torch.bool, device=device)
        out = agentspec_sdpa(module, query, key, value, mask, scaling=0.125)[0]
        assert out.shape == (1, 4, 9, 64) and len(stacks) == expected, device
