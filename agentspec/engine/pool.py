"""The KV pool: one set of static buffers in blocks, shared by every sequence of one engine.

Every layer's keys and values live in one buffer of ``[blocks, kv_heads, BLOCK, head_dim]``
(the native forward's keys: ``[blocks, kv_heads, BLOCK // 16, head_dim, 16]``, each run of 16
positions transposed, see :meth:`KVPool.define_layers`):
a block holds :data:`BLOCK` consecutive positions of one sequence, the same number of keys the
engine's attention reduces at a time (:mod:`agentspec.engine.kv`), so a sequence's key block
``i`` (positions ``i * BLOCK`` to ``i * BLOCK + BLOCK - 1``) is one block of the pool, and a run
of consecutive blocks is one strided batch a product reads without a copy. A
:class:`Sequence` owns a table of blocks, in position order; it writes only blocks it holds
alone, and only from its committed length on.

The pool is also the prefix cache. A block whose every row is committed is *sealed*: entered
in a trie under the block before it, keyed by its tokens (exact keys, no hashes: a block is
found only after exactly the tokens it was computed after), and never written again. A new
sequence whose prompt starts with sealed blocks holds them by reference instead of computing
them (one team's system prompt and tool docs are stored once, however many agents read them);
the rows of a last, partly matching block are copied into a block of its own (or, a finished
sequence's unshared tail, taken over whole). A block's holders are counted; a block nobody
holds stays cached, and the least recently used go first once the cached ones exceed the
budget or a sequence needs room, a block's descendants with it.

Exact: a KV row is a function of the model and the token ids up to its own, the same bits
whatever forward computed it (``tests/integration/test_invariance.py``); sharing a block reads
those bits in place, and a copy moves them unchanged (``tests/integration/test_prefix_cache.py``).

Not thread-safe: an engine's steps (and so every call here) run one at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from agentspec.engine.trie import PrefixTrie

BLOCK = 256
"""Positions per block: the engine's attention reduces keys in blocks of this size (their
order fixed by the position), and the fused forward's attention splits are as long."""

DEFAULT_CACHE_BYTES = 512 * 2**20
"""The default budget of blocks kept after their sequences ended (SmolLM2-135M in float32:
~46 KB of KV per token, so ~11,000 tokens: a dozen agents' tool docs)."""


