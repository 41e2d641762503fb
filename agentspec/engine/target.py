"""The target model: its identity, its forward, the KV pool its sequences live in.

``HFTarget`` is what the engine holds once per model: :class:`~agentspec.engine.model.ModelIdentity`
(fingerprint, stop tokens), the :class:`~agentspec.engine.forward.Forward` (widths, probed
once; the modules or the fused kernels) and a :class:`~agentspec.engine.pool.KVPool`. Every
generation is a :class:`~agentspec.engine.sequence.Sequence` in the pool; :meth:`HFTarget.run`
computes one forward over the rows of any number of them (the scheduler's batched steps).

For a single caller the target also keeps one sequence of its own and the decode loop's
invariant on it (between steps the KV holds every committed token but the last one):
``start`` prefills a prompt, ``score`` runs one forward over the last committed token and a
draft (chain or tree), ``commit`` keeps the accepted path's rows and drops the rest.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from agentspec.engine import compat, malloc, width_cache
from agentspec.engine.forward import Forward
from agentspec.engine.kv import REPLACED
from agentspec.engine.model import ModelIdentity
from agentspec.engine.model import fingerprint as fingerprint
from agentspec.engine.plan import Member
from agentspec.engine.pool import BLOCK, DEFAULT_CACHE_BYTES, KVPool, PoolStats
from agentspec.engine.sequence import Sequence as KVSequence
from agentspec.engine.torch_thread import device_work
from agentspec.engine.widths import default_widths, ordered_widths
from agentspec.errors import ContextLengthError, UnsupportedModelError, warn_once
from agentspec.tree import ancestor_matrix, common_prefix_len, depths
from agentspec.types import Draft, Verdict

# check_widths results per model: one probe per loaded model, not per HFTarget over it.
_WIDTH_CLASS: weakref.WeakKeyDictionary[
    Any, dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...], bool]]] = (
    weakref.WeakKeyDictionary())


def causal(n: int) -> np.ndarray:
    """The ancestor matrix of a chain of ``n`` rows: each row sees itself and those before."""
    return np.tril(np.ones((n, n), dtype=bool))


def draft_member(seq: KVSequence, last_token: int, draft: Draft) -> Member:
    """The rows a step scores for ``seq``: its last committed token (the root) and the draft's
    nodes, each seeing the root and its ancestors."""
    n = draft.num_nodes
    anc = np.zeros((n + 1, n + 1), dtype=bool)
    anc[:, 0] = True
    anc[1:, 1:] = ancestor_matrix(draft.parents)
    return Member(seq, [last_token, *draft.token_ids], [0, *depths(draft.parents)], anc)


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
        cuda = self.device.type == "cuda"
        if not cuda:  # the engine's large CPU temporaries: reused, not mapped anew (engine.malloc)
            malloc.tune()
        self.fused = None
        self._fused_optional, self._fused_ran = fused is None, False
        if fused or (fused is None and cuda):
            from agentspec.engine.fused.llama import select

            self.fused = select(model, required=bool(fused))
        default, default_wide = default_widths(self.fused is not None, cuda)
        self.widths = ordered_widths(widths or default)
        if self.fused is not None:
            from agentspec.engine.fused import kernels

            odd = [w for w in (*self.widths, *(prefill_widths or ())) if w % kernels.BLOCK_M]
            if odd:
                raise ValueError(f"the fused forward takes widths in multiples of "
                                 f"{kernels.BLOCK_M}, got {odd}")
        self.cuda_graphs = cuda_graphs and cuda
        wide = default_wide if prefill_widths is None else tuple(prefill_widths)
        self.prefill_widths = ordered_widths([w for w in wide if w > self.widths[-1]],
                                             "prefill_widths", str(prefill_widths))
        budget = DEFAULT_CACHE_BYTES if prefix_cache_bytes is None else prefix_cache_bytes
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"prefix_cache_bytes must be an int >= 0, got {prefix_cache_bytes!r}")
        self.prefix_cache_bytes = budget if reuse_prefix else 0
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._identity: ModelIdentity | None = None
        self._refuse_unrollbackable()
        self.pool = KVPool(self.device, cache_bytes=self.prefix_cache_bytes)
        self.forward = Forward(model, self.pool, self._all_widths(),
                               sliding_window=self.sliding_window, fused=self.fused,
                               cuda_graphs=self.cuda_graphs)
        self.seq = KVSequence(self.pool)  # a single caller's generation
        self._root = -1  # the last committed token, scored by ``score``
        self._widths_checked = widths is not None and len(self.widths) == 1 and not self.prefill_widths
        self.batches = True  # whether forwards may carry several sequences (check_widths)
        # The final hidden rows of the last ``score(keep_hidden=True)``: row r at position
        # ``hidden_position + r``. Read only: never used to decide a token.
        self.hidden: torch.Tensor | None = None
        self.hidden_position = -1
        # Tree drafts need a tree mask in the engine's attention (the fused forward's too);
        # other attention paths verify chains.
        attention = compat.attention_implementation(model)
        self.supports_trees = attention in REPLACED or self.fused is not None
        if not self.supports_trees:
            warn_once(f"{name}: {attention} attention cannot take a tree mask; verifying chains only")
        if (self.supports_trees and self.sliding_window is not None
                and not (compat.takes_mask_dict(model) or compat.sliding_window(model)[1])):
            warn_once(f"{name}: sliding-window layers cannot take a tree mask; verifying chains only")
            self.supports_trees = False

    def _all_widths(self) -> tuple[int, ...]:
        return (*self.widths, *self.prefill_widths)

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
    def max_draft_nodes(self) -> int:
        """The most draft nodes one forward scores (the root takes a row)."""
        return self.widths[-1] - 1

    @property
    def widest(self) -> int:
        """The most rows one forward takes (a prompt chunk, or a step of many sequences)."""
        return self._all_widths()[-1]

    def _refuse_unrollbackable(self) -> None:
        self.sliding_window = compat.sliding_window(self.model)[0]
        if compat.static_cache(self.model):
            raise UnsupportedModelError(f"{self.name}: a static KV cannot be rolled back per path")

    def check_length(self, total_tokens: int) -> None:
        """Refuse a generation whose KV would outgrow what the model can attend.

        Sliding-window layers keep their full KV here, so a generation longer than the window
        still rolls back exactly; the window is applied by the masks.
        """
        if total_tokens > self.max_context:
            raise ContextLengthError(
                f"prompt plus max_new_tokens is {total_tokens} tokens, more than the model's "
                f"context of {self.max_context}")

    @device_work
    @torch.inference_mode()
    def check_widths(self) -> tuple[int, ...]:
        """Measure which widths share one reduction order, and whether a forward's rows are
        the same bits beside other sequences' rows; keep the class of the widest.

        Scores the same rows at every width over an empty KV and compares the logits bitwise.
        Widths whose rows differ are dropped (with a warning): padding to a wider forward
        costs speed, a width of another class would let drafts change outputs. Then two
        sequences' steps are scored alone and together (:meth:`batch_probe`); where they
        differ, forwards carry one sequence each (:attr:`batches` False, with a warning).
        The verdict is kept on disk for the next process that runs the same computation
        (:mod:`agentspec.engine.width_cache`), which then probes nothing.
        """
        if self._widths_checked:
            return self.widths
        self._widths_checked = True
        known = _WIDTH_CLASS.setdefault(self.model, {})
        hit = known.get(self._asked())
        if hit is not None:  # probed already on another HFTarget of this model
            self._settle(*hit)
            return self.widths
        if self.fused is not None:  # its first forward: one that fails falls back here
            self._probe([0] * self.widths[0], self.widths[0])
        asked = self._asked()  # the module path's, where the fused forward fell back
        # Another process's verdict on this computation (the same shapes, dtype, device,
        # threads, software and engine code: width_cache's key), else the probe below.
        stored = width_cache.cache_file(self.model, asked, self.device)
        verdict = width_cache.read(stored)
        if verdict is not None and set(verdict[0]) <= set(self.widths) \
                and set(verdict[1]) <= set(self.prefill_widths):
            self._settle(*verdict)
            known[asked] = verdict
            return self.widths
        gen = torch.Generator().manual_seed(0)
        asked_widths, asked_prefill = self.widths, self.prefill_widths
        n = self.widths[0]
        ids = torch.randint(0, self.vocab_size, (n,), generator=gen).tolist()
        rows = {w: self._probe(ids, w) for w in self.widths}
        self.widths = tuple(w for w in self.widths if torch.equal(rows[w], rows[self.widths[-1]]))
        if self.prefill_widths:
            # A prompt chunk's rows must be the bits a decode-width forward gives them (a
            # prefix written by one call is reused by the next): a whole widest-width chain,
            # compared row for row.
            n = self.widths[-1]
            ids = torch.randint(0, self.vocab_size, (n,), generator=gen).tolist()
            ref = self._probe(ids, n)
            self.prefill_widths = tuple(w for w in self.prefill_widths
                                        if torch.equal(self._probe(ids, w), ref))
        self.forward.widths = self._all_widths()
        verdict = (self.widths, self.prefill_widths, self.batch_probe(gen))
        self._settle(*verdict, asked=(asked_widths, asked_prefill))
        known[asked] = verdict
        width_cache.write(stored, verdict)
        return self.widths

    def _asked(self) -> tuple[Any, ...]:
        """What a probe's verdict holds for: the widths asked, the device, dtype and path."""
        return (self.widths, self.prefill_widths, str(self.device),
                str(next(self.model.parameters()).dtype), self.fused is not None,
                torch.get_num_threads(),  # CPU kernels split rows by thread count
                torch.backends.mkldnn.is_available())  # the CPU's products (engine_kernels)

    def _settle(self, widths: tuple[int, ...], prefill: tuple[int, ...], batches: bool, *,
                asked: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> None:
        """Take a probe's verdict (this one's, or one kept), warning of what it drops from the
        widths ``asked`` (default: the target's now)."""
        was_widths, was_prefill = asked or (self.widths, self.prefill_widths)
        for kind, was, now in (("forward", was_widths, widths), ("prefill", was_prefill, prefill)):
            if now != was:
                warn_once(f"{self.name}: {kind} widths {sorted(set(was) - set(now))} compute "
                          f"rows in another order on this {self.device.type}; using {now}")
        if not batches:
            warn_once(f"{self.name}: a sequence's rows differ beside other sequences' on this "
                      f"{self.device.type}; every forward carries one sequence")
        self.widths, self.prefill_widths, self.batches = widths, prefill, batches
        self.forward.widths = self._all_widths()

    def _probe(self, ids: list[int], width: int) -> torch.Tensor:
        """Logits of a chain of ``ids`` over an empty KV in a forward of ``width`` rows."""
        seq = KVSequence(self.pool, cached=False)
        try:
            out = self._forward([Member(seq, ids, list(range(len(ids))), causal(len(ids)))],
                                width=width, wq=width)[0]
            assert out is not None
            return out.clone()
        finally:
            seq.release()

    def batch_probe(self, gen: torch.Generator) -> bool:
        """Whether sequences' rows are the same bits in one forward as alone: two sequences of
        other lengths (one past a block), a chain and a tree, and a prompt chunk beside them
        where the widest forward has room for it."""
        seqs = [KVSequence(self.pool, cached=False) for _ in range(3)]
        try:
            for seq, length in zip(seqs, (300, 41, 0), strict=True):
                ids = torch.randint(0, self.vocab_size, (length,), generator=gen).tolist()
                self._prefill_rows(seq, ids)
            tokens = torch.randint(0, self.vocab_size, (9,), generator=gen).tolist()
            tree = Draft(tuple(tokens[:4]), (-1, 0, 0, 2), "probe")
            chain = Draft.chain(tokens[4:7], "probe")
            makes = [lambda: draft_member(seqs[0], tokens[7], tree),
                     lambda: draft_member(seqs[1], tokens[8], chain)]
            room = self.widest - sum(self.forward.rows_taken(n) for n in (5, 4))
            chunk_len = min(70, room)
            if chunk_len > 0:
                chunk = torch.randint(0, self.vocab_size, (chunk_len,), generator=gen).tolist()
                makes.append(lambda: Member(seqs[2], chunk, list(range(chunk_len)),
                                            causal(chunk_len)))
            alone = [self._forward([make()])[0] for make in makes]
            together = self._forward([make() for make in reversed(makes)])[::-1]
            return all(a is not None and b is not None and torch.equal(a, b)
                       for a, b in zip(alone, together, strict=True))
        finally:
            for seq in seqs:
                seq.release()

    @device_work
    @torch.inference_mode()
    def run(self, members: list[Member], *, hidden: bool = False) -> list[torch.Tensor | None]:
        """One forward over the rows of ``members`` (any sequences of this target's pool): each
        member's logits ``[rows, vocab_size]``, None where it wants none (see
        :meth:`Forward.run <agentspec.engine.forward.Forward.run>`)."""
        self.check_widths()
        return self._forward(members, hidden=hidden)

    def _forward(self, members: list[Member], **kwargs: Any) -> list[torch.Tensor | None]:
        """The forward, falling back to the modules where the fused forward fails before it
        ever ran (a Triton or driver its kernels do not compile on; nothing it wrote is
        committed), with a warning."""
        try:
            out = self.forward.run(members, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a kernel that fails before it ever ran
            if self.fused is None or self._fused_ran or not self._fused_optional:
                raise
            warn_once(f"{self.name}: the fused forward failed ({type(exc).__name__}: {exc}); "
                      "running the model's modules")
            self._unfuse()
            kwargs.pop("width", None)
            kwargs.pop("wq", None)
            return self.forward.run(members, **kwargs)
        self._fused_ran = self.fused is not None
        return out

    def _unfuse(self) -> None:
        """Back to the module path, with its widths (probed again on the CPU)."""
        self.fused = None
        cuda = self.device.type == "cuda"
        self.widths, self.prefill_widths = default_widths(False, cuda)
        self.forward = Forward(self.model, self.pool, self._all_widths(),
                               sliding_window=self.sliding_window)
        self.supports_trees = compat.attention_implementation(self.model) in REPLACED
        if not cuda:
            self._widths_checked = False

    def new_sequence(self) -> KVSequence:
        """A sequence of this target's pool, for one generation (:meth:`prefill`, :meth:`run`,
        :meth:`commit_on`; ``release()`` when it ends)."""
        return KVSequence(self.pool)

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

    @device_work
    @torch.inference_mode()
    def prefill_chunks(self, seq: KVSequence, prompt_ids: Sequence[int]) -> list[list[int]]:
        """Hold what ``seq`` and the pool already have of every prompt token but the last
        (``reuse_prefix``), and return the rest in chunks of the widest width, in order."""
        self.check_widths()  # the widest width is the probe's
        wanted = list(prompt_ids[:-1])
        keep = seq.start(wanted, reuse=self.reuse_prefix)
        chunk = self.widest
        return [wanted[b : b + chunk] for b in range(keep, len(wanted), chunk)]

    def _prefill_rows(self, seq: KVSequence, ids: list[int]) -> None:
        """Write ``ids``' rows after ``seq``'s committed ones and commit them."""
        chunk = self.widest
        for b in range(0, len(ids), chunk):
            part = ids[b : b + chunk]
            self._forward([Member(seq, part, list(range(len(part))), causal(len(part)),
                                  logits=False)])
            seq.commit(part)

    @device_work
    @torch.inference_mode()
    def start(self, prompt_ids: list[int]) -> None:
        """Prepare the target's own sequence for a new generation: every prompt token but the
        last. Rows it holds or the pool has cached are kept (``reuse_prefix``); the rest is
        prefilled in chunks of the widest width, the last chunk at the narrowest width that
        holds it."""
        self.check_widths()
        for part in self.prefill_chunks(self.seq, prompt_ids):
            self._prefill_rows(self.seq, part)

    def holds(self, tokens: list[int]) -> bool:
        """Whether the target's sequence holds exactly ``tokens`` but the last one (the decode
        loop's invariant); False after another generation used it."""
        return self.seq.kv_len == len(tokens) - 1 and self.seq.ids == tokens[:-1]

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose rows the last ``start`` did not compute (held or cached)."""
        return self.seq.reused_tokens

    @property
    def kv_len(self) -> int:
        return self.seq.kv_len

    @property
    def prefix_stats(self) -> PoolStats:
        """What the pool reused and holds (:class:`~agentspec.engine.pool.PoolStats`)."""
        return self.pool.stats

    def fork(self) -> HFTarget:
        """Another target on the same weights with a pool of its own (cheap: no copy of the
        weights)."""
        twin = HFTarget(self.model, self.tokenizer, name=self.name, reuse_prefix=self.reuse_prefix,
                        widths=self.widths, cuda_graphs=self.cuda_graphs,
                        prefill_widths=self.prefill_widths,
                        prefix_cache_bytes=self.prefix_cache_bytes,
                        fused=self.fused is not None)
        twin._widths_checked, twin.batches = self._widths_checked, self.batches
        twin._identity = self._identity
        return twin

    @contextmanager
    def uncached(self) -> Iterator[None]:
        """Run the single-caller calls inside on a scratch sequence whose rows the pool never
        caches (the cost measurement's synthetic prompts are of no later call's use); the
        target's own sequence is back after."""
        own, self.seq = self.seq, KVSequence(self.pool, cached=False)
        try:
            yield
        finally:
            self.seq.release()
            self.seq = own

    @device_work
    @torch.inference_mode()
    def score(self, last_token: int, draft: Draft, *, keep_hidden: bool = False) -> torch.Tensor:
        """One forward over the last committed token and the draft, on the target's sequence.

        ``keep_hidden``: keep the forward's final hidden rows in :attr:`hidden` until the next
        forward.

        Returns:
            logits ``[num_nodes + 1, vocab_size]``: row 0 predicts after the last committed
            token, row ``i + 1`` after draft node ``i``. Rows off the draft's spine
            (:func:`~agentspec.tree.spine_length`) are exact only up to float rounding.
        """
        member = draft_member(self.seq, last_token, draft)
        self._root = last_token
        logits = self.run([member], hidden=keep_hidden)[0]
        assert logits is not None
        self.hidden, self.hidden_position = member.hidden, (self.seq.kv_len if keep_hidden else -1)
        return logits

    @device_work
    @torch.inference_mode()
    def crop(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` rows of the target's sequence: a draft model rolled
        back to a committed prefix."""
        if not 0 <= num_tokens <= self.seq.kv_len:
            raise ValueError(f"crop needs 0 <= num_tokens <= {self.seq.kv_len}, got {num_tokens}")
        self.seq.truncate(num_tokens)

    @device_work
    def commit(self, draft: Draft, verdict: Verdict) -> None:
        """Keep the root (the token :meth:`score` scored first) and the accepted path in the
        target's sequence (see :meth:`commit_on`)."""
        self.commit_on(self.seq, self._root, verdict)

    @device_work
    @torch.inference_mode()
    def commit_on(self, seq: KVSequence, root: int, verdict: Verdict) -> None:
        """Keep the root (the last committed token, scored as row 0) and the accepted path in
        ``seq``; every other draft row is dropped. A path along the spine is already in place;
        another path's rows are gathered into place on the device (no host sync)."""
        start = seq.kv_len + 1  # the root's row is now in the KV
        path = list(verdict.path)
        if path != list(range(len(path))):
            seq.move_rows([start + i for i in path], list(range(start, start + len(path))))
        seq.commit([root, *verdict.accepted])
