"""The engine's attention over the KV pool (agentspec/engine/kv.py) on small hand-built pools.

What is checked: a group's attention is transformers' sdpa attention (chains, trees, GQA,
sliding windows); a row's output is the same bits whatever group, pool place, padding or query
width it is computed in (and two deliberately batch-dependent attentions fail that check);
``PoolCache.update`` writes the forward's real rows at their slots; ``agentspec_sdpa`` takes
the engine's path only inside a laid-out forward with one of the engine's masks; the block
fold does not depend on how many zero blocks follow. The real model's bits are checked in
tests/integration (test_invariance.py, test_batching.py).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from agentspec.engine import kv
from agentspec.engine.kv import (
    FULL,
    SLIDING,
    PoolCache,
    agentspec_sdpa,
    fold_blocks,
    group_attention,
    laid_out,
    verifying_attention,
)
from agentspec.engine.plan import Group, Layout, Member, lay_out
from agentspec.engine.pool import BLOCK, KVPool
from agentspec.engine.sequence import Sequence
from tests.solo import commit_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

HEADS, KV_HEADS, DIM = 6, 2, 8  # GQA: query heads 0-2 read kv head 0, heads 3-5 kv head 1
SCALE = DIM ** -0.5
WIDTHS = (4, 8, 16, 32, 64)
CPU = torch.device("cpu")
MODULE: Any = types.SimpleNamespace(  # what the attention reads of a layer
    num_key_value_groups=HEADS // KV_HEADS, is_causal=True)

CHAIN5 = [-1, 0, 1, 2, 3]
TREE6 = [-1, 0, 0, 1, 1, 2]  # a root, two children, three grandchildren


def _pool(layers: int = 1) -> KVPool:
    pool = KVPool("cpu")
    pool.define_layers([(KV_HEADS, DIM, torch.float32)] * layers)
    return pool


@dataclass
class _Rows:
    """One sequence's part of a forward: the keys and values of its ``kv_len`` committed
    positions followed by its forward rows', and the forward rows' queries and tree."""

    ids: list[int]  # the committed tokens (only the pool's trie reads them)
    keys: torch.Tensor  # [kv_len + n, kv_heads, dim]
    values: torch.Tensor
    queries: torch.Tensor  # [n, heads, dim]
    depth: list[int]
    anc: np.ndarray  # [n, n]: anc[r, c] = row r sees row c

    @property
    def kv_len(self) -> int:
        return len(self.ids)

    @property
    def n(self) -> int:
        return len(self.depth)


def _rows(seed: int, kv_len: int, parents: list[int]) -> _Rows:
    """Random rows (``parents``: each forward row's parent row, -1 for a root)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(parents)
    depth: list[int] = []
    anc = np.eye(n, dtype=bool)
    for r, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        if p >= 0:
            anc[r] |= anc[p]
    return _Rows([seed * 100_000 + i for i in range(kv_len)],
                 torch.randn(kv_len + n, KV_HEADS, DIM, generator=gen),
                 torch.randn(kv_len + n, KV_HEADS, DIM, generator=gen),
                 torch.randn(n, HEADS, DIM, generator=gen), depth, anc)


def _write(seq: Sequence, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """Rows ``[rows, kv_heads, dim]`` at the sequence's positions from ``start``, in layer 0."""
    at = seq.slots(torch.arange(start, start + len(keys)))
    seq.pool.keys[0][at // BLOCK, :, at % BLOCK] = keys
    seq.pool.values[0][at // BLOCK, :, at % BLOCK] = values


def _place(pool: KVPool, rows: _Rows, seq: Sequence | None = None) -> Member:
    """The sequence's committed rows and its forward rows in the pool, at positions
    ``kv_len + row`` (where the forward's ``PoolCache.update`` puts them); its member."""
    seq = seq or Sequence(pool, cached=False)
    seq.reserve(rows.kv_len + rows.n)
    held = seq.kv_len  # rows it already holds (shared blocks) are not written again
    _write(seq, rows.keys[held:], rows.values[held:], held)
    commit_tokens(seq, rows.ids[held:])
    return Member(seq, [7] * rows.n, rows.depth, rows.anc)


AttentionFn = Callable[..., torch.Tensor]


def _attend(pool: KVPool, layout: Layout, queries: list[torch.Tensor], *,
            attention: AttentionFn = group_attention, window: bool = False) -> torch.Tensor:
    """The forward's attention ``[width, heads, dim]``, group by group as ``agentspec_sdpa``
    runs it; the junk rows' queries are random and their outputs zero."""
    gen = torch.Generator().manual_seed(99)
    q = torch.randn(layout.width, HEADS, DIM, generator=gen) * 10
    for m, rows in zip(layout.members, queries, strict=True):
        q[m.row0 : m.row0 + len(m.ids)] = rows
    out = torch.zeros(layout.width, HEADS, DIM)
    for group in layout.groups:
        got = attention(q, pool.keys[0], pool.values[0], group, SCALE, window)
        assert group.out_rows is not None
        out.index_copy_(0, group.out_rows, got)
    return out


def _of(out: torch.Tensor, member: Member) -> torch.Tensor:
    return out[member.row0 : member.row0 + len(member.ids)]


def _reference(rows: _Rows, window: int | None = None, *, flip: bool = False) -> torch.Tensor:
    """transformers' sdpa attention of the rows ``[n, heads, dim]``, with the boolean mask the
    layout stands for: every committed key, the forward rows' ancestors, and under a window
    only keys less than ``window`` positions behind the row (a row's key sits at its depth's
    position). ``flip``: kv heads swapped (a wrong grouping)."""
    kv, n = rows.kv_len, rows.n
    allowed = torch.ones(n, kv + n, dtype=torch.bool)
    allowed[:, kv:] = torch.from_numpy(rows.anc)
    if window is not None:
        key_pos = torch.arange(kv + n)
        key_pos[kv:] = kv + torch.tensor(rows.depth)
        row_pos = kv + torch.tensor(rows.depth)
        allowed &= key_pos[None, :] > row_pos[:, None] - window
    keys, values = rows.keys.transpose(0, 1)[None], rows.values.transpose(0, 1)[None]
    if flip:
        keys, values = keys.flip(1), values.flip(1)
    out, _ = sdpa_attention_forward(MODULE, rows.queries.transpose(0, 1)[None], keys, values,
                                    allowed[None, None], scaling=SCALE)
    return out[0]  # [n, heads, dim]


# -- group attention is attention ---------------------------------------------------------------

@pytest.mark.parametrize(("kv_len", "parents", "window"), [
    (300, CHAIN5, None),  # a chain whose rows cross into a second block
    (40, TREE6, None),  # a tree: each row sees its ancestors only
    (0, [-1, 0, 1, 2, 3, 4, 5], None),  # a prompt's first chunk: no committed rows
    (600, [-1], None),  # one row over three blocks
    (300, CHAIN5, 64),  # sliding-window layers
    (270, TREE6, 16),
])
def test_group_attention_of_one_sequence_is_sdpa_attention(kv_len, parents, window) -> None:
    rows = _rows(1, kv_len, parents)
    pool = _pool()
    member = _place(pool, rows)
    layout = lay_out([member], WIDTHS, window=window, device=CPU)
    ours = _of(_attend(pool, layout, [rows.queries], window=window is not None), member)
    torch.testing.assert_close(ours, _reference(rows, window), atol=1e-5, rtol=1e-5)
    # A wrong grouping (query heads read the other kv head) is caught.
    assert not torch.allclose(ours, _reference(rows, window, flip=True), atol=1e-3)
    # So is a wrong mask (the tree's rows seeing every forward row).
    if rows.n > 1 and not rows.anc.all():
        wrong = _rows(1, kv_len, parents)
        wrong.anc = np.ones_like(rows.anc)
        assert not torch.allclose(ours, _reference(wrong, window), atol=1e-3)


@pytest.mark.parametrize("window", [None, 16])
def test_group_attention_caps_the_scores_as_eager_attention_does(window) -> None:
    """``softcap`` (Gemma 2's): the scaled scores become ``cap * tanh(scores / cap)`` before
    the mask and the softmax, as in transformers' eager attention; without the cap the rows
    are other rows (the queries are drawn large enough that the cap bites)."""
    cap = 2.0
    rows = _rows(1, 270, TREE6)
    rows.queries = rows.queries * 8
    pool = _pool()
    member = _place(pool, rows)
    layout = lay_out([member], WIDTHS, window=window, device=CPU)
    capped = functools.partial(group_attention, softcap=cap)
    ours = _of(_attend(pool, layout, [rows.queries], attention=capped, window=window is not None),
               member)
    n, heads, g = rows.n, HEADS, HEADS // KV_HEADS
    keys = rows.keys.repeat_interleave(g, dim=1)  # [kv_len + n, heads, dim]
    values = rows.values.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", rows.queries, keys) * SCALE  # [heads, n, kv_len + n]
    scores = torch.tanh(scores / cap) * cap
    allowed = torch.ones(n, rows.kv_len + n, dtype=torch.bool)
    allowed[:, rows.kv_len :] = torch.from_numpy(rows.anc)
    if window is not None:
        key_pos = torch.arange(rows.kv_len + n)
        key_pos[rows.kv_len :] = rows.kv_len + torch.tensor(rows.depth)
        allowed &= key_pos[None, :] > (rows.kv_len + torch.tensor(rows.depth))[:, None] - window
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", weights, values)
    assert heads == weights.shape[0]
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    uncapped = _of(_attend(pool, layout, [rows.queries], window=window is not None), member)
    assert not torch.allclose(uncapped, want, atol=1e-3)


def test_group_attention_of_several_sequences_is_each_ones_sdpa_attention() -> None:
    """Members of one group and of two (a 2-row step beside a 20-row draft) each get their own
    attention over their own blocks."""
    pool = _pool()
    cases = [_rows(2, 30, [-1, 0]), _rows(3, 520, TREE6), _rows(4, 5, list(range(-1, 19)))]
    members = [_place(pool, rows) for rows in cases]
    layout = lay_out(members, WIDTHS, window=None, device=CPU)
    assert [len(g.members) for g in layout.groups] == [2, 1]
    out = _attend(pool, layout, [rows.queries for rows in cases])
    for member, rows in zip(members, cases, strict=True):
        torch.testing.assert_close(_of(out, member), _reference(rows), atol=1e-5, rtol=1e-5)
    assert not out[sum(rows.n for rows in cases) :].any()  # junk rows: zeros


# -- a row's bits do not depend on its forward -----------------------------------------------

SUBJECT = _rows(1, 700, [-1, 0, 0])  # three rows over three blocks of keys


def _subject_alone(attention: AttentionFn) -> torch.Tensor:
    pool = _pool()
    member = _place(pool, SUBJECT)
    layout = lay_out([member], WIDTHS, window=None, device=CPU)
    return _of(_attend(pool, layout, [SUBJECT.queries], attention=attention), member)


def _subject_beside_others(attention: AttentionFn) -> torch.Tensor:
    """Between a shorter sequence with fewer rows and one with more rows: one group, of the
    subject's blocks and query width."""
    pool = _pool()
    before, after = _rows(2, 90, [-1, 0]), _rows(3, 400, [-1, 0, 1, 2])
    members = [_place(pool, rows) for rows in (before, SUBJECT, after)]
    layout = lay_out(members, WIDTHS, window=None, device=CPU)
    assert [(g.wq, g.blocks, len(g.members)) for g in layout.groups] == [(4, 3, 3)]
    out = _attend(pool, layout, [before.queries, SUBJECT.queries, after.queries],
                  attention=attention)
    return _of(out, members[1])


def _subject_elsewhere(attention: AttentionFn) -> torch.Tensor:
    """In a grown pool of stale rows, its blocks scattered between another sequence's."""
    pool = _pool()
    Sequence(pool).reserve(20 * BLOCK)  # grows the pool; never released, never written
    seq, other = Sequence(pool, cached=False), Sequence(pool, cached=False)
    for blocks in range(1, 4):
        seq.reserve(blocks * BLOCK)
        other.reserve(blocks * BLOCK)
    assert len(seq.runs(3)) == 3 and seq.table[0] >= 20
    gen = torch.Generator().manual_seed(5)
    for buf in (*pool.keys, *pool.values):  # stale rows everywhere: finite, but not zero
        buf.copy_(torch.randn(buf.shape, generator=gen) * 50)
    member = _place(pool, SUBJECT, seq)
    layout = lay_out([member], WIDTHS, window=None, device=CPU)
    return _of(_attend(pool, layout, [SUBJECT.queries], attention=attention), member)


def _subject_padded(attention: AttentionFn) -> torch.Tensor:
    """Beside a longer sequence with more rows: its blocks padded to five, its queries to 8."""
    pool = _pool()
    longer = _rows(6, 1100, list(range(-1, 6)))
    members = [_place(pool, rows) for rows in (SUBJECT, longer)]
    layout = lay_out(members, WIDTHS, window=None, device=CPU)
    assert [(g.wq, g.blocks) for g in layout.groups] == [(8, 5)]
    out = _attend(pool, layout, [SUBJECT.queries, longer.queries], attention=attention)
    return _of(out, members[0])


def _subject_wide(attention: AttentionFn) -> torch.Tensor:
    """At a forced query width of 16 in a forward of 32 rows (the width probe's)."""
    pool = _pool()
    member = _place(pool, SUBJECT)
    layout = lay_out([member], WIDTHS, window=None, device=CPU, width=32, wq=16)
    return _of(_attend(pool, layout, [SUBJECT.queries], attention=attention), member)


SETTINGS = {"alone": _subject_alone, "beside others": _subject_beside_others,
            "elsewhere in the pool": _subject_elsewhere, "padded": _subject_padded,
            "wide": _subject_wide}


def _subject_everywhere(attention: AttentionFn) -> dict[str, torch.Tensor]:
    return {name: make(attention) for name, make in SETTINGS.items()}


def test_a_rows_attention_has_the_same_bits_in_any_group_at_any_place() -> None:
    outs = _subject_everywhere(group_attention)
    torch.testing.assert_close(outs["alone"], _reference(SUBJECT), atol=1e-5, rtol=1e-5)
    for name, out in outs.items():
        assert torch.equal(out, outs["alone"]), name


def _halves_fold(x: torch.Tensor) -> torch.Tensor:
    """The deliberately wrong fold: a balanced tree split at the middle of the blocks there
    are, whose shape (hence its rounding) changes with their number."""
    n = x.shape[1]
    if n == 1:
        return x[:, 0]
    return _halves_fold(x[:, : n // 2]) + _halves_fold(x[:, n // 2 :])


def _one_softmax_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           group: Group, scale: float, window: bool = False) -> torch.Tensor:
    """The deliberately wrong attention: each member's keys gathered over the group's padded
    block range, one softmax over all of them, and one product with the values whose
    reduction is blocked by that range's length. Whether a library's single product blocks by
    length depends on the CPU, so the blocking is written out: two halves of the range."""
    kv_heads, dim, heads = keys.shape[1], keys.shape[3], q.shape[1]
    g, wq, blocks = heads // kv_heads, group.wq, group.blocks
    forbidden = group.forbidden_window if window else group.forbidden
    assert forbidden is not None and group.q_index is not None
    outs = []
    for i, runs in enumerate(group.runs):
        k = keys.new_zeros((blocks, kv_heads, BLOCK, dim))
        v = values.new_zeros((blocks, kv_heads, BLOCK, dim))
        for start, count, at in runs:
            k[at : at + count], v[at : at + count] = keys[start : start + count], values[start : start + count]
        k = k.permute(1, 0, 2, 3).reshape(kv_heads, blocks * BLOCK, dim)
        v = v.permute(1, 0, 2, 3).reshape(kv_heads, blocks * BLOCK, dim)
        rows = q[group.q_index[i * wq : (i + 1) * wq]]  # [wq, heads, dim]
        qg = rows.view(wq, kv_heads, g, dim).permute(1, 2, 0, 3)  # [kv_heads, g, wq, dim]
        scores = torch.matmul(qg, k[:, None].transpose(-1, -2)) * scale  # [kvh, g, wq, keys]
        hidden = forbidden[i, :, 0, 0].permute(1, 0, 2).reshape(wq, blocks * BLOCK)
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        half = blocks // 2 * BLOCK
        out = (torch.matmul(probs[..., :half], v[:, None, :half])
               + torch.matmul(probs[..., half:], v[:, None, half:]))  # [kvh, g, wq, dim]
        outs.append(out.permute(2, 0, 1, 3).reshape(wq, heads, dim)[: len(group.members[i].ids)])
    return torch.cat(outs)


@pytest.mark.parametrize("wrong", ["one softmax", "blocks folded by halves"])
def test_a_batch_dependent_attention_fails_the_same_check(monkeypatch, wrong) -> None:
    attention: AttentionFn = _one_softmax_attention
    if wrong == "blocks folded by halves":
        monkeypatch.setattr(kv, "fold_blocks", _halves_fold)
        attention = group_attention
    outs = _subject_everywhere(attention)
    for out in outs.values():  # the same attention, up to rounding...
        torch.testing.assert_close(out, outs["alone"], atol=1e-5, rtol=1e-5)
    # ...whose bits depend on the forward: the check above catches it.
    assert not all(torch.equal(out, outs["alone"]) for out in outs.values())


def test_a_long_context_over_two_runs_of_blocks_gives_the_one_run_bits() -> None:
    """3000 keys in one run of pool blocks, and the same keys as four blocks shared with
    another sequence (found in the pool's trie) followed by the sequence's own blocks."""
    rows = _rows(8, 3000, [-1, 0, 1, 2])
    pool = _pool()
    member = _place(pool, rows)
    assert member.seq.runs(12) == [(member.seq.table[0], 12, 0)]
    one = _of(_attend(pool, lay_out([member], WIDTHS, window=None, device=CPU),
                      [rows.queries]), member)

    pool = _pool()
    first = Sequence(pool)
    first.reserve(4 * BLOCK)
    _write(first, rows.keys[: 4 * BLOCK], rows.values[: 4 * BLOCK], 0)
    commit_tokens(first, rows.ids[: 4 * BLOCK])
    Sequence(pool).reserve(1)  # takes the block right after the prefix
    seq = Sequence(pool)
    assert seq.start(rows.ids) == 4 * BLOCK
    member = _place(pool, rows, seq)
    assert [r[2] for r in seq.runs(12)] == [0, 4] and seq.table[:4] == first.table
    assert all(pool.holders(b) == 2 for b in first.table)
    two = _of(_attend(pool, lay_out([member], WIDTHS, window=None, device=CPU),
                      [rows.queries]), member)
    assert torch.equal(two, one)
    torch.testing.assert_close(one, _reference(rows), atol=1e-5, rtol=1e-5)


# -- the cache a layer is handed ---------------------------------------------------------------

def _states(width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's ``[1, kv_heads, width, dim]`` keys and values; junk rows (past the real ones)
    are filled by the caller."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, KV_HEADS, width, DIM, generator=gen),
            torch.randn(1, KV_HEADS, width, DIM, generator=gen))


def test_pool_cache_update_writes_only_the_real_rows_at_their_slots() -> None:
    pool = _pool(layers=2)
    a, b = Sequence(pool), Sequence(pool)
    for seq, kv_len, n in ((a, 5, 3), (b, 260, 2)):
        seq.reserve(kv_len + n)
        commit_tokens(seq, list(range(kv_len)))
    members = [Member(a, [1, 2, 3], [0, 1, 2], np.tri(3, dtype=bool)),
               Member(b, [4, 5], [0, 1], np.tri(2, dtype=bool))]
    layout = lay_out(members, (8,), window=None, device=CPU)
    assert layout.width == 8  # five real rows, three junk
    for buf in (*pool.keys, *pool.values):
        buf.fill_(3.0)
    before = [buf.clone() for buf in (*pool.keys, *pool.values)]
    key_states, value_states = _states(8, 0)
    key_states[..., 5:, :], value_states[..., 5:, :] = -1.0, -1.0  # junk: written nowhere
    keys, values = PoolCache(pool, layout).update(key_states, value_states, 1)
    assert keys is pool.keys[1] and values is pool.values[1]
    # What the update should have done: rows 0-2 at a's positions 5-7, rows 3-4 at b's 260-261.
    want = [buf.clone() for buf in before]
    for seq, kv_len, first, n in ((a, 5, 0, 3), (b, 260, 3, 2)):
        at = seq.slots(torch.arange(kv_len, kv_len + n))
        want[1][at // BLOCK, :, at % BLOCK] = key_states[0, :, first : first + n].transpose(0, 1)
        want[3][at // BLOCK, :, at % BLOCK] = value_states[0, :, first : first + n].transpose(0, 1)
    for got, expected in zip((*pool.keys, *pool.values), want, strict=True):
        assert torch.equal(got, expected)
    assert torch.equal(pool.keys[0], before[0])  # the other layer untouched
    read_keys, _ = a.read(1, 8)
    assert torch.equal(read_keys[:, 5:8], key_states[0, :, :3])


def test_pool_cache_update_writes_a_trees_rows_at_the_slots_its_masks_read() -> None:
    """A tree's rows: row ``c`` is read at position ``kv_len + c`` (plan.py's masks: "p =
    kv_len + c with anc[r, c]"; the window mask's key positions; ``commit_on``'s gather of the
    accepted path from ``kv_len + 1 + node``), so that is where the update must write it, not
    at ``kv_len + depth`` where siblings overwrite each other. Then the forward's attention,
    written by the update, is sdpa attention over the tree."""
    rows = _rows(4, 10, TREE6)
    pool = _pool()
    seq = Sequence(pool)
    seq.reserve(rows.kv_len + rows.n)
    _write(seq, rows.keys[: rows.kv_len], rows.values[: rows.kv_len], 0)
    commit_tokens(seq, rows.ids)
    member = Member(seq, [7] * rows.n, rows.depth, rows.anc)
    layout = lay_out([member], WIDTHS, window=None, device=CPU)
    key_states, value_states = _states(layout.width, 1)
    key_states[0, :, : rows.n] = rows.keys[rows.kv_len :].transpose(0, 1)
    value_states[0, :, : rows.n] = rows.values[rows.kv_len :].transpose(0, 1)
    PoolCache(pool, layout).update(key_states, value_states, 0)
    written, _ = seq.read(0, rows.kv_len + rows.n)
    lost = [r for r in range(rows.n)
            if not torch.equal(written[:, rows.kv_len + r], key_states[0, :, r])]
    assert not lost, (f"tree rows {lost} are not at kv_len + row (write offsets "
                      f"{layout.write_offsets.tolist()}, kv_len {rows.kv_len})")
    ours = _of(_attend(pool, layout, [rows.queries]), member)
    torch.testing.assert_close(ours, _reference(rows), atol=1e-5, rtol=1e-5)


# -- agentspec_sdpa: the engine's path, or transformers' ------------------------------------

def _plain_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, HEADS, 5, DIM, generator=gen)
    key = torch.randn(1, KV_HEADS, 20, DIM, generator=gen)
    value = torch.randn(1, KV_HEADS, 20, DIM, generator=gen)
    mask = torch.rand(1, 1, 5, 20, generator=gen) > 0.3
    mask[..., 0] = True
    return query, key, value, mask


def _small_forward() -> tuple[KVPool, Layout]:
    pool = _pool()
    member = _place(pool, _rows(1, 30, CHAIN5))
    return pool, lay_out([member], WIDTHS, window=8, device=CPU)


def test_agentspec_sdpa_outside_a_forward_or_with_another_mask_is_transformers_sdpa() -> None:
    query, key, value, mask = _plain_inputs()

    def sdpa(m: torch.Tensor) -> torch.Tensor:
        return sdpa_attention_forward(MODULE, query, key, value, m, scaling=0.3)[0]

    def ours(m: torch.Tensor, **kwargs) -> torch.Tensor:
        out, weights = agentspec_sdpa(MODULE, query, key, value, m, scaling=0.3, **kwargs)
        assert weights is None
        return out

    assert torch.equal(ours(mask), sdpa(mask))  # no forward laid out
    assert torch.equal(ours(FULL), sdpa(FULL))  # the engine's mask, but no forward
    pool, layout = _small_forward()
    with laid_out(layout, pool):
        assert torch.equal(ours(mask), sdpa(mask))  # a mask of its own
        # Equal to the sentinel but not it: the check is by identity.
        assert torch.equal(ours(torch.ones(1, 1, 1, 1, dtype=torch.bool)), sdpa(FULL))
        # What the engine's attention does not do goes to sdpa too (which warns and runs on).
        assert torch.equal(ours(FULL, output_attentions=True), sdpa(FULL))
    assert torch.equal(ours(mask), sdpa(mask))  # the forward's layout is gone after it
    with pytest.raises(ValueError, match="softcap"):  # outside a forward: sdpa's own refusal
        ours(FULL, softcap=30.0)


def test_agentspec_sdpa_inside_a_forward_attends_each_group_over_the_pool() -> None:
    """Inside ``laid_out`` with the engine's masks: ``[1, width, heads, dim]``, each group's
    rows by ``group_attention`` (sliding layers with the window's masks), junk rows zero;
    the model's query layout ``[1, heads, width, dim]``, keys and values the pool's buffers."""
    pool = _pool()
    cases = [_rows(2, 30, [-1, 0]), _rows(3, 300, list(range(-1, 19)))]
    members = [_place(pool, rows) for rows in cases]
    layout = lay_out(members, WIDTHS, window=16, device=CPU)
    assert len(layout.groups) == 2
    for name, mask, window in (("full", FULL, False), ("sliding", SLIDING, True)):
        want = _attend(pool, layout, [rows.queries for rows in cases], window=window)
        gen = torch.Generator().manual_seed(99)  # _attend's queries, junk rows included
        query = torch.randn(layout.width, HEADS, DIM, generator=gen) * 10
        for member, rows in zip(members, cases, strict=True):
            query[member.row0 : member.row0 + rows.n] = rows.queries
        with laid_out(layout, pool):
            out, weights = agentspec_sdpa(MODULE, query.transpose(0, 1)[None], pool.keys[0],
                                          pool.values[0], mask)  # scaling: dim ** -0.5
        assert weights is None and out.shape == (1, layout.width, HEADS, DIM)
        assert torch.equal(out[0], want), name
        for member, rows in zip(members, cases, strict=True):
            torch.testing.assert_close(_of(out[0], member), _reference(rows, 16 if window else None),
                                       atol=1e-5, rtol=1e-5)


def test_verifying_attention_switches_sdpa_and_eager_models_only_and_restores() -> None:
    sdpa = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="sdpa"))
    with verifying_attention(sdpa):
        assert sdpa.config._attn_implementation == "agentspec_sdpa"
    assert sdpa.config._attn_implementation == "sdpa"
    eager = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="eager"))
    with verifying_attention(eager):  # Gemma 2's (sdpa has no logit cap)
        assert eager.config._attn_implementation == "agentspec_sdpa"
    assert eager.config._attn_implementation == "eager"
    flash = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    with verifying_attention(flash):
        assert flash.config._attn_implementation == "flash_attention_2"
    with pytest.raises(RuntimeError), verifying_attention(sdpa):
        raise RuntimeError("a failing forward")
    assert sdpa.config._attn_implementation == "sdpa"


# -- the fold of the key blocks ---------------------------------------------------------------

def test_block_fold_gives_the_same_bits_whatever_zero_blocks_follow() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 9, 5, 4, generator=gen) * 100  # [members, blocks, ...]
    broken = 0
    for n in range(1, 10):
        for fold in (fold_blocks, _halves_fold):
            want = fold(x[:, :n])
            for extra in (1, 2, 3, 7, 12):
                padded = torch.cat([x[:, :n], torch.zeros(3, extra, 5, 4)], dim=1)
                same = torch.equal(fold(padded), want)
                if fold is fold_blocks:
                    assert same, (n, extra)
                else:
                    broken += not same
        torch.testing.assert_close(fold_blocks(x[:, :n]), x[:, :n].sum(1), atol=1e-3, rtol=1e-5)
    assert broken  # the wrong fold fails the same check
