"""The engine's forward over the KV pool: rows of any number of sequences in, logits out.

Every forward that produces a committed token (prompt chunks, plain steps, verifications,
whatever sequences share them) goes through :class:`Forward`: its rows laid out by
:mod:`agentspec.engine.plan` at a width of one measured reduction class, each sequence's rows
written into the pool at positions ``kv_len + depth`` and attending that sequence's own keys.
On the CPU the model's modules run it (linear layers on oneDNN, :func:`engine_kernels`); on
CUDA the fused forward runs it (:mod:`agentspec.engine.fused`), replayed as a CUDA graph per
width.

Row ``r`` of a sequence is *canonical* when it sits at position ``kv_len + r`` and attends
exactly the positions ``[0, kv_len + r]``: the rows of a chain (and a tree's spine, see
:func:`agentspec.tree.spine_length`). A canonical row's logits and KV are bitwise the same
whatever else its forward holds, because its keys sit at the same positions and every kernel
sees the same shapes (``tests/integration/test_invariance.py``,
``tests/integration/test_batching.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from agentspec.engine import compat
from agentspec.engine.kv import FULL, SLIDING, PoolCache, laid_out, verifying_attention
from agentspec.engine.plan import Layout, Member, class_width, lay_out
from agentspec.engine.pool import BLOCK as SPLIT_BLOCK
from agentspec.engine.pool import KVPool
from agentspec.engine.torch_thread import for_device

if TYPE_CHECKING:
    from agentspec.engine.fused.llama import FusedLlama

_PACKED: weakref.WeakKeyDictionary[Any, list[tuple[torch.nn.Module, Callable[..., Any]]]] = (
    weakref.WeakKeyDictionary())
# One lock per model: the engine's forwards swap the model's kernels in and out (below), and
# forks of one model (``HFTarget.fork``) under different Speculators take no turns together.
_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: Any) -> threading.RLock:
    """The lock every engine forward over ``model`` holds (reentrant)."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


