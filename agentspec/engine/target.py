"""The target model and its KV state.

``HFTarget`` keeps the invariant of the decode loop: between steps the KV holds every committed
token but the last one. ``score`` runs one forward over the last committed token and a draft
(chain or tree); ``commit`` keeps the accepted path's KV rows and drops the rest.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from agentspec.engine import compat, malloc, prefix
from agentspec.engine.forward import FixedForward
from agentspec.engine.kv import FixedKV
from agentspec.errors import UnsupportedModelError, warn_once
from agentspec.tree import ancestor_matrix, common_prefix_len, depths
from agentspec.types import Draft, Verdict

# The CPU's forward widths. A draft is scored at the narrowest width that holds it, so every
# width is a step of the cost curve the policy sizes drafts on; on a CPU a forward's time grows
# with its rows, and with powers of two only a draft just past one paid for twice the rows.
# The steps between let the policy draft as far as a copy is worth (BENCHMARKS.md has the
# side-by-side figures). Every width computes a row's bits alike (oneDNN's pointwise products,
# from 2 rows), and check_widths drops any that does not.
CPU_WIDTHS = (2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
# Prompt chunks: 256 rows, and the last chunk at the narrowest width that holds it. An agent's
# call adds a tail (a user turn, a tool's result) to a prompt whose prefix is in the KV; the
# widths between 96 and 256 keep a short tail from paying for a whole 256-row chunk.
CPU_PREFILL_WIDTHS = (96, 128, 160, 192, 256)
# The fused forward's widths (agentspec.engine.fused): its products are fixed tiles of 16 rows,
# so every multiple of 16 computes a row's bits alike, and prompt chunks can be far wider than
# steps. A graph is captured per width.
FUSED_WIDTHS = (16, 32, 64)
FUSED_PREFILL_WIDTHS = (128, 256, 512)


def _default_widths(fused: bool, cuda: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The default forward and prefill widths of the fused forward, or of the modules on
    CUDA (one width) or on the CPU."""
    if fused:
        return FUSED_WIDTHS, FUSED_PREFILL_WIDTHS
    return ((64,), ()) if cuda else (CPU_WIDTHS, CPU_PREFILL_WIDTHS)


def ordered_widths(widths: Sequence[int], name: str = "widths", shown: str | None = None) -> tuple[int, ...]:
    """``widths`` as a tuple, checked: distinct positive integers, smallest first (or none).

    Raises:
        ValueError: they are not; the message names ``name`` and shows ``shown`` (default the
            widths themselves).
    """
    out = tuple(widths)
    if out and (out[0] < 1 or list(out) != sorted(set(out))):
        raise ValueError(f"{name} must be distinct positive integers, smallest first, "
                         f"got {out if shown is None else shown}")
    return out


# The target whose ``score`` forward is running in this thread (its hidden rows are kept).
_CAPTURING = threading.local()

# check_widths results per model: one probe per loaded model, not per HFTarget over it.
_WIDTH_CLASS: weakref.WeakKeyDictionary[
    Any, dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]]] = (
    weakref.WeakKeyDictionary())


# Config entries that say where and how a model was loaded, not what it is: the folder it was
# read from (another user's $AGENTSPEC_HOME, a moved cache), the transformers release that
# wrote the config, the dtype it was loaded in.
_NOT_IDENTITY = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")


