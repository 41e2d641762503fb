"""The one module that touches transformers' internals, and the versions and architectures
the engine was tested on.

Importing it checks the installed torch and transformers against :data:`SUPPORTED` (the
range ``pyproject.toml`` pins and ``make test-compat`` tests the low end of) and raises
:class:`~agentspec.errors.UnsupportedVersionError` outside it; ``AGENTSPEC_ALLOW_UNTESTED=1``
turns that (and the architecture check, :func:`check_architecture`) into a warning.

What the engine relies on, all here:

- the attention registry (``AttentionInterface``, ``ALL_MASK_ATTENTION_FUNCTIONS``) and the
  sdpa attention function the engine's attention falls back to;
- ``config._attn_implementation`` (read, and switched from sdpa or eager for one forward);
- a decoder layer calling ``past_key_values.update(key, value, layer_idx)`` on the cache it is
  given (:class:`~agentspec.engine.kv.PoolCache` duck-types it), with explicit position ids and
  a 4-D boolean mask (a ``{layer_type: mask}`` dict where some layers slide, one mask where
  all do), and the attention function called with ``scaling`` and ``softcap``;
- ``sliding_window`` and ``layer_types`` in the config (:func:`sliding_window`);
- ``model.model`` and its ``layers`` (the fused forward's weights, the layer-skip draft);
- ``generation_config`` (the stop tokens, a static cache);
- ``DynamicCache`` and its ``crop`` (the draft head's training replay);
- ``AutoModelForCausalLM`` / ``AutoTokenizer`` / ``AutoConfig.from_pretrained`` with ``dtype``,
  ``gguf_file`` and the hub's cache (and the GGUF quantizer dropped after dequantising).
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from agentspec.errors import UnsupportedModelError, UnsupportedVersionError

SUPPORTED: dict[str, tuple[str, str]] = {
    "torch": ("2.11", "2.14"),
    "transformers": ("5.17", "5.24"),
}
"""Tested releases ``[lowest, below)`` per package: the low end is what ``make test-compat``
runs (the GPU machines' CUDA torch 2.11 and transformers 5.17), the high end what
``make test`` runs (torch 2.13, transformers 5.23). ``pyproject.toml`` pins the same."""

ALLOW_UNTESTED = "AGENTSPEC_ALLOW_UNTESTED"


@dataclass(frozen=True)
class Architecture:
    """A model family the engine loads (by ``config.model_type``)."""

    model_type: str
    family: str  # as the README lists it
    tested: str  # the checkpoints the test suite runs it on
    fused: bool  # covered by the fused CUDA forward (agentspec.engine.fused)


TINY = "tiny random"
"""What ``tested`` says of a family the architecture matrix runs on a tiny random checkpoint
built from its transformers config (``tests/integration/test_families.py``)."""

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", "Llama (Llama 2/3/3.1/3.2, SmolLM/SmolLM2, TinyLlama)",
                 f"SmolLM2-135M-Instruct; {TINY}, with and without Llama 3's rope scaling",
                 fused=True),
    Architecture("qwen2", "Qwen2, Qwen2.5", TINY, fused=True),
    Architecture("qwen3", "Qwen3 (dense)", TINY, fused=True),
    Architecture("mistral", "Mistral", f"{TINY}, with and without a sliding window",
                 fused=True),
    Architecture("phi3", "Phi-3, Phi-3.5, Phi-4-mini", f"{TINY}, with and without a sliding window",
                 fused=True),
    Architecture("granite", "Granite 3", TINY, fused=True),
    Architecture("olmo2", "OLMo 2", TINY, fused=True),
    Architecture("gemma3_text", "Gemma 3 text (sliding-window layers)",
                 f"Gemma-3-270M; {TINY}", fused=False),
    Architecture("gemma2", "Gemma 2 (sliding-window layers, logit soft-capping)", TINY,
                 fused=False),
)}
"""What :func:`~agentspec.engine.load.load_target` loads: decoder-only causal LMs whose layers
write their KV through the cache's ``update`` and take the engine's masks, each run by the
architecture matrix (``tests/integration/test_families.py``: greedy output equal to
``generate``, drafts and memory changing nothing in fp32 and bf16, prefix reuse, chunked
prefill and sliding windows) on a tiny random checkpoint of its transformers config; Llama
and Gemma 3 also run the whole suite on real checkpoints. Any other ``model_type`` is refused
(:func:`check_architecture`)."""


def _release(text: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(text).release


def _untested_allowed() -> bool:
    return os.environ.get(ALLOW_UNTESTED, "").strip().lower() in ("1", "true", "yes", "on")


def _refuse(error: type[Exception], message: str) -> None:
    """Raise ``error(message)``, or only warn under ``AGENTSPEC_ALLOW_UNTESTED=1``."""
    if _untested_allowed():
        warnings.warn(message, stacklevel=3)
        return
    raise error(message)


def version_problems(installed: dict[str, str] | None = None) -> list[str]:
    """What is outside :data:`SUPPORTED` among ``installed`` (default: the installed
    releases), one sentence each naming the installed and the supported versions."""
    if installed is None:
        installed = {}
        for package in SUPPORTED:
            try:
                installed[package] = version(package)
            except PackageNotFoundError:
                installed[package] = "not installed"
    problems = []
    for package, (low, high) in SUPPORTED.items():
        got = installed.get(package, "not installed")
        if got == "not installed":
            problems.append(f"{package} is not installed (agentspec supports {package}>={low},<{high})")
            continue
        release = _release(got)[:2]
        if not _release(low) <= release < _release(high):
            problems.append(f"{package} {got} is installed; agentspec supports "
                            f"{package}>={low},<{high}")
    return problems


def check_versions(installed: dict[str, str] | None = None) -> None:
    """Refuse a torch or transformers outside :data:`SUPPORTED` (the engine reads
    transformers' internals, which change between releases).

    Raises:
        UnsupportedVersionError: one is outside; the message names the installed and the
            supported versions and the way out (a warning under ``AGENTSPEC_ALLOW_UNTESTED=1``).
    """
    problems = version_problems(installed)
    if not problems:
        return
    message = ("; ".join(problems) + ". Install a supported release (pip install "
               + " ".join(f"'{p}>={lo},<{hi}'" for p, (lo, hi) in SUPPORTED.items())
               + f"), or set {ALLOW_UNTESTED}=1 to run untested")
    _refuse(UnsupportedVersionError, message)


def check_transformers_at_least(low: str, what: str, why: str,
                                installed: str | None = None) -> None:
    """Refuse ``what`` under a transformers older than ``low`` (inside :data:`SUPPORTED`, but
    below what ``what`` was tested on); ``why`` says what goes wrong there.

    Raises:
        UnsupportedVersionError: the installed release is older (a warning under
            ``AGENTSPEC_ALLOW_UNTESTED=1``).
    """
    got = installed if installed is not None else version("transformers")
    if _release(got)[:2] >= _release(low):
        return
    message = (f"{what} needs transformers>={low}: under transformers {got} {why}. Install "
               f"'transformers>={low},<{SUPPORTED['transformers'][1]}', or set "
               f"{ALLOW_UNTESTED}=1 to run untested")
    _refuse(UnsupportedVersionError, message)


check_versions()


def check_architecture(config: Any, source: str) -> Architecture | None:
    """The table's entry for a model's config, or a clear error for a family not in it.

    Raises:
        UnsupportedModelError: ``config.model_type`` is not in :data:`ARCHITECTURES` (not
            under ``AGENTSPEC_ALLOW_UNTESTED=1``: a warning, and None); the message names it
            and the supported ones.
    """
    kind = getattr(config, "model_type", None)
    entry = ARCHITECTURES.get(str(kind))
    if entry is not None:
        return entry
    names = ", ".join(getattr(config, "architectures", None) or []) or "no architectures entry"
    message = (f"{source}: model type {kind!r} ({names}) is not supported; agentspec loads "
               f"{', '.join(sorted(ARCHITECTURES))} (see the README's supported architectures); "
               f"set {ALLOW_UNTESTED}=1 to try it untested")
    _refuse(UnsupportedModelError, message)
    return None


# -- loading --------------------------------------------------------------------------------

def load_config(source: str, **kwargs: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source, **kwargs)


def load_causal_lm(source: str, dtype: Any, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)


def load_tokenizer(source: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, **kwargs)


def drop_quantizer(model: Any) -> None:
    """A model dequantised from a GGUF: drop the quantizer so its plain weights can be saved."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


# -- the model's structure ------------------------------------------------------------------

def base_model(model: Any) -> Any:
    """The decoder under a causal LM's head (``model.model``; the model itself if none)."""
    return getattr(model, "model", model)


def decoder_layers(model: Any) -> Any:
    """The decoder layers (a ``ModuleList``) of a causal LM."""
    return base_model(model).layers


def set_decoder_layers(model: Any, layers: Any) -> None:
    base_model(model).layers = layers


def kv_shapes(model: Any) -> list[tuple[int, int, Any]]:
    """Each decoder layer's ``(kv_heads, head_dim, dtype)``: the KV pool's buffers."""
    config = getattr(model.config, "text_config", None) or model.config
    dtype = next(model.parameters()).dtype
    out = []
    for layer in decoder_layers(model):
        attn = layer.self_attn
        dim = int(attn.head_dim)
        groups = int(getattr(attn, "num_key_value_groups", 1))
        out.append((int(config.num_attention_heads) // groups, dim, dtype))
    return out


def eos_token_ids(model: Any) -> Any:
    """``generation_config.eos_token_id``: an int, a list of them or None."""
    return model.generation_config.eos_token_id


def set_eos_token_ids(model: Any, ids: Any) -> None:
    model.generation_config.eos_token_id = ids


def static_cache(model: Any) -> bool:
    """Whether the model's generation config asks for a static KV (which cannot roll back)."""
    return getattr(model.generation_config, "cache_implementation", None) == "static"


def sliding_window(model: Any) -> tuple[int | None, bool]:
    """The model's attention window (None without one) and whether every layer has it.

    Models that list their layers' types (Gemma 2 and 3, Qwen2 and 3) slide the layers marked
    ``sliding_attention`` only; Mistral and Phi-3 list none and slide every layer whenever
    ``sliding_window`` is set (their masks are built by transformers' sliding-window mask)."""
    config = getattr(model.config, "text_config", None) or model.config
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if not window or (layer_types and "sliding_attention" not in layer_types):
        return None, False
    return int(window), not layer_types or all(t == "sliding_attention" for t in layer_types)


def takes_mask_dict(model: Any) -> bool:
    """Whether the model's forward takes ``{layer_type: mask}`` as its attention mask (the
    transformers models with sliding-window layers do, e.g. gemma3)."""
    try:
        source = inspect.getsource(type(base_model(model)).forward)
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in source


# -- attention ------------------------------------------------------------------------------

def attention_implementation(model: Any) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


@contextmanager
def attention_switched(model: Any, name: str,
                       when: tuple[str, ...] = ("sdpa",)) -> Iterator[None]:
    """Run the forwards inside on the registered attention ``name`` where the model is on one
    of ``when``, and back on its own after."""
    config = model.config
    own = getattr(config, "_attn_implementation", None)
    if own not in when:
        yield
        return
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = own


def register_attention(name: str, function: Any) -> None:
    """Register ``function`` as attention ``name``, with sdpa's mask builder."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


def sdpa_attention(*args: Any, **kwargs: Any) -> Any:
    """transformers' own sdpa attention function (the engine's attention's fallback)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


# -- the draft head's training replay -------------------------------------------------------

def new_dynamic_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def crop_cache(cache: Any, keep: int) -> None:
    """Keep a ``DynamicCache``'s first ``keep`` tokens (transformers 5's ``crop`` takes a
    negative count of tokens to remove)."""
    cache.crop(keep - cache.get_seq_length())
