"""The engine's CPU kernels and CUDA graphs: the model's linear layers on packed oneDNN
products, swapped in for the engine's forwards only, and a forward recorded as a CUDA graph.

Shared by the engine's forward (:mod:`agentspec.engine.forward`) and the memory's embedder,
which runs its products the same way.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from agentspec.engine.kv import verifying_attention

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
