"""Loading a target model: packaged models, model folders, ``.gguf`` files, hub ids.

A packaged model (:mod:`agentspec.engine.packages`) is dequantised once into safetensors under
``$AGENTSPEC_HOME/models`` and loaded from there afterwards; a base model's GGUF that carries
no chat template gets its family's turn format. A hub id (``org/name``) goes through
transformers' own download and cache (``HF_HOME``, ``HF_HUB_OFFLINE``). Every model's
architecture is checked against :data:`agentspec.engine.compat.ARCHITECTURES` before its
weights load.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agentspec.engine import compat
from agentspec.engine.packages import (  # noqa: F401 - GEMMA_TURNS: where it was before
    GEMMA_TURNS,
    PACKAGED,
    PACKAGED_MODELS,
    PackagedModel,
    not_installed,
)
from agentspec.engine.target import HFTarget
from agentspec.engine.torch_thread import for_device
from agentspec.errors import ModelNotAvailableError, NotFoundError
from agentspec.home import model_dir

_MARKER = "agentspec-converted.json"
# ``org/name``: a hub id (when no such path exists here).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
QUANTIZED = ("gguf", "quantized")
"""The ``dtype`` names of a GGUF's own quantization: its weights held as the file stores them
(:mod:`agentspec.engine.quant`), products over them in float32."""


def quantized(dtype: Any) -> bool:
    """Whether ``dtype`` names the file's own quantization (:data:`QUANTIZED`)."""
    return isinstance(dtype, str) and dtype.lower() in QUANTIZED


def as_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype`` as a floating torch dtype: a ``torch.dtype`` or a name (``"bfloat16"``,
    ``"float32"``, ``"float16"``, ``"torch.bfloat16"``, ``"bf16"``...); None stays None.

    Raises:
        ValueError: anything else (the message names it and the accepted names; a GGUF's own
            quantization, :data:`QUANTIZED`, is no torch dtype: see :func:`quantized`).
    """
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype must be torch.float32, torch.bfloat16, torch.float16 or one of "
                     f"{', '.join(repr(k) for k in (*DTYPES, *QUANTIZED))}, got {dtype!r}")


def as_device(device: Any) -> str:
    """``device`` (a string, a ``torch.device`` or None: CUDA when torch sees a GPU, else the
    CPU) as a device string, checked.

    Raises:
        ValueError: not a device, or a CUDA device where torch sees none.
    """
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', "
                         f"got {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU build)"
        raise ValueError(f"device {device!r}: torch {torch.__version__} ({build}) sees no CUDA GPU")
    return str(resolved)


def _packaged_gguf(name: str) -> Path:
    """Locate (or assemble) the GGUF of a packaged model without importing the package."""
    entry = PACKAGED_MODELS[name]
    pkg_dir = entry.package_dir()
    if pkg_dir is None:
        raise not_installed(entry)
    if entry.gguf_name is not None:
        path = pkg_dir / entry.gguf_name
        if not path.exists():
            raise not_installed(entry, f"is broken ({path} is missing)")
        return path
    try:
        module = importlib.import_module(entry.package)  # only the chunk assembler imports
        out = model_dir() / f"{name}.gguf"
        return Path(module.assemble(out))
    except (ImportError, FileNotFoundError) as exc:
        raise not_installed(entry, f"is not fully installed ({exc})") from exc


def gguf_file(name_or_path: str) -> Path:
    """The GGUF file behind a packaged model's name, or ``name_or_path`` itself when it is a
    ``.gguf`` file: what another engine (llama.cpp) loads to run the same weights.

    Raises:
        ValueError: neither (a model folder or a hub id has no GGUF file); the message names it.
    """
    if name_or_path in PACKAGED_MODELS:
        return _packaged_gguf(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ValueError(f"{name_or_path!r} is neither a packaged model nor a .gguf file; "
                     f"packaged: {', '.join(PACKAGED_MODELS)}")


def _keep(out_dir: Path, parts: Sequence[Any], marker: dict[str, str]) -> None:
    """Save ``parts`` (each with ``save_pretrained``) and the marker into ``out_dir`` at once:
    written beside it, then renamed (a concurrent writer either wins or finds it done)."""
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}-{id(out_dir)}")
    shutil.rmtree(tmp, ignore_errors=True)
    for part in parts:
        part.save_pretrained(str(tmp))
    (tmp / _MARKER).write_text(json.dumps(marker))
    try:
        tmp.rename(out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF once and keep safetensors + config + tokenizer in ``out_dir``."""
    tokenizer = compat.load_tokenizer(str(gguf.parent), gguf_file=gguf.name)
    model = compat.load_causal_lm(str(gguf.parent), torch.float32, gguf_file=gguf.name)
    compat.drop_quantizer(model)  # the dequantised weights are plain tensors now
    _keep(out_dir, [model, tokenizer], {"source": str(gguf)})


