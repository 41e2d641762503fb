"""When the memory checks its token caps: the sums over a scope's rows run at most every
``check_interval_s``, and earlier when the memory's own writes could have used up the room the
last check left."""

from __future__ import annotations

import time


class CapsWatch:
    """When the memory must check its token caps (two sums over the store's rows).

    A check measures how much room the caps leave: below the scope's cap and below the
    store's. Until the next one the memory counts the tokens it writes itself, and checks again
    once they could fill that room, or once ``interval`` seconds have passed (for what other
    processes wrote). A memory alone on its store so evicts exactly when it would have checked
    after every write. Called under the memory's lock.
    """

    def __init__(self) -> None:
        self._room: dict[str, float] = {}  # per scope: tokens left below its cap at the check
        self._room_total = float("inf")
        self._written: dict[str, int] = {}  # per scope: tokens written since its check
        self._written_total = 0
        self._checked_at: dict[str, float] = {}

    def due(self, scope: str, tokens: int, interval: float) -> bool:
        """Count ``tokens`` just written to ``scope``; whether a check is due now."""
        self._written[scope] = self._written.get(scope, 0) + tokens
        self._written_total += tokens
        return (scope not in self._checked_at
                or time.monotonic() - self._checked_at[scope] >= interval
                or self._written[scope] > self._room[scope]
                or self._written_total > self._room_total)

    def checked(self, scope: str, scope_cap: int | None, total_cap: int | None,
                scope_tokens: int, total_tokens: int) -> None:
        """A check (eviction included) left ``scope_tokens`` in ``scope``, ``total_tokens`` in all."""
        inf = float("inf")
        self._room[scope] = inf if scope_cap is None else scope_cap - scope_tokens
        self._room_total = inf if total_cap is None else total_cap - total_tokens
        self._written[scope] = 0
        self._written_total = 0
        self._checked_at[scope] = time.monotonic()
