"""The prefix cache's bookkeeping on small tensors: blocks by exact prefix, copies, eviction.

Exactness on the real model (restored rows are the bits a prefill computes, and a cache keyed
without the blocks before fails that) is in tests/integration/test_prefix_cache.py.
"""

from __future__ import annotations

import pytest
import torch

from agentspec.engine.prefix import BLOCK, PrefixCache

LAYERS, HEADS, DIM, CAPACITY = 3, 2, 4, 4 * BLOCK


def _kv(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, HEADS, CAPACITY, DIM, generator=gen) for _ in range(LAYERS)]
    values = [torch.randn(1, HEADS, CAPACITY, DIM, generator=gen) for _ in range(LAYERS)]
    return keys, values


def _empty() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return ([torch.zeros(1, HEADS, CAPACITY, DIM) for _ in range(LAYERS)],
            [torch.zeros(1, HEADS, CAPACITY, DIM) for _ in range(LAYERS)])


BLOCK_BYTES = 2 * LAYERS * HEADS * BLOCK * DIM * 4  # keys and values, float32


def test_whole_blocks_are_saved_and_restored_at_their_positions() -> None:
    cache = PrefixCache(10 * BLOCK_BYTES)
    keys, values = _kv(0)
    ids = list(range(2 * BLOCK + 10))  # two whole blocks and a tail that is not kept
    cache.save(ids, keys, values)
    assert cache.stats.blocks == 2 and cache.stats.bytes == 2 * BLOCK_BYTES
    chain = cache.longest([*ids[: 2 * BLOCK], 999, 998])
    assert len(chain) == 2
    k2, v2 = _empty()
    assert cache.restore(chain, k2, v2) == 2 * BLOCK
    for a, b in zip(keys + values, k2 + v2, strict=True):
        assert torch.equal(a[:, :, : 2 * BLOCK], b[:, :, : 2 * BLOCK])
        assert not b[:, :, 2 * BLOCK :].any()  # nothing past the blocks is written
    assert cache.stats.hits == 1 and cache.stats.restored_tokens == 2 * BLOCK


def test_a_block_is_found_only_after_the_tokens_it_was_computed_after() -> None:
    cache = PrefixCache(10 * BLOCK_BYTES)
    keys, values = _kv(0)
    shared = list(range(1000, 1000 + BLOCK))
    cache.save([*range(BLOCK), *shared], keys, values)
    # The same second block after another first block: its rows were computed after other
    # tokens, so nothing is found.
    assert cache.longest([*range(1, BLOCK + 1), *shared]) == []
    assert len(cache.longest([*range(BLOCK), *shared])) == 2


def test_restore_skips_the_blocks_already_held() -> None:
    cache = PrefixCache(10 * BLOCK_BYTES)
    keys, values = _kv(0)
    ids = list(range(3 * BLOCK))
    cache.save(ids, keys, values)
    k2, v2 = _empty()
    assert cache.restore(cache.longest(ids), k2, v2, held=BLOCK + 5) == 3 * BLOCK
    assert not k2[0][:, :, :BLOCK].any()  # the held block is left as it was
    assert torch.equal(k2[0][:, :, BLOCK : 3 * BLOCK], keys[0][:, :, BLOCK : 3 * BLOCK])
    assert cache.stats.restored_tokens == 3 * BLOCK - (BLOCK + 5)


def test_saving_a_longer_prompt_copies_only_its_new_blocks() -> None:
    cache = PrefixCache(10 * BLOCK_BYTES)
    keys, values = _kv(0)
    cache.save(list(range(2 * BLOCK)), keys, values)
    cache.save(list(range(3 * BLOCK)), keys, values)
    assert cache.stats.saved_blocks == 3 and cache.stats.blocks == 3


def test_least_recently_used_blocks_go_first_with_their_descendants() -> None:
    cache = PrefixCache(4 * BLOCK_BYTES)
    keys, values = _kv(0)
    a = list(range(2 * BLOCK))
    b = list(range(5000, 5000 + 2 * BLOCK))
    c = list(range(9000, 9000 + 2 * BLOCK))
    cache.save(a, keys, values)
    cache.save(b, keys, values)
    cache.restore(cache.longest(a), *_empty())  # a is now more recent than b
    cache.save(c, keys, values)  # over budget: b's two blocks go
    assert len(cache.longest(a)) == 2 and len(cache.longest(c)) == 2
    assert cache.longest(b) == []
    assert cache.stats.evicted_blocks == 2 and cache.stats.bytes <= 4 * BLOCK_BYTES
    # A prefix dropped takes its extensions with it: none is left unreachable.
    cache._drop(cache.longest(a)[0])
    assert cache.stats.blocks == 2 and cache.longest(c)


def test_a_block_larger_than_the_budget_is_not_kept() -> None:
    cache = PrefixCache(BLOCK_BYTES - 1)
    keys, values = _kv(0)
    cache.save(list(range(BLOCK)), keys, values)
    assert cache.stats.blocks == 0 and cache.stats.bytes == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_a_bad_budget_is_named(bad: object) -> None:
    with pytest.raises(ValueError, match=repr(bad).replace("'", ".")):
        PrefixCache(bad)  # type: ignore[arg-type]
