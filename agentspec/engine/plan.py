"""The layout of one forward over the pool: whose rows sit where, and what each row sees.

A forward's rows come from several sequences (:class:`Member`: a sequence's rows, their depths
below its committed length and which of them each one sees). Its linear layers take all of
them at once, padded with junk rows to a width of the engine's one reduction class. Attention
is computed per :class:`Group` of members: each member's rows padded (for attention only) to
the group's query width ``wq``, over the member's own key blocks, padded to the group's
``blocks``. A padded query repeats the member's first row; a padded key block is masked for
every row and adds exact zeros; so a row's attention depends on neither its group, nor its
place in it, nor its neighbours (``tests/integration/test_batching.py``).

Masks are laid out on the host once per forward (every layer reads the same ones): row ``r``
of a member with ``kv_len`` committed rows sees position ``p`` when ``p < kv_len``, or when
``p = kv_len + c`` with ``anc[r, c]`` (a row of this forward); sliding-window layers also hide
keys more than ``window - 1`` positions behind the row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from agentspec.engine.pool import BLOCK
from agentspec.engine.sequence import Sequence
from agentspec.tree import ancestor_matrix, depths
from agentspec.types import Draft, Verdict

QUERY_BUCKETS = (8, 24, 64)
"""Members whose padded rows fall in one bucket (up to 8, 24, 64, more) share an attention
group: padding a 2-row step to a 48-row draft's width would multiply its attention work."""


@dataclass
class Member:
    """One sequence's rows in a forward.

    Attributes:
        seq: the sequence (its rows are written at positions ``kv_len + depth``).
        ids: the rows' token ids.
        depth: each row's depth below the first (position = ``kv_len + depth``).
        anc: ``anc[r, c]``: row ``r`` sees row ``c`` of this member (itself included).
        logits: whether the rows' logits are wanted (a prompt chunk's are not).
    """

    seq: Sequence
    ids: list[int]
    depth: list[int]
    anc: np.ndarray
    logits: bool = True
    row0: int = 0  # set by the layout: where the member's rows start in the forward
    kv_len: int = 0


def causal(n: int) -> np.ndarray:
    """The ancestor matrix of a chain of ``n`` rows: each row sees itself and those before."""
    return np.tril(np.ones((n, n), dtype=bool))


def draft_member(seq: Sequence, last_token: int, draft: Draft) -> Member:
    """The rows a step scores for ``seq``: its last committed token (the root) and the draft's
    nodes, each seeing the root and its ancestors."""
    n = draft.num_nodes
    anc = np.zeros((n + 1, n + 1), dtype=bool)
    anc[:, 0] = True
    anc[1:, 1:] = ancestor_matrix(draft.parents)
    return Member(seq, [last_token, *draft.token_ids], [0, *depths(draft.parents)], anc)


class Prefill:
    """A prompt's rows still to compute into one sequence, a chunk at a time: the engine's one
    prefill loop (:meth:`HFTarget.prefill <agentspec.engine.target.HFTarget.prefill>` runs it
    to the end; the scheduler hands its chunks the rows a batched step has left).

    Each chunk is a chain of the next prompt tokens (its logits unwanted); once its forward
    ran, :meth:`written` commits it, so the sequence's committed length moves only through
    :meth:`Sequence.commit <agentspec.engine.sequence.Sequence.commit>`.
    """

    def __init__(self, seq: Sequence, pending: list[int]) -> None:
        self.seq = seq
        self.pending = pending  # the tokens whose rows are still to compute, in order

    @property
    def done(self) -> bool:
        return not self.pending

    def chunk(self, rows: int) -> Member:
        """The next at most ``rows`` tokens (at least one) as a member of a forward."""
        part = self.pending[: max(rows, 1)]
        return Member(self.seq, part, list(range(len(part))), causal(len(part)), logits=False)

    def written(self, member: Member) -> None:
        """``member``'s forward ran: its rows are committed, the rest stays pending."""
        if member.seq is not self.seq or member.ids != self.pending[: len(member.ids)]:
            raise ValueError("written() takes the chunk this prefill handed out last")
        root, *rest = member.ids
        self.seq.commit(root, Verdict.chain(rest))
        del self.pending[: len(member.ids)]


@dataclass
class Group:
    """Members attended together: queries padded to ``wq`` rows, keys to ``blocks`` blocks."""

    wq: int
    blocks: int
    members: list[Member]
    runs: list[list[tuple[int, int, int]]] = field(default_factory=list)
    q_index: torch.Tensor | None = None  # [members * wq] forward rows
    out_index: torch.Tensor | None = None  # [real rows] into the group's [members * wq]
    out_rows: torch.Tensor | None = None  # [real rows] forward rows
    forbidden: torch.Tensor | None = None  # [members, blocks, 1, 1, wq, BLOCK], True = hidden
    forbidden_window: torch.Tensor | None = None
    lo: int = 0  # blocks below ``lo`` hide no key from any row (full layers)
    lo_window: int = 0
    short: torch.Tensor | None = None  # [members, blocks, 1, 1, 1] True: past the member's keys


@dataclass
class Layout:
    """One forward: ``width`` rows (members first, junk after), the write slots of the real
    rows, the rows whose logits are read (padded to a width), and the attention groups."""

    width: int
    ids: torch.Tensor  # [width]
    positions: torch.Tensor  # [width]
    write_rows: torch.Tensor  # [real rows]
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    logit_rows: torch.Tensor | None  # rows whose logits are computed; None: every row
    groups: list[Group]
    members: list[Member]


