"""One fixed-width forward of the target over a :class:`~agentspec.engine.kv.FixedKV`.

Every forward that produces a committed token (prefill chunks, plain steps, verifications)
goes through :class:`FixedForward`: a width from one measured reduction class, rows written
at KV slots ``kv_len + row``, and a ``[width, capacity]`` mask built on the device from a
``[width, width]`` ancestor matrix. Inputs live in static buffers, so on CUDA the forward is
captured once as a CUDA graph (:meth:`FixedForward.capture`) and replayed per step; on the CPU
the same code runs eagerly.

Row ``r`` of a forward is *canonical* when it sits at slot ``kv_len + r`` = its position and
attends exactly the slots ``[0, kv_len + r]``: the rows of a chain (and a tree's spine, see
:func:`agentspec.tree.spine_length`). A canonical row's logits and KV are bitwise the same
whatever else its forward holds, because its keys sit in the same slots and every kernel
sees the same shapes (``tests/integration/test_invariance.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from agentspec.engine.kv import FixedKV, live_keys, verifying_attention

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


class FixedForward:
    """Static inputs and outputs of one forward of ``width`` rows over ``kv``.

    Args:
        model: the transformers causal LM.
        kv: the KV whose buffers the forward reads and writes (its capacity is fixed).
        width: rows per forward.
        sliding_window: the model's window, when it has sliding-window layers (their mask
            also hides keys more than ``sliding_window - 1`` positions behind a query).
        fused: run this fused forward (:mod:`agentspec.engine.fused`) instead of the model's
            modules.
    """

    def __init__(self, model: Any, kv: FixedKV, width: int, *,
                 sliding_window: int | None = None, fused: FusedLlama | None = None) -> None:
        self.model, self.kv, self.width, self.window = model, kv, width, sliding_window
        self.fused = fused
        self._scratch: tuple[torch.Tensor, ...] | None = None
        device = next(model.parameters()).device
        # Host staging (pinned on CUDA: faster copies to the device): the ids, depths and
        # kv_len (int64) and the ancestor matrix (bool) share one byte buffer, so a forward's
        # inputs reach the device in one copy.
        pin = device.type == "cuda"
        ints = 8 * (2 * width + 1)
        self._host_bytes = torch.zeros(ints + width * width, dtype=torch.uint8, pin_memory=pin)
        self._bytes = torch.zeros(ints + width * width, dtype=torch.uint8, device=device)
        self._host = self._host_bytes[:ints].view(torch.long)
        self._host_anc = self._host_bytes[ints:].view(torch.bool).view(width, width)
        self._ins = self._bytes[:ints].view(torch.long)  # ids, depth, kv_len
        self._anc = self._bytes[ints:].view(torch.bool).view(width, width)
        self._rows = torch.arange(width, device=device)
        self._slots = torch.zeros(width, dtype=torch.long, device=device)
        self._cols = torch.arange(kv.capacity, device=device)
        self.logits: torch.Tensor | None = None  # [width, vocab_size] after a run
        self._graph: Any = None
        self._live = kv.capacity  # KV slots the staged forward can attend (host copy)

    def load(self, ids: list[int], depth: list[int], anc: np.ndarray, kv_len: int) -> None:
        """Stage one forward's inputs: ``n <= width`` rows of token ids, their depths below
        the first row (position = ``kv_len + depth``), and ``anc[r, c]`` = row ``r`` attends
        row ``c`` of this forward (itself included). Missing rows are padding."""
        w, n = self.width, len(ids)
        host = self._host.numpy()
        host[:n], host[n:w] = ids, ids[-1]
        host[w : w + n], host[w + n : 2 * w] = depth, np.arange(n, w)
        host[2 * w] = kv_len
        self._live = kv_len + w
        full = self._host_anc.numpy()
        full[:] = False
        full[:n, :n] = anc
        full[np.arange(n, w), np.arange(n, w)] = True  # padding rows see only themselves
        # A blocking copy: the staging buffer is written again by the next ``load`` (a
        # prefill's next chunk comes before any host sync), so the copy must be done first.
        self._bytes.copy_(self._host_bytes)

    def run(self, *, logits: bool = True) -> torch.Tensor:
        """The forward on the staged inputs (a graph replay once captured). ``logits=False``
        (a prefill chunk) lets an eager forward skip the output head but for the last row."""
        if self._graph is not None:
            self._graph.replay()
        else:  # eager: attention reads only the KV blocks up to the last row (exact, faster)
            with live_keys(self._live):
                self.compute(None if logits else 1)
        assert self.logits is not None
        return self.logits

    def capture(self) -> None:
        """Record the forward as a CUDA graph (inputs must be staged: the warm-up forwards
        write only the slots from ``kv_len`` on, which hold nothing committed)."""
        self._graph, _ = capture_graph(self.compute)

    @property
    def captured(self) -> bool:
        """Whether :meth:`run` replays a CUDA graph (the target captures a forward once)."""
        return self._graph is not None

    def compute(self, logits_to_keep: int | None = None) -> None:
        """The forward on the staged inputs, eagerly, over the whole KV: what a CUDA graph
        records (:meth:`capture`; the bench counts its operations). Sets :attr:`logits`."""
        w = self.width
        if self.fused is not None:
            if self._scratch is None:
                self._scratch = self.fused.scratch(w, self.kv.capacity)
            self.logits = self.fused.forward(self._ins, self._anc, w, self.kv, self._scratch,
                                             logits_to_keep)
            return
        ids, depth, kv_len = self._ins[:w], self._ins[w : 2 * w], self._ins[2 * w]
        positions = kv_len + depth  # [width]
        self._slots.copy_(kv_len + self._rows)
        self.kv.slots = self._slots
        rel = self._cols - kv_len  # [capacity]: slot relative to this forward's first row
        inside = (rel >= 0) & (rel < w)
        block = self._anc[:, rel.clamp(0, w - 1)] & inside  # [width, capacity]
        mask = (self._cols < kv_len)[None, :] | block  # [width, capacity], True = attend
        masks: Any = mask[None, None]
        if self.window is not None:
            key_pos = torch.where(inside, kv_len + depth[rel.clamp(0, w - 1)], self._cols)
            near = key_pos[None, :] > positions[:, None] - self.window  # [width, capacity]
            masks = {"full_attention": masks, "sliding_attention": (mask & near)[None, None]}
        with engine_kernels(self.model):
            out = self.model(input_ids=ids[None], position_ids=positions[None],
                             attention_mask=masks, past_key_values=self.kv, use_cache=True,
                             logits_to_keep=logits_to_keep or 0)
        self.logits = out.logits[0]  # [width, vocab_size]
