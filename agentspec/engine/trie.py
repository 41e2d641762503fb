"""The prefix cache's index: sealed blocks in a trie, each under the block before it, keyed
by its tokens.

Exact keys, no hashes: a block is found only after exactly the tokens it was computed after.
A full block is keyed by its :data:`~agentspec.engine.pool.BLOCK` tokens; a finished
sequence's last, partly filled block by the tokens it holds (a later prompt that extends
them takes it over). The trie knows keys and parents only; who holds a block, and which
unheld ones stay cached, is the pool's (:mod:`agentspec.engine.pool`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

ROOT = -1  # the parent of a sequence's first block


class PrefixTrie:
    """Sealed blocks by parent and tokens."""

    def __init__(self, block: int) -> None:
        self.block = block  # positions per block
        self.sealed_blocks = 0  # entered since made
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (parent, tokens)
        self._children: dict[int, dict[tuple[int, ...], int]] = {}

    def enter(self, block: int, parent: int | None, key: tuple[int, ...]) -> bool:
        """Enter ``block`` under ``parent`` (None: a sequence's first block); False where the
        parent is not in the trie, the block is in already, or the key is taken."""
        up = ROOT if parent is None else parent
        if block in self._key or (up != ROOT and up not in self._key):
            return False
        siblings = self._children.setdefault(up, {})
        if key in siblings:
            return False
        siblings[key] = block
        self._key[block] = (up, key)
        self.sealed_blocks += 1
        return True

    def remove(self, block: int) -> list[int]:
        """Take ``block`` out, its descendants with it (nothing can find them any more); the
        blocks taken out."""
        gone: list[int] = []
        todo = [block]
        while todo:
            b = todo.pop()
            entry = self._key.pop(b, None)
            if entry is None:
                continue
            self._children.get(entry[0], {}).pop(entry[1], None)
            todo.extend(self._children.pop(b, {}).values())
            gone.append(b)
        return gone

    def sealed(self, block: int) -> bool:
        return block in self._key

    def blocks(self) -> list[int]:
        return list(self._key)

    def match(self, ids: Seq[int]) -> tuple[list[int], int, int]:
        """The longest entered prefix of ``ids``: ``(full blocks, tail block, tail rows)``,
        where the tail block (-1 for none) holds ``tail rows`` more positions of ``ids``."""
        size = self.block
        chain: list[int] = []
        parent = ROOT
        for start in range(0, len(ids) - size + 1, size):
            block = self._children.get(parent, {}).get(tuple(ids[start : start + size]))
            if block is None:
                break
            chain.append(block)
            parent = block
        rest = ids[len(chain) * size : len(chain) * size + size]
        best, rows = -1, 0
        for key, block in self._children.get(parent, {}).items():
            n = _common(key, rest)
            if n > rows:
                best, rows = block, n
        return chain, best, rows

    def take_tail(self, block: int, rows: int) -> bool:
        """Take out a partly filled block whose every entered token the taker keeps (``rows``
        of them); False where it is not one (a full block, or more tokens than kept)."""
        entry = self._key.get(block)
        if entry is None or len(entry[1]) >= self.block or rows < len(entry[1]):
            return False
        del self._children[entry[0]][entry[1]]
        del self._key[block]
        return True


def _common(a: Seq[int], b: Seq[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