def _check_packaged(name: str) -> None:
    """A packaged model's transformers floor, where it has one."""
    entry = PACKAGED_MODELS[name]
    if entry.min_transformers is not None:
        compat.check_transformers_at_least(entry.min_transformers, f"the packaged {name}",
                                           entry.below_min)


def resolve_model(name_or_path: str) -> tuple[str, str]:
    """``(name, source)``: the model's name (its fingerprint's) and what transformers'
    ``from_pretrained`` loads it from: a packaged name's converted folder, a model folder, a
    ``.gguf`` file's converted folder, or a hub id (``org/name``, when no such path exists).

    Raises:
        ModelNotAvailableError: a packaged model that is not installed.
        UnsupportedVersionError: a packaged model whose conversion needs a newer transformers.
        NotFoundError: none of these (the message lists what is accepted).
    """
    if name_or_path in PACKAGED_MODELS:
        _check_packaged(name_or_path)
        out = model_dir() / name_or_path
        if not (out / _MARKER).exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(_packaged_gguf(name_or_path), out)
        return name_or_path, str(out)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {str(path)!r} holds no config.json (a transformers "
                             "model folder: config.json, weights and tokenizer files)")
        return path.name, str(path)
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        out = model_dir() / f"{path.stem}-{digest}"
        if not (out / _MARKER).exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(path, out)
        return path.stem, str(out)
    if _HUB_ID.match(name_or_path) and not path.exists():
        # The repository's name, as a folder cloned from it would be named: the same model
        # from the hub or from a clone has one fingerprint (and so shares memory and heads).
        return name_or_path.rsplit("/", 1)[1], name_or_path
    if name_or_path in PACKAGED:
        raise ValueError(f"{name_or_path!r} is the memory's embedding model, not a target model")
    known = ", ".join(sorted(PACKAGED_MODELS))
    raise NotFoundError(
        f"unknown model {name_or_path!r}: expected a packaged model ({known}), a transformers "
        "model folder, a .gguf file, or a Hugging Face Hub id (org/name)")


def resolve_model_dir(name_or_path: str) -> tuple[str, Path]:
    """:func:`resolve_model` for a model on this machine (a hub id is refused)."""
    name, source = resolve_model(name_or_path)
    if not Path(source).is_dir():
        raise ValueError(f"{name_or_path!r} is not a model on this machine (a hub id?)")
    return name, Path(source)


def _is_hub_id(name_or_path: str, source: str) -> bool:
    return source == name_or_path and not Path(source).expanduser().exists()


def model_config(name_or_path: str, source: str) -> Any:
    """The model's transformers config (a hub id: fetched into, or read from, the hub cache),
    its architecture checked (:func:`agentspec.engine.compat.check_architecture`).

    Raises:
        ModelNotAvailableError: a hub id that is neither cached nor reachable (the message
            names it, ``HF_HUB_OFFLINE`` and the cache).
        UnsupportedModelError: an architecture agentspec does not support.
    """
    try:
        config = compat.load_config(source)
    except OSError as exc:
        if not _is_hub_id(name_or_path, source):
            raise
        raise _hub_error(name_or_path, exc) from exc
    compat.check_architecture(config, name_or_path)
    return config


