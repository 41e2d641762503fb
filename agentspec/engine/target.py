"""The engine: a model's identity, its forward and the KV pool its sequences live in.

``HFTarget`` is what the engine holds once per model: :class:`~agentspec.engine.model.ModelIdentity`
(fingerprint, stop tokens), the :class:`~agentspec.engine.forward.Forward` (its widths, probed
once by :mod:`agentspec.engine.probe`; the modules or the fused kernels) and a
:class:`~agentspec.engine.pool.KVPool`. Its three verbs are the engine's one door:

- :meth:`HFTarget.new_sequence`: a sequence of the pool, for one generation;
- :meth:`HFTarget.prefill`: hold what the pool has of a prompt, and the rest as a
  :class:`~agentspec.engine.plan.Prefill` (run to its end, or handed to the scheduler's steps);
- :meth:`HFTarget.run`: one forward over the rows of any number of sequences
  (:class:`~agentspec.engine.plan.Member`), each one's logits back (and its final hidden rows,
  where asked).

A sequence commits its own verdict (:meth:`Sequence.commit
<agentspec.engine.sequence.Sequence.commit>`); the engine never moves a committed length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agentspec.engine import compat, malloc, probe
from agentspec.engine.forward import Forward, Scored
from agentspec.engine.model import ModelIdentity
from agentspec.engine.model import fingerprint as fingerprint
from agentspec.engine.plan import Member, Prefill
from agentspec.engine.pool import BLOCK, DEFAULT_CACHE_BYTES, KVPool, PoolStats
from agentspec.engine.sequence import Sequence as KVSequence
from agentspec.engine.torch_thread import device_work
from agentspec.errors import ContextLengthError, UnsupportedModelError
from agentspec.tree import common_prefix_len


class HFTarget:
    """A transformers causal LM, its forward and the KV pool of its generations.

    Every forward runs at a width from one measured reduction class over the pool (see
    :mod:`agentspec.engine.forward`), so a committed token's logits and KV rows are bitwise the
    same whatever the drafts and whatever other sequences share the forward: the output is a
    pure function of the request, in bf16 too.

    Args:
        reuse_prefix: a generation holds the rows of the longest prefix its prompt shares with
            what its sequence holds or the pool has cached (an agent's calls share their system
            prompt, tool docs and earlier turns), instead of prefilling them. The same bits a
            fresh prefill computes (``tests/integration/test_invariance.py``).
        widths: the forward widths, smallest first, all of one reduction class. Default on
            the CPU :data:`CPU_WIDTHS` (2 to 64 rows; a 1-row product runs another kernel than
            2+ rows), checked on first use (:meth:`check_widths`). On CUDA without the fused
            forward one width, 64 (cuBLAS picks kernels by row count).
        cuda_graphs: capture the fused forward as CUDA graphs (CUDA only; default on).
        prefill_widths: wider forwards, kept where they compute the same bits as the widest of
            ``widths`` (:meth:`check_widths`): prompt chunks, and steps carrying many
            sequences' rows. Default on the CPU :data:`CPU_PREFILL_WIDTHS`.
        fused: the fused forward (:mod:`agentspec.engine.fused`: a Llama-family model in six
            Triton kernels a layer instead of its modules): ``None`` (default) on CUDA where
            the model is covered; ``True``: required (a clear error where the model is not
            covered; on the CPU only under Triton's interpreter, for tests); ``False``: the
            modules. Its default widths are :data:`FUSED_WIDTHS` and
            :data:`FUSED_PREFILL_WIDTHS`.
        prefix_cache_bytes: the budget of blocks the pool keeps after their sequences end, for
            later prompts that start with them (:mod:`agentspec.engine.pool`). ``None``: 512
            MiB; 0: none kept (and none without ``reuse_prefix``).
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str = "model",
                 reuse_prefix: bool = True, widths: tuple[int, ...] | None = None,
                 cuda_graphs: bool = True,
                 prefill_widths: tuple[int, ...] | None = None,
                 prefix_cache_bytes: int | None = None, fused: bool | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.reuse_prefix = reuse_prefix
        self.device = next(model.parameters()).device
        if self.device.type != "cuda":  # the engine's large CPU temporaries: reused (engine.malloc)
            malloc.tune()
        budget = DEFAULT_CACHE_BYTES if prefix_cache_bytes is None else prefix_cache_bytes
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"prefix_cache_bytes must be an int >= 0, got {prefix_cache_bytes!r}")
        self.prefix_cache_bytes = budget if reuse_prefix else 0
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
        head = model.get_output_embeddings()
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])
        self._identity: ModelIdentity | None = None
        if compat.static_cache(model):
            raise UnsupportedModelError(f"{name}: a static KV cannot be rolled back per path")
        self.sliding_window = compat.sliding_window(model)[0]
        self.pool = KVPool(self.device, cache_bytes=self.prefix_cache_bytes)
        self.forward = Forward(model, self.pool, name=name, widths=widths,
                               prefill_widths=prefill_widths, sliding_window=self.sliding_window,
                               fused=fused, cuda_graphs=cuda_graphs)

    @property
    def identity(self) -> ModelIdentity:
        if self._identity is None:
            self._identity = ModelIdentity.of(self.name, self.model, self.tokenizer,
                                              (compat.eos_token_ids(self.model),
                                               self.tokenizer.eos_token_id))
        return self._identity

    @property
    def fingerprint(self) -> str:
        return self.identity.fingerprint

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a generation: the model's generation config's and the
        tokenizer's end-of-sequence ids."""
        return self.identity.stop_token_ids

    @property
    def widths(self) -> tuple[int, ...]:
        """The forward widths (the forward's, settled by the probe on first use)."""
        return self.forward.widths

    @property
    def prefill_widths(self) -> tuple[int, ...]:
        return self.forward.prefill_widths

    @property
    def batches(self) -> bool:
        """Whether a forward may carry several sequences (the width probe's verdict)."""
        return self.forward.batches

    @property
    def supports_trees(self) -> bool:
        """Whether drafts may be trees (the forward takes a tree mask), else chains."""
        return self.forward.supports_trees

    @property
    def max_draft_nodes(self) -> int:
        """The most draft nodes one forward scores (the root takes a row)."""
        return self.forward.widths[-1] - 1

    @property
    def widest(self) -> int:
        """The most rows one forward takes (a prompt chunk, or a step of many sequences)."""
        return self.forward.widest

    def check_length(self, total_tokens: int) -> None:
        """Refuse a generation whose KV would outgrow what the model can attend.

        Sliding-window layers keep their full KV here, so a generation longer than the window
        still rolls back exactly; the window is applied by the masks.

        Raises:
            ContextLengthError: the message names both counts.
        """
        if total_tokens > self.max_context:
            raise ContextLengthError(
                f"prompt plus max_new_tokens is {total_tokens} tokens, more than the model's "
                f"context of {self.max_context}")

    @device_work
    @torch.inference_mode()
    def check_widths(self) -> tuple[int, ...]:
        """Settle the forward's widths (:mod:`agentspec.engine.probe`), once; they are
        returned. Every verb runs it first; callers that size work by the widths before any
        forward (the cost curve) call it themselves."""
        return probe.check_widths(self.forward, self.vocab_size)

    def new_sequence(self, *, cached: bool = True) -> KVSequence:
        """A sequence of this engine's pool, for one generation (:meth:`prefill`, :meth:`run`,
        ``commit``; ``release()`` when it ends). ``cached=False``: a scratch sequence whose
        rows no later prompt finds (a measurement's synthetic prompts)."""
        return KVSequence(self.pool, cached=cached)

    @device_work
    @torch.inference_mode()
    def prefill(self, seq: KVSequence, prompt_ids: Sequence[int], *, now: bool = True) -> Prefill:
        """Prepare ``seq`` for a generation of ``prompt_ids``: it holds every prompt token but
        the last. Rows it holds already, or the pool has cached, are kept (``reuse_prefix``);
        the rest is a :class:`~agentspec.engine.plan.Prefill`, computed here in chunks of the
        widest width (``now``), or left for the caller's steps (the scheduler's)."""
        self.check_widths()  # the widest width is the probe's
        wanted = list(prompt_ids[:-1])
        keep = seq.start(wanted, reuse=self.reuse_prefix)
        pending = Prefill(seq, wanted[keep:])
        if now:
            self.forward.fill(pending)
        return pending

    @device_work
    @torch.inference_mode()
    def run(self, members: list[Member], *, hidden: bool = False) -> Scored:
        """One forward over the rows of ``members`` (any sequences of this engine's pool):
        each member's logits ``[rows, vocab_size]``, None where it wants none, and with
        ``hidden`` each one's final hidden rows (:class:`~agentspec.engine.forward.Scored`)."""
        self.check_widths()
        return self.forward.run(members, hidden=hidden)

    def shared_rows(self, prompt_ids: Sequence[int], other_ids: Sequence[int]) -> int:
        """Rows a prefill of ``other_ids`` would seal that a prompt ``prompt_ids`` could then
        hold beyond what the pool has of it now (whole blocks of their common prefix; 0
        without ``reuse_prefix``): what a request saves by waiting for another's prefill."""
        if not self.reuse_prefix:
            return 0
        wanted, other = list(prompt_ids[:-1]), list(other_ids[:-1])
        common = common_prefix_len(wanted, other) // BLOCK * BLOCK
        if common == 0:
            return 0
        chain, _, _ = self.pool.match(wanted[:common])
        return common - len(chain) * BLOCK

    @property
    def prefix_stats(self) -> PoolStats:
        """What the pool reused and holds (:class:`~agentspec.engine.pool.PoolStats`)."""
        return self.pool.stats

    def fork(self) -> HFTarget:
        """Another engine on the same weights with a pool of its own (cheap: no copy of the
        weights), its widths settled as this one's."""
        twin = HFTarget(self.model, self.tokenizer, name=self.name, reuse_prefix=self.reuse_prefix,
                        widths=self.widths, cuda_graphs=self.forward.cuda_graphs,
                        prefill_widths=self.prefill_widths,
                        prefix_cache_bytes=self.prefix_cache_bytes,
                        fused=self.forward.fused is not None)
        if self.forward.probed:
            twin.forward.settle(self.widths, self.prefill_widths, self.batches)
        twin._identity = self._identity
        return twin