def fingerprint(name: str, model: Any, tokenizer: Any) -> str:
    """Model + tokenizer identity: memory entries of another fingerprint are never drafted from.

    The same model loaded from another folder, by another transformers release or in another
    dtype has the same fingerprint, so agents on several machines share one memory's rows and
    heads (outputs still depend on the dtype; drafts are only drafts)."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    for key in _NOT_IDENTITY:
        config.pop(key, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return f"{name}:{h.hexdigest()[:16]}"


class HFTarget:
    """A transformers causal LM and the KV of the one generation in progress (batch size 1).

    Every forward runs at a width from :attr:`widths` over a :class:`~agentspec.engine.kv.FixedKV`
    (see :mod:`agentspec.engine.forward`), so a committed token's logits and KV rows are bitwise the
    same whatever the drafts: the output is a pure function of the request, in bf16 too.

    Args:
        reuse_prefix: keep the KV rows of the longest common prefix between a new prompt and
            what the KV already holds: the calls of an agent share their system prompt, tool
            docs and earlier turns, so most of a prompt's prefill is skipped. The rows are the
            same bits a fresh prefill computes (``tests/integration/test_invariance.py``).
        widths: the forward widths, smallest first, all of one reduction class. Default on
            the CPU :data:`CPU_WIDTHS` (2 to 64 rows; a 1-row product runs another kernel than
            2+ rows), checked on first use (:meth:`check_widths`). On CUDA one width, 64,
            captured as a CUDA graph (cuBLAS picks kernels by row count; the forward is
            launch-bound anyway).
        cuda_graphs: capture the forwards as CUDA graphs (CUDA only; default on).
        prefill_widths: wider forwards for prompt chunks only, kept where they compute the
            same bits as the widest of ``widths`` (:meth:`check_widths`). Default on the CPU
            :data:`CPU_PREFILL_WIDTHS` (a wide chunk costs far less per token than a 64-row
            one); none on CUDA, where a captured 64-row graph is cheap.
        fused: the fused forward (:mod:`agentspec.engine.fused`: a Llama-family model in six
            Triton kernels a layer instead of its modules): ``None`` (default) on CUDA where
            the model is covered, falling back to the modules (with a warning) if its kernels
            fail; ``True``: required (a clear error where the model is not covered; on the
            CPU only under Triton's interpreter, for tests); ``False``: the modules. Its
            default widths are :data:`FUSED_WIDTHS` and :data:`FUSED_PREFILL_WIDTHS`.
        prefix_cache_bytes: the budget of the prefix cache (:mod:`agentspec.engine.prefix`): rows
            of earlier calls that a new prompt would overwrite are kept, in blocks of 64
            tokens, and a later prompt that starts with them gets them back instead of
            prefilling them (interleaved agents, tool sets and conversations each keep their
            system prompt's rows). ``None``: 512 MiB; 0: off (and off without
            ``reuse_prefix``). Exact: the same rows a prefill computes.
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
        if fused or (fused is None and cuda):
            from agentspec.engine.fused.llama import select

            self.fused = select(model, required=bool(fused))
        default, default_wide = _default_widths(self.fused is not None, cuda)
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
        self._kv_ids: list[int] = []  # the token ids whose rows the KV holds, in order
        budget = prefix.DEFAULT_BYTES if prefix_cache_bytes is None else prefix_cache_bytes
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"prefix_cache_bytes must be an int >= 0, got {prefix_cache_bytes!r}")
        self.prefix_cache = prefix.PrefixCache(budget) if budget and reuse_prefix else None
        # Prompt tokens whose rows the last ``start`` did not compute (held or restored).
        self.reused_tokens = 0
        self._root = -1  # the last committed token, scored by ``score``
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._fingerprint: str | None = None
        self._fused_optional = fused is None
        self._fused_ran = False
        self._kv: FixedKV | None = None
        self._kv_len = 0
        self._forwards: dict[int, FixedForward] = {}
        self._widths_checked = widths is not None and len(self.widths) == 1 and not self.prefill_widths
        # Set by a drafter that reads the target's final hidden state (the draft head): then
        # ``score`` keeps ``hidden`` [rows, hidden], row r at position ``hidden_position + r``.
        # Read only (a hook on the output embedding's input): never used to decide a token.
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        self.hidden_position = -1
        self._hook: Any = None
        self._lm_input: torch.Tensor | None = None
        self._refuse_unrollbackable()
        # Tree drafts need a custom boolean 4-D mask: sdpa takes it as is (eager would add it as
        # numbers, so other attention paths verify chains);
        # sliding-window models also need a mask per layer type.
        attention = compat.attention_implementation(model)
        self.supports_trees = attention == "sdpa" or self.fused is not None
        if not self.supports_trees:
            warn_once(f"{name}: {attention} attention cannot take a tree mask; verifying chains only")
        if self.supports_trees and self.sliding_window is not None and not compat.takes_mask_dict(model):
            warn_once(f"{name}: sliding-window layers cannot take a tree mask; verifying chains only")
            self.supports_trees = False

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.name, self.model, self.tokenizer)
        return self._fingerprint

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a generation: the model's generation config's and the
        tokenizer's end-of-sequence ids."""
        ids: set[int] = set()
        for source in (compat.eos_token_ids(self.model), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        return frozenset(ids)

    @property
    def max_draft_nodes(self) -> int:
        """The most draft nodes one forward scores (the root takes a row)."""
        return self.widths[-1] - 1

    def _refuse_unrollbackable(self) -> None:
        cfg = self.model.config
        text_cfg = getattr(cfg, "text_config", None) or cfg
        window = getattr(text_cfg, "sliding_window", None)
        layer_types = getattr(text_cfg, "layer_types", None) or []
        self.sliding_window = int(window) if window and "sliding_attention" in layer_types else None
        if compat.static_cache(self.model):
            raise UnsupportedModelError(f"{self.name}: a static KV cannot be rolled back per path")

    def check_length(self, total_tokens: int) -> None:
        """Refuse a generation whose KV would outgrow what the model can attend.

        Sliding-window layers keep their full KV here, so a generation longer than the window
        still rolls back exactly; the window is applied by the masks.
        """
        if total_tokens > self.max_context:
            raise ValueError(
                f"prompt plus max_new_tokens is {total_tokens} tokens, more than the model's "
                f"context of {self.max_context}")

    @torch.inference_mode()
    def check_widths(self) -> tuple[int, ...]:
        """Measure which widths share one reduction order; keep the class of the widest.

        Scores the same rows at every width over an empty KV and compares the logits bitwise.
        Widths whose rows differ are dropped (with a warning): padding to a wider forward
        costs speed, a width of another class would let drafts change outputs.
        """
        if not self._widths_checked:
            self._widths_checked = True
            known = _WIDTH_CLASS.setdefault(self.model, {})
            asked = (self.widths, self.prefill_widths, str(self.device),
                     str(next(self.model.parameters()).dtype),
                     torch.get_num_threads())  # CPU kernels split rows by thread count
            if asked in known:  # probed already on another HFTarget of this model
                self.widths, self.prefill_widths = known[asked]
                return self.widths
            if self.fused is not None:  # its first forward: one that fails falls back here
                n = self.widths[0]
                self._forward_rows([0] * n, list(range(n)), np.tril(np.ones((n, n), dtype=bool)))
            gen = torch.Generator().manual_seed(0)
            n = self.widths[0]
            ids = torch.randint(0, self.vocab_size, (n,), generator=gen).tolist()
            anc = np.tril(np.ones((n, n), dtype=bool))
            rows = {w: self._forward_rows(ids, list(range(n)), anc, width=w) for w in self.widths}
            same = tuple(w for w in self.widths if torch.equal(rows[w], rows[self.widths[-1]]))
            if same != self.widths:
                warn_once(f"{self.name}: forward widths {sorted(set(self.widths) - set(same))} "
                          f"compute rows in another order on this {self.device.type}; using {same}")
                self.widths = same
            if self.prefill_widths:
                # A prompt chunk's rows must be the bits a decode-width forward gives them (a
                # prefix written by one call is reused by the next): a whole widest-width
                # chain, compared row for row.
                n = self.widths[-1]
                ids = torch.randint(0, self.vocab_size, (n,), generator=gen).tolist()
                anc = np.tril(np.ones((n, n), dtype=bool))
                ref = self._forward_rows(ids, list(range(n)), anc, width=n)
                kept = tuple(w for w in self.prefill_widths if torch.equal(
                    self._forward_rows(ids, list(range(n)), anc, width=w), ref))
                if kept != self.prefill_widths:
                    warn_once(f"{self.name}: prefill widths "
                              f"{sorted(set(self.prefill_widths) - set(kept))} compute rows in "
                              f"another order on this {self.device.type}; using {kept}")
                    self.prefill_widths = kept
            known[asked] = (self.widths, self.prefill_widths)
        return self.widths

    def _forward_rows(self, ids: list[int], depth: list[int], anc: np.ndarray, *,
                      width: int | None = None, logits: bool = True) -> torch.Tensor:
        """Logits ``[len(ids), vocab_size]`` of rows written at slots ``kv_len + row``
        (``logits=False``: the KV rows are what counts; the logits may be fewer)."""
        n = len(ids)
        if width is None:
            width = next((w for w in (*self.widths, *self.prefill_widths) if w >= n), None)
            if width is None:
                widest = (self.prefill_widths or self.widths)[-1]
                raise ValueError(f"a forward of {n} rows is wider than the widest, {widest}")
        self._reserve(self._kv_len + width)
        forward = self._forwards.get(width)
        if forward is None:
            assert self._kv is not None
            forward = FixedForward(self.model, self._kv, width, sliding_window=self.sliding_window,
                                   fused=self.fused)
            self._forwards[width] = forward
        forward.load(ids, depth, anc, self._kv_len)
        try:
            if self.cuda_graphs and not forward.captured:
                try:
                    forward.capture()
                except RuntimeError as exc:  # the same forward still runs eagerly, just slower
                    if self.fused is not None and not self._fused_ran:
                        raise
                    warn_once(f"{self.name}: CUDA graph capture failed ({exc}); running eagerly")
                    self.cuda_graphs = False
            out = forward.run(logits=logits)[:n]
        except Exception as exc:  # noqa: BLE001 - a kernel that fails before it ever ran
            if self.fused is None or self._fused_ran or not self._fused_optional:
                raise
            warn_once(f"{self.name}: the fused forward failed ({type(exc).__name__}: {exc}); "
                      "running the model's modules")
            self._unfuse()
            return self._forward_rows(ids, depth, anc, logits=logits)
        self._fused_ran = self.fused is not None
        return out

    def _unfuse(self) -> None:
        """Back to the module path, with its widths (the fused forward's first run failed:
        nothing it wrote is committed)."""
        self.fused = None
        self._forwards.clear()
        cuda = self.device.type == "cuda"
        self.widths, self.prefill_widths = _default_widths(False, cuda)
        if not cuda:  # the CPU's widths are probed again (check_widths)
            self._widths_checked = False

    def _reserve(self, rows: int) -> None:
        """Grow the KV to hold ``rows`` rows (the committed rows are copied over). The rows of
        a forward do not depend on the capacity, so growing never changes an output; on CUDA
        it re-captures the graphs, and says so."""
        capacity = self._kv.capacity if self._kv is not None else 0
        if rows <= capacity:
            return
        step = 1024 if self.device.type == "cuda" else 256
        new = -(-max(rows, capacity + capacity // 2, 512) // step) * step
        if self._kv is None:
            self._kv = FixedKV(new)
        else:
            self._kv = self._kv.resized(new, self._kv_len)
            if self.cuda_graphs:
                warn_once(f"{self.name}: KV capacity grown from {capacity} to {new} tokens; "
                          "CUDA graphs are captured again")
        self._forwards.clear()

    @torch.inference_mode()
    def start(self, prompt_ids: list[int]) -> None:
        """Prepare the KV for a new generation: every prompt token but the last.

        Rows of the longest common prefix with what the KV holds are kept (``reuse_prefix``);
        only the rest of the prompt is prefilled, in chunks of the widest width (a prefill
        width where one is kept), the last chunk in the narrowest width that holds it.
        """
        self.check_widths()
        wanted = list(prompt_ids[:-1])
        keep = common_prefix_len(self._kv_ids, wanted) if self.reuse_prefix else 0
        cache = self.prefix_cache
        if cache is not None and self._kv is not None:
            if not prefix.uniform_layers(self._kv.keys):
                warn_once(f"{self.name}: KV layers of different shapes; no prefix cache")
                cache = self.prefix_cache = None
            else:
                if keep < len(self._kv_ids):  # rows this prompt overwrites: kept for later
                    cache.save(self._kv_ids, self._kv.keys, self._kv.values)
                chain = cache.longest(wanted)
                if len(chain) * prefix.BLOCK > keep:
                    self._kv_len = keep
                    self._reserve(len(chain) * prefix.BLOCK)
                    assert self._kv is not None
                    keep = cache.restore(chain, self._kv.keys, self._kv.values, held=keep)
        self._kv_len, self._kv_ids = keep, wanted[:keep]
        self.reused_tokens = keep
        chunk = (self.prefill_widths or self.widths)[-1]
        causal = np.tril(np.ones((chunk, chunk), dtype=bool))
        for begin in range(keep, len(wanted), chunk):
            ids = wanted[begin : begin + chunk]
            self._forward_rows(ids, list(range(len(ids))), causal[: len(ids), : len(ids)],
                               logits=False)
            self._kv_len += len(ids)
            self._kv_ids.extend(ids)

    def holds(self, tokens: list[int]) -> bool:
        """Whether the KV holds exactly ``tokens`` but the last one (the decode loop's
        invariant); False after another generation used this target."""
        return len(self._kv_ids) == len(tokens) - 1 and self._kv_ids == tokens[:-1]

    def fork(self) -> HFTarget:
        """Another target on the same weights with a KV (and a prefix cache) of its own
        (cheap: no copy of the weights)."""
        twin = HFTarget(self.model, self.tokenizer, name=self.name, reuse_prefix=self.reuse_prefix,
                        widths=self.widths, cuda_graphs=self.cuda_graphs,
                        prefill_widths=self.prefill_widths,
                        prefix_cache_bytes=self.prefix_cache.max_bytes if self.prefix_cache else 0,
                        fused=self.fused is not None)
        twin._widths_checked = self._widths_checked
        return twin

    @torch.inference_mode()
    def score(self, last_token: int, draft: Draft, *, keep_hidden: bool = False) -> torch.Tensor:
        """One forward over the last committed token and the draft.

        ``keep_hidden`` (or :attr:`keep_hidden` set by a drafter that reads them): keep the
        forward's final hidden rows in :attr:`hidden` until the next forward.

        Returns:
            logits ``[num_nodes + 1, vocab_size]``: row 0 predicts after the last committed
            token, row ``i + 1`` after draft node ``i``. Rows off the draft's spine
            (:func:`~agentspec.tree.spine_length`) are exact only up to float rounding.
        """
        self.check_widths()
        self._root = last_token
        n = draft.num_nodes
        anc = np.zeros((n + 1, n + 1), dtype=bool)
        anc[:, 0] = True
        anc[1:, 1:] = ancestor_matrix(draft.parents)
        depth = [0, *depths(draft.parents)]
        keep = keep_hidden or self.keep_hidden
        if keep and self._hook is None:
            self._hook = self.model.get_output_embeddings().register_forward_pre_hook(
                self._keep_lm_input)
        self._lm_input = None
        _CAPTURING.target = self if keep else None
        try:
            logits = self._forward_rows([last_token, *draft.token_ids], depth, anc)
        finally:
            _CAPTURING.target = None
        lm_input, self._lm_input = self._lm_input, None
        if keep and lm_input is not None:
            self.hidden = lm_input[0, : n + 1]  # [num_nodes + 1, hidden]
            self.hidden_position = self._kv_len
        else:
            self.hidden, self.hidden_position = None, -1
        return logits

    def _keep_lm_input(self, module: Any, args: tuple[Any, ...]) -> None:
        # The output embedding is the model's, shared by every fork and by other code (the
        # bench's transformers baselines): keep only this target's own scoring forward, in
        # this thread, not another's that passes through the same module meanwhile.
        if getattr(_CAPTURING, "target", None) is self:
            self._lm_input = args[0]  # [1, rows, hidden]: the final hidden states

    @torch.inference_mode()
    def crop(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` KV rows: a draft model rolled back to a committed prefix."""
        if not 0 <= num_tokens <= self._kv_len:
            raise ValueError(f"crop needs 0 <= num_tokens <= {self._kv_len}, got {num_tokens}")
        self._kv_len = num_tokens
        del self._kv_ids[num_tokens:]

    @torch.inference_mode()
    def commit(self, draft: Draft, verdict: Verdict) -> None:
        """Keep the root and the accepted path in the KV; drop every other draft row.

        A path along the spine is already in place; another path's rows are gathered into
        place on the device (no host sync).
        """
        root_end = self._kv_len + 1  # the root's row is now in the KV
        path = list(verdict.path)
        if path != list(range(len(path))) and self._kv is not None:
            src = torch.tensor([root_end + i for i in path], device=self.device)
            dst = torch.arange(root_end, root_end + len(path), device=self.device)
            for buf in (*self._kv.keys, *self._kv.values):
                buf.index_copy_(2, dst, buf.index_select(2, src))
        self._kv_len = root_end + len(path)
        self._kv_ids.append(self._root)
        self._kv_ids.extend(verdict.accepted)

    @property
    def kv_len(self) -> int:
        return self._kv_len

