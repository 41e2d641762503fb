"""The fused forward's runs: one forward's rows laid out in whole row tiles, staged in one
copy, and computed by the fused kernels (:mod:`agentspec.engine.fused.llama`), replayed as a
CUDA graph per shape.

:class:`~agentspec.engine.forward.Forward` hands its members here when it runs the fused
forward; the modules' path lays rows out with :mod:`agentspec.engine.plan` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from agentspec.engine.kernels import capture_graph
from agentspec.engine.plan import Member, class_width
from agentspec.engine.pool import BLOCK as SPLIT_BLOCK
from agentspec.engine.pool import KVPool
from agentspec.engine.torch_thread import for_device

if TYPE_CHECKING:
    from agentspec.engine.fused.llama import FusedLlama


def tile_rows(n: int) -> int:
    """Rows ``n`` rows of one sequence take in a fused forward: whole row tiles."""
    from agentspec.engine.fused import kernels

    return -(-n // kernels.BLOCK_M) * kernels.BLOCK_M


class FusedRunner:
    """The fused forward of one model over ``pool``: :meth:`run` lays members' rows out and
    computes them; each shape's staging, scratch and graph are kept for the next forward."""

    def __init__(self, fused: FusedLlama, pool: KVPool, device: torch.device, *,
                 cuda_graphs: bool) -> None:
        self.fused, self.pool, self.device, self.cuda_graphs = fused, pool, device, cuda_graphs
        self._runs: dict[tuple[int, int, bool, int], _FusedRun] = {}

    def run(self, members: list[Member], widths: tuple[int, ...],
            width: int | None) -> list[torch.Tensor | None]:
        """Each member's rows padded to whole row tiles (padding rows see only themselves and
        are written past the committed length), members that want logits first, junk tiles
        after; one staging copy; each member's logits (None where it wants none)."""
        from agentspec.engine.fused import kernels

        tile = kernels.BLOCK_M
        order = sorted(range(len(members)), key=lambda i: not members[i].logits)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        tiles: list[tuple[int, int, int, list[int]]] = []
        starts: dict[int, int] = {}
        anc_parts: list[tuple[int, np.ndarray]] = []
        logit_rows = 0
        for i in order:
            m = members[i]
            n, kv = len(m.ids), m.seq.kv_len
            padded = -(-n // tile) * tile
            m.seq.reserve(kv + padded)
            depth = [*m.depth, *range(n, padded)]
            row0 = len(ids)
            starts[i] = row0
            ids += [*m.ids, *[m.ids[-1]] * (padded - n)]
            pos += [kv + d for d in depth]
            slots += m.seq.slots(torch.tensor([kv + r for r in range(padded)])).tolist()
            anc = np.eye(padded, dtype=bool)
            anc[:n, :n] = m.anc
            anc_parts.append((row0, anc))
            tiles += [(kv, row0, padded, m.seq.table)] * (padded // tile)
            if m.logits:
                logit_rows = row0 + padded
        total = width or class_width(max(len(ids), 1), widths)
        junk = total - len(ids)
        ids += [0] * junk
        pos += [0] * junk
        slots += [-1] * junk
        tiles += [(0, 0, 0, [])] * (junk // tile)
        splits = 1 << max(0, max((-(-(t[0] + t[2]) // SPLIT_BLOCK) for t in tiles), default=1) - 1).bit_length()
        anc_all = np.zeros((total, total), dtype=bool)
        for row0, anc in anc_parts:
            anc_all[row0 : row0 + anc.shape[0], row0 : row0 + anc.shape[0]] = anc
        staged = kernels.staging(ids, pos, slots, tiles, splits)
        logits = for_device(self.device, self._compute, total, splits, staged, anc_all,
                            logit_rows)
        out: list[torch.Tensor | None] = []
        for i, m in enumerate(members):
            out.append(logits[starts[i] : starts[i] + len(m.ids)] if m.logits else None)
        return out

    def _compute(self, width: int, splits: int, staged: list[int], anc: np.ndarray,
                 logit_rows: int) -> torch.Tensor:
        key = (width, splits, logit_rows > 0, self.pool.generation)
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _FusedRun(self.fused, self.pool, width, splits,
                                              logits=logit_rows > 0, device=self.device)
        run.stage(staged, anc)
        with torch.inference_mode():
            if self.cuda_graphs and run.graph is None:
                run.capture()
            return run.run(None if run.graph is not None else logit_rows)

    def shapes(self) -> list[_FusedRun]:
        """The shapes run so far (their staging, scratch and graphs)."""
        return list(self._runs.values())


class _FusedRun:
    """One fused forward shape's static inputs, scratch and (on CUDA) graph."""

    def __init__(self, fused: FusedLlama, pool: KVPool, width: int, splits: int, *,
                 logits: bool, device: torch.device) -> None:
        from agentspec.engine.fused import kernels

        self.fused, self.pool, self.width, self.logits = fused, pool, width, logits
        size = kernels.staging_size(width, splits)
        pin = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=pin)
        self._host_anc = torch.zeros((width, width), dtype=torch.bool, pin_memory=pin)
        self.ins = torch.zeros(size, dtype=torch.long, device=device)
        self.anc = torch.zeros((width, width), dtype=torch.bool, device=device)
        self.scratch = fused.scratch(width, splits)
        self.graph: Any = None
        self._out: torch.Tensor | None = None

    def stage(self, staged: list[int], anc: np.ndarray) -> None:
        self._host.numpy()[:] = staged
        self._host_anc.numpy()[:] = anc
        # Blocking copies: the host buffers are written again by the next forward's stage.
        self.ins.copy_(self._host)
        self.anc.copy_(self._host_anc)

    def _compute(self, logit_rows: int | None) -> torch.Tensor:
        first = None if logit_rows is None else max(logit_rows, 1)
        if not self.logits:
            first = 1
        return self.fused.forward(self.ins, self.anc, self.width, self.pool, self.scratch, first)

    def capture(self) -> None:
        """Record the forward as a CUDA graph (every row's logits when any are wanted)."""
        self.graph, self._out = capture_graph(lambda: self._compute(None))

    def run(self, logit_rows: int | None) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            assert self._out is not None
            return self._out
        return self._compute(logit_rows)
