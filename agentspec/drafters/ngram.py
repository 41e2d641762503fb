"""An incremental n-gram index over one growing token sequence (the matcher behind prompt lookup).

For every n in ``[n_min, n_max]`` it maps each n-gram to the position right after its most
recent occurrence. Queries look up the sequence's own suffix, so an n-gram is indexed only once
a later token exists: the suffix never matches itself, and every hit has a continuation.
Work per appended token is O(n_max); a query is O(n_max) dict probes.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Most-recent-occurrence n-gram index over ``tokens`` (which may grow between calls)."""

    def __init__(self, n_min: int = 2, n_max: int = 4) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._table: dict[tuple[int, ...], int] = {}
        self._indexed_end = 0  # n-grams ending before this position are in the table

    def _index_until(self, tokens: Sequence[int], end: int) -> None:
        """Index the n-grams ``tokens[stop - n : stop]`` for every ``stop`` up to ``end`` (the
        continuation starts at ``stop``), one length at a time: the n-grams of one length are
        built and stored by C loops (``zip`` of shifted slices, ``dict.update`` keeping the
        last, most recent stop of each), not a Python loop per n-gram: what is left is mostly
        hashing the keys. N-grams of different lengths never share a key, so the order of the
        lengths is free."""
        start = max(self._indexed_end, self.n_min)
        table = self._table
        for n in range(self.n_min, self.n_max + 1):
            first = max(start, n)  # the first stop with n tokens before it
            if first > end:
                continue
            shifted = [tokens[first - n + i : end - n + i + 1] for i in range(n)]
            table.update(zip(zip(*shifted, strict=True), range(first, end + 1), strict=True))
        self._indexed_end = max(self._indexed_end, end + 1)

    def match(self, tokens: Sequence[int], query: Sequence[int] | None = None) -> tuple[int, int]:
        """Longest suffix match of ``query`` (default: ``tokens``' own suffix) in ``tokens``.

        Returns:
            ``(n, start)``: the match length and where the continuation starts in ``tokens``;
            ``(0, -1)`` when no n-gram of length >= n_min matches.
        """
        own = query is None
        q = tokens if query is None else query
        # Index every n-gram that has a continuation (ends before len(tokens)); for the
        # sequence's own suffix this leaves the suffix itself out.
        self._index_until(tokens, len(tokens) - 1)
        for n in range(min(self.n_max, len(q)), self.n_min - 1, -1):
            start = self._table.get(tuple(q[len(q) - n :]))
            if start is not None and (not own or start < len(tokens)):
                return n, start
        return 0, -1


def continuation(tokens: Sequence[int], start: int, max_tokens: int) -> list[int]:
    """Up to ``max_tokens`` tokens of ``tokens`` from ``start``."""
    return list(tokens[start : start + max_tokens])