def _hub_error(repo_id: str, exc: Exception) -> ModelNotAvailableError:
    from huggingface_hub import constants

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    why = (f"HF_HUB_OFFLINE is set, and it is not in the hub cache ({constants.HF_HUB_CACHE}): "
           f"unset HF_HUB_OFFLINE on a machine with network access, or copy the model there"
           if offline else
           f"it is not in the hub cache ({constants.HF_HUB_CACHE}) and could not be fetched: "
           f"check the id and the network (a gated model needs `hf auth login`; offline, "
           f"set HF_HUB_OFFLINE=1 and fill the cache first)")
    return ModelNotAvailableError(
        f"model {repo_id!r} (read as a Hugging Face Hub id) is not available: {why}. "
        f"transformers said: {first}")


def load_target(name_or_path: str = "smollm2-135m-instruct", *, device: Any = None,
                dtype: Any = None, quantize: str | None = None,
                prefix_cache_bytes: int | None = None) -> HFTarget:
    """Load a target model.

    Args:
        name_or_path: ``"smollm2-135m-instruct"`` (default), ``"gemma-3-270m"`` (packaged:
            ``agentspec models install NAME``), a local transformers model folder, a ``.gguf``
            file, or a Hugging Face Hub id (``org/name``: transformers' own download and cache,
            ``HF_HUB_OFFLINE=1`` honoured). GGUF models are dequantised once (the slow part of
            their first load) and kept as safetensors under ``$AGENTSPEC_HOME/models``. The
            architecture must be one of :data:`agentspec.engine.compat.ARCHITECTURES`.
        device: a device string or ``torch.device``; default ``"cuda"`` when available, else
            ``"cpu"``.
        dtype: a ``torch.dtype`` or its name (``"bfloat16"``, ``"float32"``, ``"float16"``),
            or ``"gguf"``: a GGUF model's weights held as the file stores them (Q4_0, Q4_1,
            Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; no full-precision copy), its products on the
            CPU in float32 over them (:mod:`agentspec.engine.quant`), on CUDA the fused
            forward's, each weight tile dequantised as it is loaded: bitwise the bfloat16
            model's outputs (Llama, Qwen2, Qwen3 layers). Default: bfloat16 on CUDA; on
            the CPU ``"gguf"`` for a GGUF model of Llama, Qwen2 or Qwen3 layers whose matrices
            are all of those types (the packaged SmolLM2 included), else float32. bfloat16 on
            the CPU holds a model of Llama, Mistral, Qwen2 or Qwen3 layers in bfloat16 tables
            on the native forward (:func:`~agentspec.engine.quant.quantize.hold_bfloat16`: norms
            and biases float32); other models run their modules in bfloat16.
        quantize: ``"int8"`` or ``"int4"``: a transformers checkpoint (a model folder or a hub
            id) loaded in float32 and its weights quantized at load, per group of 32 inputs
            as GGUF's Q8_0 and Q4_1 (:mod:`agentspec.engine.quant.quantize`), then held and
            run as a GGUF's are (CPU only; ``dtype`` None or float32). A GGUF model (packaged
            or a ``.gguf`` file) is quantized already: it takes ``dtype="gguf"`` instead.
        prefix_cache_bytes: the target's prefix cache budget (:class:`HFTarget`; ``None``:
            512 MiB, 0: off).

    Raises:
        NotFoundError: no model of that name or path (a ValueError).
        ValueError: an unknown device, dtype or quantize; quantize with a GGUF model, off
            the CPU or with another dtype than float32; a weight that cannot be quantized.
        ModelNotAvailableError: a packaged model not installed, a hub id not fetchable.
        UnsupportedModelError: an architecture agentspec does not support.
        KernelBuildError: quantize, and the native products cannot be built (no C++ compiler).
    """
    device = as_device(device)
    scheme = check_quantize(name_or_path, device, dtype, quantize)
    if scheme is not None:
        from agentspec.engine.quant import native

        native.library()  # no C++ compiler: refused now, naming why, not at the first forward
        return for_device(torch.device(device), _load, name_or_path, device, torch.float32,
                          prefix_cache_bytes, scheme)
    if dtype is None and device.startswith("cpu") and _held_as_stored(name_or_path):
        dtype = QUANTIZED[0]  # else (no compiler, no vectors) the dequantised model, with a warning
    if quantized(dtype):
        if torch.device(device).type not in ("cpu", "cuda"):
            raise ValueError(f"dtype {dtype!r} (the file's own quantization) runs on the CPU "
                             f"or on CUDA, not on device {device!r}")
        return for_device(torch.device(device), _load_quantized, name_or_path,
                          prefix_cache_bytes, device)
    torch_dtype = as_dtype(dtype)
    torch_dtype = torch_dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    # On the CPU the load (a GGUF's dequantising, the weights' copies) runs on the torch
    # thread: the thread every later forward runs on (agentspec.engine.torch_thread).
    return for_device(torch.device(device), _load, name_or_path, device, torch_dtype,
                      prefix_cache_bytes)


