"""The engine's forward over the KV pool: rows of any number of sequences in, logits out.

Every forward that produces a committed token (prompt chunks, plain steps, verifications,
whatever sequences share them) goes through :class:`Forward`: its rows laid out by
:mod:`agentspec.engine.plan` at a width of one measured reduction class, each sequence's rows
written into the pool at positions ``kv_len + depth`` and attending that sequence's own keys.
On the CPU the model's modules run it (linear layers on oneDNN, :func:`engine_kernels`, or on
the native products over a GGUF's weights as stored, :mod:`agentspec.engine.quant`); on
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

from typing import TYPE_CHECKING, Any

import torch

from agentspec.engine import compat
from agentspec.engine.kernels import engine_kernels
from agentspec.engine.kv import FULL, REPLACED, SLIDING, PoolCache, laid_out
from agentspec.engine.plan import Layout, Member, Prefill, lay_out
from agentspec.engine.pool import KVPool
from agentspec.engine.quant.model import holds_quantized
from agentspec.engine.torch_thread import for_device
from agentspec.engine.widths import default_widths, ordered_widths
from agentspec.errors import warn_once

if TYPE_CHECKING:
    from agentspec.engine.fused.runner import FusedRunner
    from agentspec.engine.quant.runner import NativeForward


class Scored(list[torch.Tensor | None]):
    """What one forward returns: each member's logits ``[rows, vocab_size]`` in order (None
    where it wants none), and in :attr:`hidden` each member's final hidden rows
    ``[rows, hidden]`` where the forward was asked to keep them (else None). Read only:
    hidden rows never decide a token."""

    def __init__(self, logits: list[torch.Tensor | None],
                 hidden: list[torch.Tensor | None] | None = None) -> None:
        super().__init__(logits)
        self.hidden: list[torch.Tensor | None] = hidden or [None] * len(logits)


class Forward:
    """One model's forward over ``pool``: :meth:`run` takes the rows of any number of
    sequences (:class:`~agentspec.engine.plan.Member`) and returns each one's logits.

    It owns what decides a row's bits: its widths (every width of one reduction class,
    settled by the width probe, :mod:`agentspec.engine.probe`), its kernels (the modules with
    the engine's attention and products, or the fused forward), and the fallback from the
    fused forward to the modules where the fused one fails before it ever ran.

    Args:
        model: the transformers causal LM.
        pool: the KV pool its sequences live in.
        name: the model's name, for warnings.
        widths: the forward widths, smallest first, all of one reduction class: a forward's
            rows, and each sequence's rows in attention, are padded to the narrowest that
            holds them. Default :func:`~agentspec.engine.widths.default_widths`.
        prefill_widths: wider forwards for prompt chunks and steps carrying many sequences'
            rows, kept where the probe finds them in the same class.
        sliding_window: the model's window, when it has sliding-window layers.
        fused: the fused forward (:mod:`agentspec.engine.fused`): None (default) on CUDA
            where the model is covered; True: required; False: the modules.
        cuda_graphs: replay the fused forward as CUDA graphs, one per width.
    """

    def __init__(self, model: Any, pool: KVPool, *, name: str = "model",
                 widths: tuple[int, ...] | None = None,
                 prefill_widths: tuple[int, ...] | None = None,
                 sliding_window: int | None = None, fused: bool | None = None,
                 cuda_graphs: bool = False) -> None:
        self.model, self.pool, self.name, self.window = model, pool, name, sliding_window
        self.device = next(model.parameters()).device
        cuda = self.device.type == "cuda"
        self.cuda_graphs = cuda_graphs and cuda
        self.fused: FusedRunner | None = None
        self._fused_optional, self._fused_ran = fused is None, False
        if fused or (fused is None and cuda):
            from agentspec.engine.fused.llama import select
            from agentspec.engine.fused.runner import FusedRunner

            chosen = select(model, required=bool(fused))
            if chosen is not None:
                self.fused = FusedRunner(chosen, pool, self.device, cuda_graphs=self.cuda_graphs)
        # A GGUF's weights held as stored, on the CPU: the native forward where it covers the
        # layers (agentspec.engine.quant.runner), else the modules over the native products.
        self.native: NativeForward | None = None
        if self.fused is None and not cuda and holds_quantized(model):
            from agentspec.engine.quant.runner import NativeForward, unsupported

            if unsupported(model) is None:
                self.native = NativeForward(model, pool)
        default, default_wide = default_widths(self.fused is not None, cuda,
                                               self.native is not None)
        self.widths = ordered_widths(widths or default)
        if self.fused is not None:
            from agentspec.engine.fused import kernels

            odd = [w for w in (*self.widths, *(prefill_widths or ())) if w % kernels.BLOCK_M]
            if odd:
                raise ValueError(f"the fused forward takes widths in multiples of "
                                 f"{kernels.BLOCK_M}, got {odd}")
        wide = default_wide if prefill_widths is None else tuple(prefill_widths)
        self.prefill_widths = ordered_widths([w for w in wide if w > self.widths[-1]],
                                             "prefill_widths", str(prefill_widths))
        # Whether the widths still need the probe (a single width asked for needs none, nor the
        # native forward, which pads no row), and whether a forward may carry several
        # sequences (the probe's batch check).
        self.probed = self.native is not None or (
            widths is not None and len(self.widths) == 1 and not self.prefill_widths)
        self.batches = True
        shapes = compat.kv_shapes(model)
        if self.native is not None:
            shapes = [(heads, dim, self.native.kv_dtype) for heads, dim, _ in shapes]
        pool.define_layers(shapes, key_lanes=self.native.key_lanes if self.native else 0)
        # Mistral and Phi-3 slide every layer and take no dict of masks: one mask for all.
        self._every_layer_slides = compat.sliding_window(model)[1]
        self.supports_trees = self._trees()

    def _trees(self) -> bool:
        """Whether this forward can take a tree mask (else drafts are verified as chains)."""
        attention = compat.attention_implementation(self.model)
        if attention not in REPLACED and self.fused is None:
            warn_once(f"{self.name}: {attention} attention cannot take a tree mask; verifying "
                      "chains only")
            return False
        if (self.window is not None and not (compat.takes_mask_dict(self.model)
                                             or self._every_layer_slides)):
            warn_once(f"{self.name}: sliding-window layers cannot take a tree mask; verifying "
                      "chains only")
            return False
        return True

    @property
    def all_widths(self) -> tuple[int, ...]:
        return (*self.widths, *self.prefill_widths)

    @property
    def widest(self) -> int:
        """The most rows one forward takes (a prompt chunk, or a step of many sequences)."""
        return self.all_widths[-1]

    def settle(self, widths: tuple[int, ...], prefill_widths: tuple[int, ...],
               batches: bool) -> None:
        """Take the width probe's verdict."""
        self.widths, self.prefill_widths, self.batches = widths, prefill_widths, batches
        self.probed = True

    def run(self, members: list[Member], *, hidden: bool = False, width: int | None = None,
            wq: int | None = None) -> Scored:
        """One forward of ``members``' rows (see :class:`Scored`). Their rows' keys and values
        are in the pool afterwards, at positions ``kv_len + depth`` (the committed length does
        not move: :meth:`Sequence.commit <agentspec.engine.sequence.Sequence.commit>` does
        that). ``hidden``: also return the final hidden rows of the members that want logits
        (the modules' path only).

        ``width`` and ``wq`` force the forward's and attention's widths (the width probe).

        The fused forward falls back to the modules where it fails before it ever ran (a
        Triton or driver its kernels do not compile on; nothing it wrote is committed), with
        a warning."""
        if self.native is not None:  # no widths to force: it pads nothing
            return Scored(*for_device(self.device, self.native.run, members, hidden))
        if self.fused is None:
            return self._modules_run(members, hidden, width, wq)
        try:
            out = Scored(self.fused.run(members, self.all_widths, width))
        except Exception as exc:  # noqa: BLE001 - a kernel that fails before it ever ran
            if self._fused_ran or not self._fused_optional:
                raise
            warn_once(f"{self.name}: the fused forward failed ({type(exc).__name__}: {exc}); "
                      "running the model's modules")
            self._unfuse()
            return self._modules_run(members, hidden, None, None)
        self._fused_ran = True
        return out

    def _unfuse(self) -> None:
        """Back to the module path, with its widths (probed again on the CPU)."""
        self.fused = None
        cuda = self.device.type == "cuda"
        self.widths, self.prefill_widths = default_widths(False, cuda)
        self.supports_trees = compat.attention_implementation(self.model) in REPLACED
        self.probed = cuda

    def fill(self, prefill: Prefill) -> None:
        """Run ``prefill`` to its end alone: a chunk of the widest width a forward, each
        committed once its forward ran."""
        while not prefill.done:
            chunk = prefill.chunk(self.widest)
            self.run([chunk])
            prefill.written(chunk)

    def rows_taken(self, n: int) -> int:
        """Rows ``n`` rows of one sequence take in a forward (the fused forward's whole row
        tiles)."""
        if self.fused is None:
            return n
        from agentspec.engine.fused.runner import tile_rows

        return tile_rows(n)

    def _modules_run(self, members: list[Member], hidden: bool, width: int | None,
                     wq: int | None) -> Scored:
        for m in members:
            m.seq.reserve(m.seq.kv_len + len(m.ids))
        layout = lay_out(members, self.all_widths,
                         window=self.window, device=self.device, width=width, wq=wq)
        # On the CPU on the torch thread (agentspec.engine.torch_thread: one OpenMP team).
        logits, kept = for_device(self.device, self._modules, layout, hidden)
        return _split(layout, logits, kept)

    def _modules(self, layout: Layout,
                 hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's modules over the layout (the engine's attention over the pool, its
        products); with ``hidden`` also the final hidden rows the logits come from: the
        model's own last hidden state (transformers hands it back as the last of
        ``hidden_states``, after the final norm), at the rows whose logits are kept."""
        masks: Any = FULL if self.window is None else {"full_attention": FULL,
                                                        "sliding_attention": SLIDING}
        if self.window is not None and self._every_layer_slides:
            masks = SLIDING
        keep: Any = 0 if layout.logit_rows is None else layout.logit_rows
        with torch.inference_mode(), engine_kernels(self.model), laid_out(layout, self.pool):
            out = self.model(input_ids=layout.ids[None], position_ids=layout.positions[None],
                             attention_mask=masks, past_key_values=PoolCache(self.pool, layout),
                             use_cache=True, logits_to_keep=keep, output_hidden_states=hidden)
        logits: torch.Tensor = out.logits[0]  # [rows kept, vocab_size]
        if not hidden:
            return logits, None
        last = out.hidden_states[-1][0]  # [width, hidden]
        return logits, (last if layout.logit_rows is None else last[layout.logit_rows])

    def fused_runs(self) -> list[Any]:
        """The fused forward's shapes run so far (their staging, scratch and graphs)."""
        return [] if self.fused is None else self.fused.shapes()


def _split(layout: Layout, logits: torch.Tensor, hidden: torch.Tensor | None) -> Scored:
    """Each member's rows of the forward's logits, and of its hidden rows where kept."""
    out: list[torch.Tensor | None] = []
    rows: list[torch.Tensor | None] = []
    at = 0
    for m in layout.members:
        n = len(m.ids)
        if not m.logits:
            out.append(None)
            rows.append(None)
            continue
        start = m.row0 if layout.logit_rows is None else at
        out.append(logits[start : start + n])
        rows.append(None if hidden is None else hidden[start : start + n])
        at += n
    return Scored(out, rows)