def index(buf: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[Any, ...]:
    """The index of positions ``offsets`` of pool blocks ``blocks`` in ``buf`` (a layer's keys
    or values, either layout, :meth:`KVPool.define_layers`): ``buf[index]`` is
    ``[len(blocks), kv_heads, head_dim]``."""
    if buf.dim() == 5:  # transposed runs of keys: [blocks, heads, BLOCK // lanes, dim, lanes]
        lanes = buf.shape[-1]
        return (blocks, slice(None), offsets // lanes, slice(None), offsets % lanes)
    return (blocks, slice(None), offsets)


@dataclass
class PoolStats:
    """Counters since the pool was made: prompts that found rows here beyond those their
    sequence held, and those rows; the blocks sealed and evicted; what the pool holds now."""

    hits: int = 0
    reused_tokens: int = 0
    sealed_blocks: int = 0
    evicted_blocks: int = 0
    blocks: int = 0
    cached_blocks: int = 0
    cached_bytes: int = 0


class KVPool:
    """Key and value buffers in blocks, their holders, and the trie of sealed blocks.

    Args:
        device: where the buffers live.
        cache_bytes: the budget of cached blocks (held by no sequence); 0 keeps none.
    """

    def __init__(self, device: torch.device | str, *, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if not isinstance(cache_bytes, int) or isinstance(cache_bytes, bool) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
        self.device = torch.device(device)
        self.cache_bytes = cache_bytes
        self.keys: list[torch.Tensor] = []  # per layer [blocks, kv_heads, BLOCK, head_dim]
        self.values: list[torch.Tensor] = []
        self.generation = 0  # bumped when the buffers move (grown): captured graphs are stale
        self._shapes: list[tuple[int, int, torch.dtype]] = []  # per layer (kv_heads, dim, dtype)
        self.key_lanes = 0  # 0: keys as rows; else positions a transposed run of keys holds
        self._refs: list[int] = []
        self._free: set[int] = set()
        self.trie = PrefixTrie(BLOCK)  # the sealed blocks (engine.trie)
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached (sealed, unheld), oldest first
        self._stats = PoolStats()

    # -- buffers ------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    def define_layers(self, shapes: Seq[tuple[int, int, torch.dtype]], *,
                      key_lanes: int = 0) -> None:
        """The layers' ``(kv_heads, head_dim, dtype)``, once (before the first write).

        ``key_lanes`` 0 keeps each position's keys as a row; 16 (the native forward's
        attention) keeps each run of 16 positions of a block transposed, ``[head_dim, 16]``:
        one key dimension of 16 consecutive keys is one vector, read as it lies. Values are
        rows either way. :func:`index` addresses a position in either layout."""
        if key_lanes not in (0, 16):
            raise ValueError(f"key_lanes must be 0 or 16, got {key_lanes!r}")
        if self._shapes:
            if list(shapes) != self._shapes or key_lanes != self.key_lanes:
                raise ValueError(f"the pool's layers are {self._shapes} (key_lanes "
                                 f"{self.key_lanes}), not {list(shapes)} (key_lanes {key_lanes})")
            return
        self._shapes = list(shapes)
        self.key_lanes = key_lanes
        self._allocate(self.num_blocks)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer's keys and values."""
        return sum(2 * h * d * BLOCK * torch.empty((), dtype=t).element_size()
                   for h, d, t in self._shapes)

    def _allocate(self, blocks: int) -> None:
        """Buffers of ``blocks`` blocks holding the old ones' rows (zeros elsewhere: stale rows
        are always finite)."""
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for i, (heads, dim, dtype) in enumerate(self._shapes):
            for old, new in ((self.keys, keys), (self.values, values)):
                shape = ((blocks, heads, BLOCK // self.key_lanes, dim, self.key_lanes)
                         if self.key_lanes and new is keys else (blocks, heads, BLOCK, dim))
                buf = torch.zeros(shape, dtype=dtype, device=self.device)
                if i < len(old) and old[i].shape[0]:
                    buf[: old[i].shape[0]].copy_(old[i])
                new.append(buf)
        self.keys, self.values = keys, values
        self.generation += 1

    def _grow(self, needed: int) -> None:
        old = self.num_blocks
        new = max(old + needed, old + old // 2, 8)
        self._refs.extend([0] * (new - old))
        self._free.update(range(old, new))
        if self._shapes:
            self._allocate(new)

    # -- holders ------------------------------------------------------------------------------

    def allocate(self, after: int | None = None) -> int:
        """A block for one holder: the one right after ``after`` when free (a sequence's blocks
        stay one run), else the lowest free one; with none free, the least recently used
        cached one where the cache fills its budget, else a block of a grown pool (the cache
        keeps up to ``cache_bytes`` whatever the sequences hold)."""
        if not self._free:
            self._trim(room=1)
            if not self._free:
                self._grow(1)
        block = after + 1 if after is not None and after + 1 in self._free else min(self._free)
        self._free.discard(block)
        self._refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        self._refs[block] += 1
        self._lru.pop(block, None)

    def drop(self, block: int) -> None:
        """One holder less; an unheld block stays cached if sealed, else is free."""
        self._refs[block] -= 1
        assert self._refs[block] >= 0, f"block {block} dropped more often than held"
        if self._refs[block]:
            return
        if self.trie.sealed(block):
            self._lru[block] = None
            self._lru.move_to_end(block)
            self._trim()
        else:
            self._free.add(block)

    def holders(self, block: int) -> int:
        return self._refs[block]

    # -- the trie -----------------------------------------------------------------------------

    def seal(self, block: int, parent: int | None, tokens: Seq[int]) -> bool:
        """Enter a fully committed block under ``parent`` (None: a sequence's first block);
        False where the parent is not in the trie or the key is taken (the block stays its
        holder's, unfound)."""
        assert len(tokens) == BLOCK
        return self.trie.enter(block, parent, tuple(tokens))

    def unseal(self, block: int) -> None:
        """Take a block out of the trie (its holder writes it again), its descendants with it;
        those cached and unheld are free again (nothing can find them any more)."""
        for b in self.trie.remove(block):
            if b in self._lru:
                del self._lru[b]
                self._free.add(b)
                self._stats.evicted_blocks += 1

    def cache_tail(self, block: int, parent: int | None, tokens: Seq[int]) -> bool:
        """Keep a finished sequence's last, partly filled block findable by its ``tokens``
        (fewer than :data:`BLOCK`): a later prompt that starts with them takes it over."""
        return 0 < len(tokens) < BLOCK and self.trie.enter(block, parent, tuple(tokens))

    def match(self, ids: Seq[int]) -> tuple[list[int], int, int]:
        """The longest cached prefix of ``ids``: ``(full blocks, tail block, tail rows)``,
        where the tail block (-1 for none) holds ``tail rows`` more positions of ``ids``."""
        chain, best, rows = self.trie.match(ids)
        for block in reversed(chain):  # deepest first: a prefix ends more recent than its extensions
            if block in self._lru:
                self._lru.move_to_end(block)
        return chain, best, rows

    def take_tail(self, block: int, rows: int) -> bool:
        """Take over a cached, unheld, partly filled block (a finished sequence's tail: nothing
        else can read it) whose every row the new holder keeps (``rows``: an agent's next turn
        extends its last one), to write it again; False where it is not one (the caller
        copies the rows it keeps, and the tail stays cached for its own next turn)."""
        if self._refs[block] or not self.trie.take_tail(block, rows):
            return False
        self._lru.pop(block, None)
        self._refs[block] = 1
        return True

    def counted_hit(self, tokens: int) -> None:
        """A prompt found ``tokens`` rows here beyond those its sequence held."""
        self._stats.hits += tokens > 0
        self._stats.reused_tokens += tokens

    def _trim(self, room: int = 0) -> None:
        """Evict the least recently used cached blocks past the budget (``cache_bytes``), and
        ``room`` more for a block about to be allocated."""
        budget = self.cache_bytes // max(self.block_bytes, 1) if self._shapes else len(self._lru)
        while self._lru and len(self._lru) > budget - room:
            self.unseal(next(iter(self._lru)))

    def clear_cache(self) -> None:
        """Forget every sealed block (held ones stay their holders', unfound)."""
        for block in self.trie.blocks():
            self.unseal(block)

    @property
    def stats(self) -> PoolStats:
        s = self._stats
        bytes_each = self.block_bytes if self._shapes else 0
        return PoolStats(s.hits, s.reused_tokens, self.trie.sealed_blocks, s.evicted_blocks,
                         self.num_blocks, len(self._lru), len(self._lru) * bytes_each)

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """Copy the first ``rows`` positions of block ``src`` into block ``dst``."""
        at = torch.arange(rows, device=self.device)
        s, d = torch.full_like(at, src), torch.full_like(at, dst)
        with torch.inference_mode():
            for buf in (*self.keys, *self.values):
                buf[index(buf, d, at)] = buf[index(buf, s, at)]

