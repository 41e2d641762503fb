"""The prefix cache: KV rows of earlier calls, kept by their token ids, restored instead of prefilled.

An :class:`~agentspec.engine.target.HFTarget` holds one KV, and a call reuses the rows of the prefix
it shares with the call just before it. Agent traffic interleaves: several agents, tool sets
or conversations go through one model, and each switch overwrote the rows of a system prompt
(a thousand tokens of tool docs) that the next call of that agent prefilled again. Before a
call overwrites the rows it does not share, the cache copies them out, in blocks of
:data:`BLOCK` tokens; a later call whose prompt starts with cached blocks gets their rows
copied back and prefills only the rest.

Blocks form a trie: a block is found by its own tokens under the block before it, so a block is
only ever reused after exactly the tokens it was computed after (no hashes: two prefixes never
share an entry). Least recently used blocks are dropped first once the cache holds more than
its byte budget, a block's descendants with it (a prefix is always used at least as recently
as its extensions, so those are older anyway).

Exact: a KV row is a function of the model and the token ids up to and including its own, the
same bits however its prefix was chunked into forwards (what reusing the held prefix already
relies on, ``tests/integration/test_invariance.py``); restoring copies those bits back to the
same positions (``tests/integration/test_prefix_cache.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

BLOCK = 64
"""Tokens per cached block: only whole blocks are kept, so a call re-prefills at most
``BLOCK - 1`` cached tokens; smaller blocks mean more copies per token."""

DEFAULT_BYTES = 512 * 2**20
"""The default budget per target (SmolLM2-135M in float32: ~46 KB of KV per token, so
~11,000 tokens: a dozen agents' tool docs)."""


@dataclass(eq=False)
class _Block:
    id: int
    parent: int  # 0: the first block of a prompt
    tokens: tuple[int, ...]
    keys: torch.Tensor  # [layers, kv_heads, BLOCK, head_dim]
    values: torch.Tensor
    children: set[int] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made: calls whose prompt was served from it, the rows
    copied back, the blocks saved and dropped; what it holds now."""

    hits: int = 0
    restored_tokens: int = 0
    saved_blocks: int = 0
    evicted_blocks: int = 0
    blocks: int = 0
    bytes: int = 0


class PrefixCache:
    """Blocks of KV rows keyed by token prefix, least recently used dropped past ``max_bytes``.

    Args:
        max_bytes: the budget (> 0). A block that alone exceeds it is never kept.
    """

    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._by_key: dict[tuple[int, tuple[int, ...]], _Block] = {}
        self._lru: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._next_id = 1
        self._bytes = 0
        self._counts = PrefixCacheStats()

    @property
    def stats(self) -> PrefixCacheStats:
        c = self._counts
        return PrefixCacheStats(c.hits, c.restored_tokens, c.saved_blocks, c.evicted_blocks,
                                len(self._lru), self._bytes)

    def longest(self, ids: Sequence[int]) -> list[_Block]:
        """The cached blocks that ``ids`` starts with, first block first."""
        chain: list[_Block] = []
        parent = 0
        for start in range(0, len(ids) - BLOCK + 1, BLOCK):
            block = self._by_key.get((parent, tuple(ids[start : start + BLOCK])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        return chain

    def save(self, ids: Sequence[int], kv_keys: Sequence[torch.Tensor],
             kv_values: Sequence[torch.Tensor]) -> None:
        """Keep the whole blocks of ``ids``, whose rows are the first ``len(ids)`` rows of the
        per-layer buffers ``kv_keys``/``kv_values`` (``[1, kv_heads, capacity, head_dim]``);
        blocks already cached are not copied again."""
        chain = self.longest(ids)
        parent = chain[-1].id if chain else 0
        for start in range(len(chain) * BLOCK, len(ids) - BLOCK + 1, BLOCK):
            end = start + BLOCK
            block = _Block(self._next_id, parent, tuple(ids[start:end]),
                           torch.stack([k[0, :, start:end] for k in kv_keys]),
                           torch.stack([v[0, :, start:end] for v in kv_values]))
            if block.nbytes > self.max_bytes:
                break
            self._next_id += 1
            self._by_key[(parent, block.tokens)] = block
            if parent:
                self._lru[parent].children.add(block.id)
            self._lru[block.id] = block
            self._bytes += block.nbytes
            self._counts.saved_blocks += 1
            chain.append(block)
            parent = block.id
        self._touch(chain)
        while self._bytes > self.max_bytes and self._lru:
            self._drop(next(iter(self._lru.values())))

    def restore(self, chain: Sequence[_Block], kv_keys: Sequence[torch.Tensor],
                kv_values: Sequence[torch.Tensor], *, held: int = 0) -> int:
        """Copy ``chain``'s rows into the buffers at their positions, skipping whole blocks
        below ``held`` (rows the buffers hold already); returns the rows now held."""
        first = held // BLOCK
        todo = chain[first:]
        if todo:
            start, end = first * BLOCK, len(chain) * BLOCK
            for stored, bufs in ((torch.cat([b.keys for b in todo], dim=2), kv_keys),
                                 (torch.cat([b.values for b in todo], dim=2), kv_values)):
                for layer, buf in enumerate(bufs):
                    buf[0, :, start:end].copy_(stored[layer])
            self._counts.hits += 1
            self._counts.restored_tokens += end - held  # start <= held: whole blocks only
        self._touch(chain)
        return max(held, len(chain) * BLOCK)

    def clear(self) -> None:
        self._by_key.clear()
        self._lru.clear()
        self._bytes = 0

    def _touch(self, chain: Sequence[_Block]) -> None:
        # Deepest first, so a prefix ends more recent than its extensions: dropping from the
        # least recent end never takes a block whose descendants are still wanted.
        for block in reversed(chain):
            self._lru.move_to_end(block.id)

    def _drop(self, block: _Block) -> None:
        todo = [block]
        while todo:
            b = todo.pop()
            if self._lru.pop(b.id, None) is None:
                continue
            del self._by_key[(b.parent, b.tokens)]
            self._bytes -= b.nbytes
            self._counts.evicted_blocks += 1
            todo.extend(self._lru[c] for c in b.children if c in self._lru)
        parent = self._lru.get(block.parent)
        if parent is not None:
            parent.children.discard(block.id)


def uniform_layers(kv_keys: Sequence[Any]) -> bool:
    """Whether every layer's buffer has one shape (blocks stack layers into one tensor)."""
    return len({tuple(k.shape) for k in kv_keys}) <= 1
