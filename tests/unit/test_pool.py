"""The KV pool's bookkeeping (agentspec/engine/pool.py, sequence.py) on tiny layers.

What is checked: blocks are allocated so a sequence's table stays in runs; full blocks are
sealed into a trie keyed by the tokens before them and held by reference by later prompts (a
trie keyed by a block's tokens alone fails that check); tails are taken over, shared blocks
copied on write; truncating copies the block it writes and keeps the rows it drops cached;
released blocks stay cached within the budget, least recently used out first. The rows here
stand in for a model's: each is a function of its token and position, so a block's bytes show
whose rows it holds. That a shared or restored row is the bits a prefill computes, on the
real model, is tests/integration/test_prefix_cache.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence as Seq

import pytest
import torch

from agentspec.engine.pool import BLOCK, KVPool, PoolStats
from agentspec.engine.pool import index as pool_index
from agentspec.engine.sequence import Sequence
from agentspec.types import Verdict
from tests.solo import commit_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_BYTES = 2 * 1 * BLOCK * 4 * 4  # keys and values, one head of 4 float32s


def _pool(cache_bytes: int = 100 * BLOCK_BYTES, cls: type[KVPool] = KVPool) -> KVPool:
    pool = cls("cpu", cache_bytes=cache_bytes)
    pool.define_layers([(1, 4, torch.float32)])
    assert pool.block_bytes == BLOCK_BYTES
    return pool


def _ids(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def _kv_rows(ids: list[int], start: int) -> torch.Tensor:
    """The stand-in keys ``[rows, 1 head, 4]`` of ``ids`` at positions from ``start`` (the
    values are their negatives)."""
    tokens = torch.tensor(ids, dtype=torch.float32)
    positions = torch.arange(start, start + len(ids), dtype=torch.float32)
    return torch.stack([tokens, positions, tokens + positions, torch.ones_like(tokens)], 1)[:, None]


def _prefill(seq: Sequence, ids: list[int]) -> None:
    """What a forward and a commit do: the rows of ``ids`` written at the sequence's next
    positions, then committed."""
    start = seq.kv_len
    seq.reserve(start + len(ids))
    at = seq.slots(torch.arange(start, start + len(ids)))
    rows = _kv_rows(ids, start)
    seq.pool.keys[0][at // BLOCK, :, at % BLOCK] = rows
    seq.pool.values[0][at // BLOCK, :, at % BLOCK] = -rows
    commit_tokens(seq, ids)


def _holds_rows_of(seq: Sequence, ids: list[int]) -> bool:
    """Its first ``len(ids)`` positions hold the rows of ``ids``."""
    keys, values = seq.read(0, len(ids))
    want = _kv_rows(ids, 0).transpose(0, 1)  # [1 head, rows, 4]
    return torch.equal(keys, want) and torch.equal(values, -want)


def _started(pool: KVPool, ids: list[int]) -> Sequence:
    """A sequence whose prompt is ``ids``: cached rows held, the rest computed."""
    seq = Sequence(pool)
    seq.start(ids)
    _prefill(seq, ids[seq.kv_len :])
    return seq


def _found(pool: KVPool, ids: list[int]) -> int:
    """How many rows of ``ids`` a new sequence finds (it is released at once)."""
    seq = Sequence(pool)
    n = seq.start(ids)
    seq.release()
    return n


# -- allocation -------------------------------------------------------------------------------

def test_allocation_prefers_the_block_after_the_previous_one() -> None:
    pool = _pool()
    a, b, c = Sequence(pool), Sequence(pool), Sequence(pool)
    a.reserve(1)
    b.reserve(1)
    assert (a.table, b.table) == ([0], [1])
    a.reserve(3 * BLOCK)  # block 1 is b's: the lowest free one, then the one after it
    b.reserve(2 * BLOCK)
    assert (a.table, b.table) == ([0, 2, 3], [1, 4])
    assert a.runs(3) == [(0, 1, 0), (2, 2, 1)] and a.runs(2) == [(0, 1, 0), (2, 1, 1)]
    c.reserve(6 * BLOCK)  # past the pool's first 8 blocks: it grows, the run goes on
    assert pool.num_blocks > 8 and c.runs(6) == [(5, 6, 0)]
    a.release()  # blocks 0, 2 and 3 are free now, but the block after c's last still wins
    c.reserve(7 * BLOCK)
    assert c.runs(7) == [(5, 7, 0)]
    b.reserve(3 * BLOCK)  # the block after b's last is taken: the lowest free one
    assert b.table == [1, 4, 0]


def test_growing_the_pool_keeps_its_rows_and_bumps_its_generation() -> None:
    pool = _pool()
    seq = _started(pool, _ids(10, 300))
    generation, before = pool.generation, pool.num_blocks
    Sequence(pool).reserve(before * BLOCK)  # more blocks than are free
    assert pool.num_blocks > before and pool.generation > generation
    assert _holds_rows_of(seq, _ids(10, 300))


# -- sealed blocks, held by reference -------------------------------------------------------

def test_full_blocks_are_sealed_and_held_by_reference_by_a_prompt_that_starts_with_them() -> None:
    pool = _pool()
    prompt = _ids(1000, 2 * BLOCK + 10)
    a = _started(pool, prompt)
    assert [pool.trie.sealed(b) for b in a.table] == [True, True, False]  # the tail is a's to write
    blocks = pool.num_blocks
    b = Sequence(pool)
    assert b.start([*prompt[: 2 * BLOCK], 1, 2, 3]) == 2 * BLOCK == b.reused_tokens
    assert b.table == a.table[:2] and b.ids == prompt[: 2 * BLOCK]
    assert [pool.holders(x) for x in a.table] == [2, 2, 1]
    assert _holds_rows_of(b, prompt[: 2 * BLOCK]) and pool.num_blocks == blocks  # no copy
    assert pool.stats == PoolStats(hits=1, reused_tokens=2 * BLOCK, sealed_blocks=2,
                                   evicted_blocks=0, blocks=blocks)
    b.release()
    assert [pool.holders(x) for x in a.table] == [1, 1, 1]


def test_a_sequence_restarted_with_its_own_tokens_keeps_its_rows() -> None:
    """A next turn extends the sequence's own committed tokens: nothing moves, the rows it
    holds (the unsealed tail's too) are counted as reused."""
    pool = _pool()
    prompt = _ids(1000, BLOCK + 50)
    seq = _started(pool, prompt)
    table = list(seq.table)
    assert seq.start([*prompt, 7, 8]) == BLOCK + 50 and seq.table == table
    assert seq.start([*prompt[:BLOCK + 20], 9]) == BLOCK + 20 and seq.ids == prompt[:BLOCK + 20]
    assert (pool.stats.hits, pool.stats.reused_tokens) == (0, 0)  # none found beyond its own


class _TokensOnlyPool(KVPool):
    """The deliberately wrong trie: a block is found by its own tokens, whatever tokens it
    was computed after."""

    def match(self, ids: Seq[int]) -> tuple[list[int], int, int]:
        by_tokens = {tokens: block for block, (_, tokens) in self.trie._key.items()}
        chain: list[int] = []
        for start in range(0, len(ids) - BLOCK + 1, BLOCK):
            block = by_tokens.get(tuple(ids[start : start + BLOCK]))
            if block is None:
                break
            chain.append(block)
        return chain, -1, 0


@pytest.mark.parametrize(("cls", "after_z", "first"), [
    (KVPool, BLOCK, 0),  # y's rows were computed after x: after z, only z's block is found
    (_TokensOnlyPool, 2 * BLOCK, BLOCK),  # the wrong trie hands out y's rows after z, or first
])
def test_a_block_is_found_only_after_the_tokens_it_was_computed_after(cls, after_z, first) -> None:
    pool = _pool(cls=cls)
    x, y, z, w = (_ids(base, BLOCK) for base in (1000, 2000, 3000, 4000))
    _started(pool, [*x, *y])
    _started(pool, [*z, *w])
    assert _found(pool, [*x, *y]) == 2 * BLOCK
    assert _found(pool, [*z, *y]) == after_z
    assert _found(pool, y) == first


# -- partly matching blocks -------------------------------------------------------------------

def test_a_finished_sequences_tail_is_taken_over_whole_by_a_prompt_that_extends_it() -> None:
    pool = _pool()
    prompt = _ids(1000, BLOCK + 100)
    a = _started(pool, prompt)
    first, tail = a.table
    a.release()
    assert pool.stats.cached_blocks == 2 and pool.holders(tail) == 0
    blocks = pool.num_blocks
    b = Sequence(pool)
    assert b.start([*prompt, 5, 6]) == BLOCK + 100 == b.reused_tokens
    assert b.table == [first, tail] and pool.holders(tail) == 1 and pool.num_blocks == blocks
    assert not pool.trie.sealed(tail)  # b writes it: no later prompt may find it
    assert _holds_rows_of(b, prompt)
    _prefill(b, [5, 6])
    assert b.table == [first, tail] and _holds_rows_of(b, [*prompt, 5, 6])
    assert _found(pool, prompt) == BLOCK  # the tail is b's now, not the cache's


def test_a_tail_that_matches_only_partly_is_copied_and_stays_cached() -> None:
    """A prompt that keeps only part of a finished sequence's tail copies those rows: the tail
    stays cached whole for the prompt that extends all of it (the agent's own next turn)."""
    pool = _pool()
    prompt = _ids(1000, BLOCK + 100)
    a = _started(pool, prompt)
    tail = a.table[1]
    a.release()
    b = Sequence(pool)
    assert b.start([*prompt[: BLOCK + 40], 5]) == BLOCK + 40
    assert b.table[1] != tail and b.ids == prompt[: BLOCK + 40]
    _prefill(b, [5])  # writes position BLOCK + 40 in its own copy
    assert _holds_rows_of(b, [*prompt[: BLOCK + 40], 5])
    c = Sequence(pool)
    assert c.start([*prompt, 7]) == len(prompt) and c.table[1] == tail  # the whole tail, taken


@pytest.mark.parametrize("released", [False, True])
def test_a_shared_sealed_block_that_matches_partly_is_copied_and_never_written(released) -> None:
    pool = _pool()
    prompt = _ids(1000, 2 * BLOCK)
    a = _started(pool, prompt)
    first, second = a.table
    if released:
        a.release()
    before = (pool.keys[0][second].clone(), pool.values[0][second].clone())
    b = Sequence(pool)
    assert b.start([*prompt[: BLOCK + 100], 1, 2]) == BLOCK + 100
    assert b.table[0] == first and b.table[1] not in (first, second)
    assert pool.holders(second) == (0 if released else 1) and pool.trie.sealed(second)
    assert _holds_rows_of(b, prompt[: BLOCK + 100])
    _prefill(b, _ids(5000, 120))  # b's next rows: in its copy
    assert _holds_rows_of(b, [*prompt[: BLOCK + 100], *_ids(5000, 120)])
    assert torch.equal(pool.keys[0][second], before[0])
    assert torch.equal(pool.values[0][second], before[1])
    assert _found(pool, prompt) == 2 * BLOCK  # still found, whole


# -- truncation -------------------------------------------------------------------------------

def test_truncating_into_a_sealed_block_copies_it_and_keeps_the_dropped_rows_findable() -> None:
    """A rollback below a full block: the sequence writes a copy of it, and the blocks it
    drops (full ones sealed, the partly filled last one as a tail) stay cached intact for a
    prompt that comes back to them."""
    pool = _pool()
    prompt = _ids(1000, 2 * BLOCK + 10)
    seq = _started(pool, prompt)
    first, second, tail = seq.table
    before = (pool.keys[0][second].clone(), pool.values[0][second].clone())
    seq.truncate(BLOCK + 44)
    assert seq.ids == prompt[: BLOCK + 44] and seq.table[0] == first
    assert seq.table[1] not in (second, tail) and _holds_rows_of(seq, prompt[: BLOCK + 44])
    assert pool.trie.sealed(second) and pool.holders(second) == 0
    assert pool.trie.sealed(tail) and pool.holders(tail) == 0
    _prefill(seq, _ids(7000, 30))  # the sequence's next rows: in its copy
    assert _holds_rows_of(seq, [*prompt[: BLOCK + 44], *_ids(7000, 30)])
    assert torch.equal(pool.keys[0][second], before[0])
    assert torch.equal(pool.values[0][second], before[1])
    back = Sequence(pool)
    assert back.start([*prompt, 5]) == 2 * BLOCK + 10 and back.table == [first, second, tail]
    assert _holds_rows_of(back, prompt)


def test_truncating_to_a_block_boundary_copies_nothing() -> None:
    pool = _pool()
    prompt = _ids(1000, 2 * BLOCK + 10)
    seq = _started(pool, prompt)
    first, second, _ = seq.table
    seq.truncate(2 * BLOCK)
    assert seq.table == [first, second] and pool.holders(second) == 1
    _prefill(seq, _ids(7000, 20))  # into a new block of its own
    assert seq.table[:2] == [first, second] and _holds_rows_of(seq, [*prompt[: 2 * BLOCK], *_ids(7000, 20)])


def test_truncating_into_a_shared_sealed_block_copies_it_and_leaves_the_other_holders_rows() -> None:
    pool = _pool()
    prompt = _ids(1000, 2 * BLOCK)
    a = _started(pool, prompt)
    b = Sequence(pool)
    assert b.start(prompt) == 2 * BLOCK and b.table == a.table
    first, second = a.table
    before = (pool.keys[0][second].clone(), pool.values[0][second].clone())
    b.truncate(BLOCK + 44)
    assert b.table[0] == first and b.table[1] not in (first, second)
    assert pool.holders(second) == 1 and pool.trie.sealed(second)
    assert _holds_rows_of(b, prompt[: BLOCK + 44])
    _prefill(b, _ids(7000, 100))
    assert _holds_rows_of(b, [*prompt[: BLOCK + 44], *_ids(7000, 100)])
    assert torch.equal(pool.keys[0][second], before[0])
    assert torch.equal(pool.values[0][second], before[1])
    assert _holds_rows_of(a, prompt)


def test_truncate_refuses_a_length_it_does_not_hold() -> None:
    seq = _started(_pool(), _ids(1000, 10))
    for bad in (-1, 11):
        with pytest.raises(ValueError, match=f"got {bad}"):
            seq.truncate(bad)


# -- the cached blocks and their budget ------------------------------------------------------

def test_released_blocks_stay_cached_and_the_least_recently_used_go_first() -> None:
    pool = _pool(cache_bytes=4 * BLOCK_BYTES)
    a, b, c = (_ids(base, 2 * BLOCK) for base in (1000, 2000, 3000))
    _started(pool, a).release()
    _started(pool, b).release()
    assert pool.stats.cached_blocks == 4 and pool.stats.cached_bytes == 4 * BLOCK_BYTES
    assert _found(pool, a) == 2 * BLOCK  # a is now more recent than b
    _started(pool, c).release()  # over the budget: b's first block goes, its second with it
    assert (_found(pool, a), _found(pool, b), _found(pool, c)) == (2 * BLOCK, 0, 2 * BLOCK)
    stats = pool.stats
    assert stats.evicted_blocks == 2 and stats.cached_blocks == 4
    assert stats.cached_bytes == 4 * BLOCK_BYTES


def test_a_released_sequence_longer_than_the_budget_keeps_its_first_blocks() -> None:
    """The blocks a budget can keep are a released prompt's first ones (a shared system prompt
    and tool docs): a prefix is more recent than its extensions (``KVPool.match``), so the
    least recently used is a last block, and evicting it takes nothing else."""
    pool = _pool(cache_bytes=2 * BLOCK_BYTES)
    prompt = _ids(1000, 3 * BLOCK)
    _started(pool, prompt).release()
    assert pool.stats.cached_blocks == 2
    assert _found(pool, prompt) == 2 * BLOCK


def test_a_sequence_needing_room_grows_the_pool_while_the_cache_is_within_its_budget() -> None:
    """Cached blocks under the budget are kept: the pool grows for a sequence that needs more
    blocks than are free (a team's cached tool docs survive a burst of new prompts)."""
    pool = _pool()
    _started(pool, _ids(1000, 4 * BLOCK)).release()
    blocks = pool.num_blocks
    assert pool.stats.cached_blocks == 4 and blocks < 4 + 5
    seq = Sequence(pool)
    seq.reserve((blocks - 4 + 1) * BLOCK)  # one block more than are free
    assert pool.num_blocks > blocks and pool.stats.evicted_blocks == 0
    assert _found(pool, _ids(1000, 4 * BLOCK)) == 4 * BLOCK


def test_a_sequence_needing_room_evicts_cached_blocks_once_the_cache_fills_its_budget() -> None:
    pool = _pool(cache_bytes=4 * BLOCK_BYTES)
    _started(pool, _ids(1000, 4 * BLOCK)).release()
    blocks = pool.num_blocks
    assert pool.stats.cached_blocks == 4 and blocks < 4 + 5
    seq = Sequence(pool)
    seq.reserve((blocks - 4 + 1) * BLOCK)  # one block more than are free
    assert pool.num_blocks == blocks and pool.stats.evicted_blocks >= 1


def test_unsealing_a_block_takes_its_sealed_descendants_out_of_the_trie() -> None:
    """``unseal`` (what an eviction and ``clear_cache`` run) on a block with blocks sealed
    under it: all of them leave the trie, and the cached ones among them are free again."""
    pool = _pool()
    prompt, other = _ids(1000, 3 * BLOCK), _ids(5000, 3 * BLOCK)
    held = _started(pool, prompt)
    pool.unseal(held.table[0])
    assert not any(pool.trie.sealed(b) for b in held.table) and _found(pool, prompt) == 0
    _started(pool, other).release()
    assert pool.stats.cached_blocks == 3
    pool.clear_cache()
    assert pool.stats.cached_blocks == 0 and pool.stats.evicted_blocks == 3
    assert _found(pool, other) == 0


def test_a_zero_budget_keeps_nothing_once_released() -> None:
    pool = _pool(cache_bytes=0)
    prompt = _ids(1000, 2 * BLOCK + 5)
    a = _started(pool, prompt)
    assert _found(pool, prompt) == 2 * BLOCK  # held blocks are shared all the same
    a.release()
    assert pool.stats.cached_blocks == 0 and _found(pool, prompt) == 0


def test_an_uncached_sequence_seals_nothing_and_finds_nothing() -> None:
    pool = _pool()
    prompt = _ids(1000, 2 * BLOCK + 5)
    scratch = Sequence(pool, cached=False)
    scratch.start(prompt)
    _prefill(scratch, prompt)
    assert not any(pool.trie.sealed(b) for b in scratch.table) and pool.stats.sealed_blocks == 0
    scratch.release()
    assert pool.stats.cached_blocks == 0 and _found(pool, prompt) == 0
    _started(pool, prompt)  # a cached sequence's blocks: the scratch one still finds none
    other = Sequence(pool, cached=False)
    assert other.start(prompt) == 0 and other.table == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1", None])
def test_a_bad_cache_budget_is_refused_naming_the_value(bad) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        KVPool("cpu", cache_bytes=bad)


def test_stats_count_hits_reused_tokens_sealed_and_evicted_blocks() -> None:
    pool = _pool(cache_bytes=3 * BLOCK_BYTES)
    prompt = _ids(1000, 2 * BLOCK + 10)
    a = _started(pool, prompt)  # no hit: nothing cached yet
    b = _started(pool, [*prompt[: 2 * BLOCK], *_ids(9000, 3)])  # a hit of two blocks
    c = _started(pool, prompt[:100])  # a hit of 100 rows, copied
    assert pool.stats.hits == 2 and pool.stats.reused_tokens == 2 * BLOCK + 100
    assert pool.stats.sealed_blocks == 2
    for seq in (a, b, c):  # each one's partly filled last block is sealed as a tail
        seq.release()
    stats = pool.stats
    assert stats.sealed_blocks == 5 and stats.cached_blocks <= 3
    assert stats.evicted_blocks == 5 - stats.cached_blocks and stats.blocks == pool.num_blocks
    assert stats.cached_bytes == stats.cached_blocks * BLOCK_BYTES


# -- keys in transposed runs of 16 (the native forward's layout) ------------------------------

def _lanes_pools() -> tuple[KVPool, KVPool]:
    """Two pools of one layer of 2 heads of 4 dims: keys as rows, and in runs of 16."""
    rows, lanes = KVPool("cpu"), KVPool("cpu")
    rows.define_layers([(2, 4, torch.float32)])
    lanes.define_layers([(2, 4, torch.float32)], key_lanes=16)
    return rows, lanes


def _write(seq: Sequence, start: int, rows: torch.Tensor) -> None:
    """Rows ``[n, 2 heads, 4]`` (values: their negatives) at positions from ``start``, through
    the pool's own index (either layout)."""
    seq.reserve(start + len(rows))
    at = seq.slots(torch.arange(start, start + len(rows)))
    for buf, sign in ((seq.pool.keys[0], 1), (seq.pool.values[0], -1)):
        buf[pool_index(buf, at // BLOCK, at % BLOCK)] = sign * rows


def test_keys_in_runs_of_16_lie_transposed_and_values_as_rows() -> None:
    _, pool = _lanes_pools()
    seq = Sequence(pool, cached=False)
    rows = torch.randn(40, 2, 4)
    _write(seq, 0, rows)
    keys, values = pool.keys[0], pool.values[0]
    block = seq.table[0]
    assert keys.shape == (pool.num_blocks, 2, BLOCK // 16, 4, 16)
    assert values.shape == (pool.num_blocks, 2, BLOCK, 4)
    for p in (0, 15, 16, 39):  # key dimension d of position p: run p // 16, lane p % 16
        assert torch.equal(keys[block, :, p // 16, :, p % 16], rows[p])
        assert torch.equal(values[block, :, p], -rows[p])
    assert torch.equal(keys[block, 1, 2, 3, :8], rows[32:40, 1, 3])  # one vector: 16 keys' dim
    got_keys, got_values = seq.read(0, 40)
    assert torch.equal(got_keys, rows.transpose(0, 1)) and torch.equal(got_values, -got_keys)


def test_copies_moves_and_growth_keep_the_same_rows_in_either_layout() -> None:
    """The same writes, a tree commit (rows gathered into place), pool growth and a copy of a
    shared block read back the same rows whether the keys lie as rows or in runs of 16."""
    torch.manual_seed(0)
    prompt = _ids(1000, BLOCK + 40)
    prompt_rows = torch.randn(len(prompt), 2, 4)
    tree_rows = torch.randn(5, 2, 4)
    tail_rows = torch.randn(30, 2, 4)
    reads = []
    for pool in _lanes_pools():
        a = Sequence(pool)
        a.start(prompt)
        _write(a, 0, prompt_rows)
        commit_tokens(a, prompt)
        _write(a, a.kv_len, tree_rows)  # a root and four drafted rows; the path takes 1 and 3
        a.commit(7, Verdict((1, 3), (8, 9), 10))
        b = Sequence(pool)  # the prompt's first block held by reference
        assert b.start(prompt[: BLOCK + 20]) == BLOCK and b.table[0] == a.table[0]
        _write(b, BLOCK, torch.cat([prompt_rows[BLOCK : BLOCK + 20], tail_rows]))
        commit_tokens(b, [*prompt[BLOCK : BLOCK + 20], *_ids(5000, 30)])
        pool._grow(3 * pool.num_blocks)  # the buffers made again, the rows carried over
        tree = a.read(0, a.kv_len)
        a.truncate(BLOCK - 10)  # into the shared, sealed first block: a copy of its rows
        assert a.table[0] != b.table[0]
        reads.append((tree, a.read(0, a.kv_len), b.read(0, b.kv_len)))
    for want, got in zip(*reads, strict=True):
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    tree, copied, other = reads[0]
    assert torch.equal(tree[0], torch.cat([prompt_rows, tree_rows[[0, 2, 4]]]).transpose(0, 1))
    assert torch.equal(copied[0], prompt_rows[: BLOCK - 10].transpose(0, 1))
    assert torch.equal(other[0][:, BLOCK + 20 :], tail_rows.transpose(0, 1))


def test_a_pool_refuses_another_key_layout_or_a_bad_one() -> None:
    rows, lanes = _lanes_pools()
    with pytest.raises(ValueError, match="key_lanes 16"):
        lanes.define_layers([(2, 4, torch.float32)])
    with pytest.raises(ValueError, match="key_lanes must be 0 or 16, got 8"):
        KVPool("cpu").define_layers([(2, 4, torch.float32)], key_lanes=8)