def check_quantize(name_or_path: str, device: Any, dtype: Any, quantize: Any) -> str | None:
    """``quantize`` checked as :func:`load_target` checks it, against the model, the device
    (None: :func:`as_device`'s default) and the dtype it goes with, loading nothing: the
    scheme, or None.

    Raises:
        ValueError: an unknown scheme, a GGUF model, a device other than the CPU, or a dtype
            other than float32 (each message names it).
    """
    from agentspec.engine.quant.quantize import as_scheme

    scheme = as_scheme(quantize)
    if scheme is None:
        return None
    device = as_device(device)
    if name_or_path in PACKAGED_MODELS or str(name_or_path).endswith(".gguf"):
        raise ValueError(f"quantize={scheme!r}: {name_or_path!r} is a GGUF model, quantized "
                         "already; load it with dtype='gguf' (its weights as the file stores "
                         "them) instead. quantize takes a transformers checkpoint: a model "
                         "folder or a hub id")
    if not device.startswith("cpu"):
        raise ValueError(f"quantize={scheme!r} runs on the CPU (agentspec's native products); "
                         f"device {device!r} takes dtype 'bfloat16' or 'float16' instead")
    if dtype is not None and (quantized(dtype) or as_dtype(dtype) != torch.float32):
        raise ValueError(f"quantize={scheme!r} quantizes the float32 weights and computes in "
                         f"float32: dtype must be None or 'float32', got {dtype!r}")
    return scheme


def _load(name_or_path: str, device: str, torch_dtype: Any,
          prefix_cache_bytes: int | None, quantize: str | None = None) -> HFTarget:
    name, source = resolve_model(name_or_path)
    model_config(name_or_path, source)
    tokenizer = compat.load_tokenizer(source)
    model = compat.load_causal_lm(source, torch_dtype)
    model = model.to(device).eval()
    if quantize is not None:
        from agentspec.engine.quant.quantize import quantize_model

        quantize_model(model, quantize)
    elif torch_dtype == torch.bfloat16 and device.startswith("cpu"):
        from agentspec.engine.quant.quantize import hold_bfloat16_where_native

        hold_bfloat16_where_native(model)
    if name_or_path in PACKAGED_MODELS:
        give_turn_format(PACKAGED_MODELS[name], model, tokenizer)
    return HFTarget(model, tokenizer, name=name, prefix_cache_bytes=prefix_cache_bytes)