def class_width(n: int, widths: tuple[int, ...]) -> int:
    """The narrowest of ``widths`` (smallest first) that holds ``n`` rows."""
    for w in widths:
        if w >= n:
            return w
    raise ValueError(f"a forward of {n} rows is wider than the widest, {widths[-1]}")


def lay_out(members: list[Member], widths: tuple[int, ...], *, window: int | None,
            device: torch.device, width: int | None = None, wq: int | None = None) -> Layout:
    """The layout of a forward of ``members`` at a width of ``widths`` (every width of one
    reduction class; ``width`` and ``wq`` force the total and the query width, for the width
    probe)."""
    ids: list[int] = []
    pos: list[int] = []
    real = 0
    for m in members:
        m.row0, m.kv_len = real, m.seq.kv_len
        ids += m.ids
        pos += [m.kv_len + d for d in m.depth]
        real += len(m.ids)
    total = width or class_width(real, widths)
    if total < real:
        raise ValueError(f"{real} rows do not fit a forward of {total}")
    write_rows = torch.arange(real)
    # Row r of a member is written at position kv_len + r (a chain's rows sit at their own
    # positions; a tree's other branches at the next free ones, gathered into place if accepted).
    slots = torch.cat([m.seq.slots(torch.arange(m.kv_len, m.kv_len + len(m.ids)))
                       for m in members]) if members else torch.zeros(0, dtype=torch.long)
    ids += [ids[-1] if ids else 0] * (total - real)
    pos += [0] * (total - real)
    wanted = [m.row0 + r for m in members if m.logits for r in range(len(m.ids))]
    logit_rows = None
    if len(wanted) < total:  # padded to a width (a one-row product takes other kernels)
        keep = class_width(max(len(wanted), 1), widths)
        taken = set(wanted)
        filler = [r for r in range(total) if r not in taken][: keep - len(wanted)]
        logit_rows = torch.tensor(wanted + filler, device=device)
    return Layout(total, torch.tensor(ids, device=device), torch.tensor(pos, device=device),
                  write_rows.to(device), (slots // BLOCK).to(device), (slots % BLOCK).to(device),
                  logit_rows, _groups(members, widths, window, device, wq), members)


def _groups(members: list[Member], widths: tuple[int, ...], window: int | None,
            device: torch.device, wq: int | None) -> list[Group]:
    buckets: dict[int, list[Member]] = {}
    for m in members:
        w = wq or class_width(len(m.ids), widths)
        bucket = next((i for i, b in enumerate(QUERY_BUCKETS) if w <= b), len(QUERY_BUCKETS))
        buckets.setdefault(bucket, []).append(m)
    groups = []
    for _, group_members in sorted(buckets.items()):
        w = wq or max(class_width(len(m.ids), widths) for m in group_members)
        blocks = max(-(-(m.kv_len + len(m.ids)) // BLOCK) for m in group_members)
        groups.append(_group(group_members, w, blocks, window, device))
    return groups


def _group(members: list[Member], wq: int, blocks: int, window: int | None,
           device: torch.device) -> Group:
    g = Group(wq, blocks, members)
    q_index, out_index, out_rows = [], [], []
    hidden = np.ones((len(members), wq, blocks * BLOCK), dtype=bool)
    hidden_window = hidden.copy() if window is not None else None
    short = np.zeros((len(members), blocks), dtype=bool)
    for i, m in enumerate(members):
        n, kv = len(m.ids), m.kv_len
        own = -(-(kv + n) // BLOCK)
        g.runs.append(m.seq.runs(own))
        short[i, own:] = True
        q_index += [m.row0 + r for r in range(n)] + [m.row0] * (wq - n)
        out_index += [i * wq + r for r in range(n)]
        out_rows += [m.row0 + r for r in range(n)]
        rows = hidden[i]
        rows[:n, :kv] = False
        rows[:n, kv : kv + n] = ~m.anc.astype(bool)
        rows[n:] = rows[0]  # padded queries: the member's first row again
        if hidden_window is not None and window is not None:
            depth = np.asarray(m.depth)
            key_pos = np.arange(blocks * BLOCK)
            key_pos[kv : kv + n] = kv + depth  # a draft row's key sits at its depth's position
            row_pos = np.concatenate([kv + depth, np.full(wq - n, kv + depth[0])])
            near = key_pos[None, :] > row_pos[:, None] - window
            hidden_window[i] = rows | ~near
    g.q_index = torch.tensor(q_index, device=device)
    g.out_index = torch.tensor(out_index, device=device)
    g.out_rows = torch.tensor(out_rows, device=device)
    g.forbidden, g.lo = _blocked(hidden, blocks, wq, device)
    if hidden_window is not None:
        g.forbidden_window, g.lo_window = _blocked(hidden_window, blocks, wq, device)
    g.short = torch.from_numpy(short).view(len(members), blocks, 1, 1, 1).to(device) if short.any() else None
    return g


def _blocked(hidden: np.ndarray, blocks: int, wq: int,
             device: torch.device) -> tuple[torch.Tensor, int]:
    """``[members, wq, blocks * BLOCK]`` as the scores' layout ``[members, blocks, 1, 1, wq,
    BLOCK]``, and the first block that hides any key (earlier ones need no fill)."""
    per_block = hidden.reshape(hidden.shape[0], wq, blocks, BLOCK).transpose(0, 2, 1, 3)
    any_hidden = per_block.reshape(hidden.shape[0], blocks, -1).any(axis=(0, 2))
    lo = int(np.argmax(any_hidden)) if any_hidden.any() else blocks
    out = torch.from_numpy(np.ascontiguousarray(per_block)).view(hidden.shape[0], blocks, 1, 1, wq, BLOCK)
    return out.to(device), lo