def packed_linear(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """``layer``'s product on oneDNN in float32 with its weight packed once (CPU).

    A bfloat16 layer's weight is widened to float32 (exactly) and its output rounded back to
    bfloat16: the float32 accumulation a bfloat16 GEMM does, in one reduction order for every
    row count, where CPU bfloat16 kernels choose theirs by row count, thread count and
    instruction set (AMX or not).

    The product is oneDNN's pointwise linear on a weight reordered once into its blocked
    layout (the op PyTorch's own CPU compiler emits), on dense rows: no conversion of the rows
    to and from oneDNN's tensor type: faster than ``mkldnn_linear`` on converted rows at every
    shape measured (BENCHMARKS.md), with the same property: a row's bits do not depend on
    how many rows (from 2) its product has, or where it sits among them.
    """
    bias = layer.bias.detach().float() if layer.bias is not None else None
    pointwise = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if pointwise is not None and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().float())

        def forward(x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1]).float().contiguous()  # [rows, in_features]
            out = pointwise(rows, packed, bias, "none", [], "").to(x.dtype)
            return out.reshape(*x.shape[:-1], out.shape[-1])

        return forward
    weight = layer.weight.detach().float().to_mkldnn()  # a build without the pointwise op
    dense_bias = (bias if bias is not None else torch.zeros(layer.out_features)).to_mkldnn()

    def converted(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float().contiguous().to_mkldnn()  # [rows, in_features]
        out = torch._C._nn.mkldnn_linear(rows, weight, dense_bias).to_dense().to(x.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return converted


@contextmanager
def engine_kernels(model: Any) -> Iterator[None]:
    """The engine's kernels for the forwards inside, the model's own outside them.

    Attention always (see :mod:`agentspec.engine.kv`). On the CPU (float32 and bfloat16), also every
    linear layer on oneDNN in float32 with packed weights (:func:`packed_linear`): MKL's
    small-row products re-pack the weights on each call (a step of a few rows paid far more
    than a 1-row one) and use other kernels for 1, 2-3 and 4+ rows; packed oneDNN products
    are faster at those sizes (BENCHMARKS.md) and share one order from 2 rows on. CPU
    bfloat16 products gave a row other bits at
    another row count on one machine (CI's) and not on another: not a probe's to catch.

    The swaps are the model's, shared by every fork: a forward holds :func:`model_lock`, so
    two threads driving forks of one model take turns forward by forward (one thread's exit
    would take the kernels from under the other's forward). Other code calling the model
    meanwhile (transformers' ``generate`` in another thread) is not covered.
    """
    with model_lock(model):
        yield from _swapped_kernels(model)


def _swapped_kernels(model: Any) -> Iterator[None]:
    param = next(model.parameters())
    swaps: list[tuple[torch.nn.Module, Callable[..., Any]]] = []
    if (param.device.type == "cpu" and param.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()):
        swaps = _PACKED.get(model) or []
        if not swaps:
            with torch.inference_mode():
                swaps = [(m, packed_linear(m)) for m in model.modules()
                         if isinstance(m, torch.nn.Linear)]
            _PACKED[model] = swaps
    for module, forward in swaps:
        module.forward = forward  # type: ignore[method-assign]
    try:
        with verifying_attention(model):
            yield
    finally:
        for module, _ in swaps:
            del module.forward


def capture_graph(run: Callable[[], Any]) -> tuple[Any, Any]:
    """``run`` recorded as a CUDA graph after two warm-up calls on a side stream; returns the
    graph and what the recorded call returned (its outputs, rewritten by every replay).

    ``thread_local`` mode: CUDA work another thread does meanwhile (the memory's worker
    embedding a key on the GPU while the engine captures again after its KV grew, another
    model's forwards) neither fails nor joins the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = run()
    return graph, out




class Forward:
    """One model's forward over ``pool``: :meth:`run` takes the rows of any number of
    sequences (:class:`~agentspec.engine.plan.Member`) and returns each one's logits.

    Args:
        model: the transformers causal LM.
        pool: the KV pool its sequences live in.
        widths: the forward widths, smallest first, all of one reduction class: a forward's
            rows, and each sequence's rows in attention, are padded to the narrowest that
            holds them.
        sliding_window: the model's window, when it has sliding-window layers.
        fused: run this fused forward (:mod:`agentspec.engine.fused`) instead of the model's
            modules.
        cuda_graphs: replay the fused forward as CUDA graphs, one per width.
    """

    def __init__(self, model: Any, pool: KVPool, widths: tuple[int, ...], *,
                 sliding_window: int | None = None, fused: FusedLlama | None = None,
                 cuda_graphs: bool = False) -> None:
        self.model, self.pool, self.widths, self.window = model, pool, widths, sliding_window
        self.fused, self.cuda_graphs = fused, cuda_graphs
        self.device = next(model.parameters()).device
        pool.define_layers(compat.kv_shapes(model))
        # Mistral and Phi-3 slide every layer and take no dict of masks: one mask for all.
        self._every_layer_slides = compat.sliding_window(model)[1]
        self._hidden: torch.Tensor | None = None
        self._hook: Any = None
        self._fused_runs: dict[tuple[int, int, bool, int], _FusedRun] = {}

    def run(self, members: list[Member], *, width: int | None = None, wq: int | None = None,
            hidden: bool = False) -> list[torch.Tensor | None]:
        """One forward of ``members``' rows; each member's logits ``[rows, vocab]`` (None
        where it wants none). Its rows' keys and values are in the pool afterwards, at
        positions ``kv_len + depth`` (its committed length does not move: :meth:`commit
        <agentspec.engine.sequence.Sequence.commit>` does that). ``hidden``: also keep the
        final hidden rows of the members that want logits (:attr:`Member.hidden`).

        ``width`` and ``wq`` force the forward's and attention's widths (the width probe)."""
        if self.fused is not None:
            return self._fused_run(members, width)
        for m in members:
            m.seq.reserve(m.seq.kv_len + len(m.ids))
        layout = lay_out(members, self.widths, window=self.window, device=self.device,
                         width=width, wq=wq)
        # On the CPU on the torch thread (agentspec.engine.torch_thread: one OpenMP team).
        logits, kept = for_device(self.device, self._compute, layout, hidden)
        return _split(layout, logits, kept)

    def _compute(self, layout: Layout, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.inference_mode():
            logits = self._modules(layout, hidden)
        return logits, self._take_hidden() if hidden else None

    def _modules(self, layout: Layout, hidden: bool) -> torch.Tensor:
        masks: Any = FULL if self.window is None else {"full_attention": FULL,
                                                        "sliding_attention": SLIDING}
        if self.window is not None and self._every_layer_slides:
            masks = SLIDING
        keep: Any = 0 if layout.logit_rows is None else layout.logit_rows
        if hidden and self._hook is None:
            head = self.model.get_output_embeddings()
            self._hook = head.register_forward_pre_hook(self._keep_hidden)
        self._hidden = None
        _CAPTURING.forward = self if hidden else None
        try:
            with engine_kernels(self.model), laid_out(layout, self.pool):
                out = self.model(input_ids=layout.ids[None], position_ids=layout.positions[None],
                                 attention_mask=masks, past_key_values=PoolCache(self.pool, layout),
                                 use_cache=True, logits_to_keep=keep)
        finally:
            _CAPTURING.forward = None
        logits: torch.Tensor = out.logits[0]  # [rows kept, vocab_size]
        return logits

    def rows_taken(self, n: int) -> int:
        """Rows ``n`` rows of one sequence take in a forward (the fused forward's whole row
        tiles)."""
        if self.fused is None:
            return n
        from agentspec.engine.fused import kernels

        return -(-n // kernels.BLOCK_M) * kernels.BLOCK_M

    def _fused_run(self, members: list[Member], width: int | None) -> list[torch.Tensor | None]:
        """The fused forward: each member's rows padded to whole row tiles (padding rows see
        only themselves and are written past the committed length), members that want logits
        first, junk tiles after; one staging copy; replayed as a CUDA graph per width."""
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
        total = width or class_width(max(len(ids), 1), self.widths)
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
        logits = for_device(self.device, self._fused_compute, total, splits, staged, anc_all,
                            logit_rows)
        out: list[torch.Tensor | None] = []
        for i, m in enumerate(members):
            out.append(logits[starts[i] : starts[i] + len(m.ids)] if m.logits else None)
        return out

    def _fused_compute(self, width: int, splits: int, staged: list[int], anc: np.ndarray,
                       logit_rows: int) -> torch.Tensor:
        assert self.fused is not None
        key = (width, splits, logit_rows > 0, self.pool.generation)
        run = self._fused_runs.get(key)
        if run is None:
            run = self._fused_runs[key] = _FusedRun(self.fused, self.pool, width, splits,
                                                    logits=logit_rows > 0, device=self.device)
        run.stage(staged, anc)
        with torch.inference_mode():
            if self.cuda_graphs and run.graph is None:
                run.capture()
            return run.run(None if run.graph is not None else logit_rows)

    def fused_runs(self) -> list[_FusedRun]:
        """The fused forward's shapes run so far (their staging, scratch and graphs)."""
        return list(self._fused_runs.values())

    def _keep_hidden(self, module: Any, args: tuple[Any, ...]) -> None:
        # The output embedding is the model's, shared by every fork and by other code (the
        # bench's transformers baselines): keep only this forward's own, in this thread.
        if getattr(_CAPTURING, "forward", None) is self:
            self._hidden = args[0][0]  # [rows kept, hidden]

    def _take_hidden(self) -> torch.Tensor | None:
        out, self._hidden = self._hidden, None
        return out


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


# The forward whose hidden rows are being kept in this thread.
_CAPTURING = threading.local()


def _split(layout: Layout, logits: torch.Tensor,
           hidden: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Each member's rows of the forward's logits (and hidden rows, onto the members)."""
    out: list[torch.Tensor | None] = []
    at = 0
    for m in layout.members:
        n = len(m.ids)
        if not m.logits:
            out.append(None)
            continue
        start = m.row0 if layout.logit_rows is None else at
        out.append(logits[start : start + n])
        if hidden is not None:
            m.hidden = hidden[start : start + n]
        at += n
    return out