def _gguf_meta(path: Path) -> tuple[Any, Any]:
    """A GGUF's config and tokenizer, read from the file once (its vocabulary is parsed for
    each) and kept in a small folder under ``$AGENTSPEC_HOME/models`` keyed by the file's path,
    size and time, from which later loads read them."""
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    out = model_dir() / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}-meta"
    if (out / _MARKER).exists():
        return compat.load_config(str(out)), compat.load_tokenizer(str(out))
    config = compat.load_config(str(path.parent), gguf_file=path.name)
    tokenizer = compat.load_tokenizer(str(path.parent), gguf_file=path.name)
    _keep(out, [config, tokenizer], {"source": str(path), "weights": "none"})
    return config, tokenizer


def _held_as_stored(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is a GGUF model (packaged, or a ``.gguf`` file) whose weights
    load as stored by default on this CPU
    (:func:`~agentspec.engine.quant.model.default_as_stored`)."""
    from agentspec.engine.quant.model import default_as_stored

    if name_or_path not in PACKAGED_MODELS and not str(name_or_path).endswith(".gguf"):
        return False
    try:
        return default_as_stored(gguf_file(name_or_path))
    except (ValueError, OSError, ModelNotAvailableError):
        return False  # not installed, not a file: the usual load says why


def _load_quantized(name_or_path: str, prefix_cache_bytes: int | None,
                    device: str = "cpu") -> HFTarget:
    from agentspec.engine.quant.model import load_quantized

    path = gguf_file(name_or_path)
    name = name_or_path if name_or_path in PACKAGED_MODELS else path.stem
    if name_or_path in PACKAGED_MODELS:
        _check_packaged(name_or_path)
    config, tokenizer = _gguf_meta(path)
    compat.check_architecture(config, name_or_path)
    model = load_quantized(path, config, device)
    if not device.startswith("cpu"):  # on CUDA the fused forward runs the weights as held
        from agentspec.engine.fused import llama

        if (reason := llama.unsupported(model)) is not None:
            raise ValueError(f"dtype 'gguf' on {device} runs the fused forward, which does not "
                             f"cover {path.name}: {reason}; load it with dtype='bfloat16'")
    if name_or_path in PACKAGED_MODELS:
        give_turn_format(PACKAGED_MODELS[name], model, tokenizer)
    return HFTarget(model, tokenizer, name=name, prefix_cache_bytes=prefix_cache_bytes)


def give_turn_format(entry: PackagedModel, model: Any, tokenizer: Any) -> None:
    """A packaged base model's GGUF carries no chat template: give the tokenizer its family's
    turn format, and make the turn's end a stop token of ``generate`` (and so of agentspec,
    which reads the same generation config), so a chat reply ends where its turn does."""
    if entry.chat_template is None or getattr(tokenizer, "chat_template", None):
        return
    tokenizer.chat_template = entry.chat_template
    if entry.turn_end is None:
        return
    end = tokenizer.convert_tokens_to_ids(entry.turn_end)
    eos = compat.eos_token_ids(model)
    stops = [eos] if isinstance(eos, int) else list(eos or ())
    if isinstance(end, int) and end != tokenizer.unk_token_id and end not in stops:
        compat.set_eos_token_ids(model, stops + [end])


def load_layer_skip(source: str, out_dir: Path, keep: Sequence[int]) -> HFTarget:
    """A cheaper model on ``source``'s tokenizer, for a draft model: ``source``'s decoder
    layers ``keep`` only, saved to ``out_dir`` and loaded back (so every layer index and the
    config agree). ``source`` as :func:`load_target` takes it.

    Raises:
        ValueError: ``keep`` is empty or names a layer the model does not have.
    """
    _, where = resolve_model(source)
    model_config(source, where)
    model = compat.load_causal_lm(where, torch.float32)
    layers = compat.decoder_layers(model)
    if not keep or max(keep) >= len(layers) or min(keep) < 0:
        raise ValueError(f"keep must name layers in [0, {len(layers)}), got {list(keep)}")
    compat.set_decoder_layers(model, torch.nn.ModuleList([layers[i] for i in keep]))
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    model.save_pretrained(str(out_dir))
    compat.load_tokenizer(where).save_pretrained(str(out_dir))
    return load_target(str(out_dir))
