"""A request's grammar matcher walked through one step's rows, and the masks of those rows
computed on demand.

:class:`Walk`: the matcher from the committed state, a token at a time, rolled back when its
``with`` block ends; :meth:`GrammarState.constrain <agentspec.grammar.state.GrammarState.constrain>`
walks a step's draft with one, and :class:`LazyMasks` walks the same tokens again for the rows
whose mask greedy verification turns out to need. Both read the state through its public
methods only (``version``, ``closed``, ``walk``, ``allows``, ``row_allows``, ``row_mask``,
``fill_row``, ``check``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from agentspec.grammar.spec import GrammarError
from agentspec.grammar.tokenizer import trie_child

if TYPE_CHECKING:
    from agentspec.grammar.state import GrammarState


class Walk:
    """The matcher walking a step's rows from the committed state, a token at a time: at row
    ``r`` it is in the state after the walk's first ``r`` :attr:`tokens`, whose trie node is
    :attr:`node`. Made by :meth:`GrammarState.walk`, used as a context manager: on leaving,
    the matcher rolls back over every token the walk consumed (and is checked, unless an
    error is already on its way).

    With ``fill`` (:meth:`GrammarState.constrain`'s eager masks) each row's mask is filled
    into the state's packed rows as the walk reaches it, and a token is checked against it;
    without, a token is checked alone (:meth:`GrammarState.allows`) and a row's mask is
    computed only when asked for (:meth:`mask`)."""

    def __init__(self, state: GrammarState, node: list[Any] | None, *, fill: bool) -> None:
        self.state, self.node, self.fill = state, node, fill
        self.tokens: list[int] = []
        if fill:
            state.fill_row(0, node)

    def __enter__(self) -> Walk:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.state.matcher.rollback(len(self.tokens))
        if kind is None:
            self.state.check()

    @property
    def row(self) -> int:
        """The row whose state the matcher is in (the tokens the walk consumed)."""
        return len(self.tokens)

    def allows(self, token: int) -> bool:
        """Whether this row's state allows ``token``."""
        if self.fill:
            return self.state.row_allows(self.row, token)
        return self.state.allows(token, self.node, self.row == 0)

    def consume(self, token: int, *, last: bool = False) -> bool:
        """Walk on by ``token`` where the matcher takes it (False where it refuses, the walk
        where it was), filling the next row's mask with ``fill``. ``last``: nothing asks the
        new row's state about a token (only its mask is filled), so a walk without ``fill``
        leaves the trie as it is."""
        if not self.state.matcher.consume_token(token):
            return False
        self.tokens.append(token)
        if self.fill or not last:
            self.node = trie_child(self.node, token)
        if self.fill:
            self.state.fill_row(self.row, self.node)
        return True

    def follow(self, token: int) -> None:
        """Walk on by ``token``, one the step's rows were walked through already (a step's
        :class:`LazyMasks`): the matcher refusing it is its failure, raised."""
        if not self.consume(token):
            self.state.check()
            raise GrammarError(f"the {self.state.grammar.kind} grammar refused a token its "
                               "step was walked through")

    def mask(self) -> torch.Tensor:
        """This row's mask, computed now (:meth:`GrammarState.row_mask`)."""
        return self.state.row_mask(self.node, self.row == 0)


class LazyMasks:
    """The grammar's masks of one step's rows, computed only where greedy verification needs
    one (:func:`agentspec.decoding.sampling.greedy_tokens`).

    A row's masked argmax is its unmasked argmax wherever the grammar allows that token (the
    first maximum overall is the first maximum among any set that contains it), so a row
    needs its mask only when its argmax is a token the grammar forbids. The draft's own tokens
    were checked by :meth:`GrammarState.constrain`, so a row whose argmax is the next walked
    token needs nothing; any other row's argmax is checked at the row's state (a cached
    mask's bit or llguidance's check of that token), and its mask computed only if that
    fails. Valid until the grammar state moves on (the step's ``advance``).

    Reads the state through :attr:`GrammarState.version`, :attr:`GrammarState.closed` and a
    :meth:`GrammarState.walk` over :attr:`walk`'s tokens.

    Args:
        state: the request's grammar state, at the step's committed tokens.
        walk: the tokens the matcher walked for the step's rows: row ``r + 1`` is the state
            after ``walk[:r + 1]``; rows past ``len(walk)`` allow everything.
        num_rows: rows scored (``num_nodes + 1``).
    """

    def __init__(self, state: GrammarState, walk: Sequence[int], num_rows: int) -> None:
        self.state, self.walk, self.num_rows = state, list(walk), num_rows
        self.rows = 1 + len(self.walk)  # rows with a mask of their own
        self.version = state.version

    def _current(self) -> None:
        if self.state.version != self.version or self.state.closed:
            raise GrammarError("these masks belong to a step the grammar state has moved past")

    def forbidding(self, tokens: Sequence[int]) -> dict[int, torch.Tensor]:
        """``{row: bool [vocab_size] mask on the device}`` for each row whose token in
        ``tokens`` (one per row, at least :attr:`rows`) the grammar forbids there."""
        self._current()
        check = [r for r in range(min(self.rows, len(tokens)))
                 if not (r < len(self.walk) and tokens[r] == self.walk[r])]
        out: dict[int, torch.Tensor] = {}
        with self.state.walk() as cursor:
            for r in check:
                while cursor.row < r:
                    cursor.follow(self.walk[cursor.row])
                if not cursor.allows(int(tokens[r])):
                    out[r] = cursor.mask()
        return out

    def full(self) -> torch.Tensor:
        """Every row's mask: bool ``[num_rows, vocab_size]`` on the device (what
        ``constrain`` returns without ``lazy``)."""
        self._current()
        st = self.state
        out = torch.ones((self.num_rows, st.vocab_size), dtype=torch.bool, device=st.device)
        with st.walk() as cursor:
            for r in range(self.rows):
                out[r] = cursor.mask()
                if r < len(self.walk):
                    cursor.follow(self.walk[r])
        return out
