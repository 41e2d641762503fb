"""One sequence's KV in the pool: its blocks, in position order, and its committed tokens.

The decode loop's invariant holds per sequence: between steps its KV holds every committed
token but the last one. A forward writes a sequence's rows at positions ``kv_len + row``
(:meth:`Sequence.reserve` first makes sure it holds blocks there, of its own); a commit moves
the committed length; rolling back is moving it back. Blocks whose rows are all committed are
sealed into the pool's trie as they fill (:mod:`agentspec.engine.pool`), so a sequence that
starts with the same tokens, in this call or a later one, reads them instead of computing
them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from agentspec.engine.pool import BLOCK, KVPool
from agentspec.engine.pool import index as pool_index
from agentspec.tree import common_prefix_len
from agentspec.types import Verdict


class Sequence:
    """The blocks and committed tokens of one sequence in ``pool``.

    Args:
        pool: the pool its blocks come from.
        cached: seal its full blocks and keep its tail cached when it ends (False: a scratch
            sequence, the width probe's or the cost measurement's, whose rows no later prompt
            should find).

    Attributes:
        ids: the token ids whose rows the KV holds, in order (``kv_len`` of them).
        reused_tokens: rows the last :meth:`start` did not compute (held or found cached).
    """

    def __init__(self, pool: KVPool, *, cached: bool = True) -> None:
        self.pool = pool
        self.cached = cached
        self.table: list[int] = []  # pool block of each of the sequence's blocks
        self.ids: list[int] = []
        self.reused_tokens = 0

    @property
    def kv_len(self) -> int:
        return len(self.ids)

    # -- a new generation ---------------------------------------------------------------------

    def start(self, wanted: Seq[int], *, reuse: bool = True) -> int:
        """Hold the rows of the longest prefix of ``wanted`` that is held already or cached;
        the rest is the caller's to prefill. Returns the rows held.

        ``reuse=False`` holds nothing (every row is computed again)."""
        wanted = list(wanted)
        keep = common_prefix_len(self.ids, wanted) if reuse else 0
        chain, tail, rows = self.pool.match(wanted) if reuse and self.cached else ([], -1, 0)
        found = len(chain) * BLOCK + rows
        if found > keep:
            table = list(chain)
            for block in chain:  # held before the old table is dropped: nothing evicts them
                self.pool.hold(block)
            if rows:
                if self.pool.take_tail(tail, rows):
                    table.append(tail)
                else:  # others read it, or it is sealed: a copy of the rows that match
                    self.pool.hold(tail)  # not evicted for the block it is copied into
                    own = self.pool.allocate(after=table[-1] if table else None)
                    self.pool.copy_rows(tail, own, rows)
                    self.pool.drop(tail)
                    table.append(own)
            self._cache_tail()
            self._drop_table()
            self.table, self.ids = table, wanted[:found]
            self.pool.counted_hit(found - keep)
            keep = found
        else:
            self.truncate(keep)
        self.reused_tokens = keep
        return keep

    def release(self) -> None:
        """End the sequence: its blocks go back to the pool (sealed ones stay cached, and so
        does its last, partly filled block, under the tokens it holds)."""
        self._cache_tail()
        self._drop_table()
        self.table, self.ids = [], []

    def _cache_tail(self) -> None:
        """Keep the partly filled last block findable under the tokens it holds, for a later
        prompt that extends them (it is about to be dropped)."""
        n = self.kv_len
        last = n // BLOCK
        if self.cached and n % BLOCK and last < len(self.table):
            parent = self.table[last - 1] if last else None
            self.pool.cache_tail(self.table[last], parent, self.ids[last * BLOCK :])

    def _drop_table(self) -> None:
        # Deepest first: a prefix ends more recent than its extensions in the pool's LRU, so
        # an eviction takes the extensions before the prefix other prompts start with.
        for block in reversed(self.table):
            self.pool.drop(block)

    # -- steps --------------------------------------------------------------------------------

    def reserve(self, slots: int) -> None:
        """Hold blocks of its own for positions up to ``slots`` (a forward's rows go there)."""
        need = -(-slots // BLOCK)
        while len(self.table) < need:
            self.table.append(self.pool.allocate(after=self.table[-1] if self.table else None))

    def commit(self, root: int, verdict: Verdict) -> None:
        """Keep a step's verdict: the root (the token its forward scored first, at position
        ``kv_len``) and the accepted path, whose rows the forward wrote; every other row of
        that forward is dropped. A path along the spine is already in place; another path's
        rows are gathered into place on the device (no host sync). Blocks the committed rows
        fill are sealed. The one place a sequence's committed length grows."""
        start = self.kv_len + 1  # the root's row
        path = list(verdict.path)
        if path != list(range(len(path))):
            self.move_rows([start + i for i in path], list(range(start, start + len(path))))
        before = self.kv_len
        self.ids.extend([root, *verdict.accepted])
        for i in range(before // BLOCK, self.kv_len // BLOCK if self.cached else 0):
            parent = self.table[i - 1] if i else None
            if not self.pool.trie.sealed(self.table[i]):
                self.pool.seal(self.table[i], parent, self.ids[i * BLOCK : (i + 1) * BLOCK])

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` committed rows. The rows dropped stay findable (the full blocks
        sealed already, the last partly filled one cached as a tail), and the block the next
        row goes to becomes the sequence's own to write: a sealed one is copied, so the prefix
        it caches stays intact for the prompts that come back to it."""
        if not 0 <= n <= self.kv_len:
            raise ValueError(f"truncate needs 0 <= n <= {self.kv_len}, got {n}")
        keep = -(-n // BLOCK)
        if keep <= self.kv_len // BLOCK:  # the last block is dropped: its rows stay findable
            self._cache_tail()
        del self.ids[n:]
        for block in reversed(self.table[keep:]):
            self.pool.drop(block)
        del self.table[keep:]
        if n % BLOCK:
            block = self.table[-1]
            if self.pool.holders(block) > 1 or self.pool.trie.sealed(block):
                own = self.pool.allocate(after=self.table[-2] if len(self.table) > 1 else None)
                self.pool.copy_rows(block, own, n % BLOCK)
                self.pool.drop(block)
                self.table[-1] = own

    def runs(self, blocks: int) -> list[tuple[int, int, int]]:
        """The first ``blocks`` blocks as runs of consecutive pool blocks:
        ``(pool block, count, sequence block)``."""
        out: list[tuple[int, int, int]] = []
        for i, block in enumerate(self.table[:blocks]):
            if out and out[-1][0] + out[-1][1] == block:
                start, count, at = out[-1]
                out[-1] = (start, count + 1, at)
            else:
                out.append((block, 1, i))
        return out

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Pool slots (``block * BLOCK + offset``) of ``positions`` (int64, on the host)."""
        table = torch.tensor(self.table, dtype=torch.long)
        return table[positions // BLOCK] * BLOCK + positions % BLOCK

    def read(self, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of its first ``count`` positions in ``layer``:
        ``[kv_heads, count, head_dim]`` each (what tests compare bitwise)."""
        at = self.slots(torch.arange(count))
        blocks, offsets = (at // BLOCK).to(self.pool.device), (at % BLOCK).to(self.pool.device)
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        return (keys[pool_index(keys, blocks, offsets)].transpose(0, 1).clone(),
                values[pool_index(values, blocks, offsets)].transpose(0, 1).clone())

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy the rows at positions ``src`` to positions ``dst`` (a tree's accepted path
        gathered into place), every layer; all in blocks of the sequence's own."""
        s = self.slots(torch.tensor(src))
        d = self.slots(torch.tensor(dst))
        device = self.pool.device
        sb, so = (s // BLOCK).to(device), (s % BLOCK).to(device)
        db, do = (d // BLOCK).to(device), (d % BLOCK).to(device)
        with torch.inference_mode():
            for buf in (*self.pool.keys, *self.pool.values):
                buf[pool_index(buf, db, do)] = buf[pool_index(buf, sb, so)]
