"""The architecture matrix's checkpoints: one tiny random model per family the engine loads,
built from transformers' own config classes (no download), on the packaged SmolLM2 tokenizer;
and a writer of the same weights as a GGUF file in llama.cpp's conventions.

Shared by ``tests/integration/test_families.py`` (the matrix) and ``tests/unit/test_compat.py``
(the matrix and :data:`agentspec.engine.compat.ARCHITECTURES` list the same families).

The weights are drawn wide enough that greedy tokens are decided by clear margins (the default
initialisation gives near-ties that fp32 rounding could flip), and every parameter is drawn:
biases (Qwen2's QKV bias) and norm weights (Qwen3's and OLMo 2's q/k norms) are not left at
their constant defaults, so a path that skips them changes outputs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=2.0**-20)
"""The checkpoints' shape (``rms_norm_eps`` a float32 number: a GGUF stores it in float32)."""
WINDOW = 8
"""The sliding window of the windowed checkpoints: the matrix's prompts are longer, so every
generation attends across it."""


@dataclass(frozen=True)
class Family:
    """One checkpoint of the matrix."""

    name: str  # the test id
    model_type: str  # ``config.model_type``: a key of compat.ARCHITECTURES
    config: str  # the transformers config class
    options: dict[str, Any] = field(default_factory=dict)
    score_gain: float = 1.0  # q and k projections scaled: attention scores past a logit cap
    gguf: str | None = None  # why transformers' GGUF reader cannot give it back (None: it can)

    @property
    def window(self) -> int | None:
        """The checkpoint's sliding window (its layer types, where it has them, the config's
        defaults: each windowed family's include sliding layers)."""
        return self.options.get("sliding_window")


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
_GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                attention_multiplier=0.0078125, logits_scaling=8.0)

FAMILIES: tuple[Family, ...] = (
    Family("llama", "llama", "LlamaConfig"),
    Family("llama3-rope", "llama", "LlamaConfig", {"rope_parameters": _LLAMA3_ROPE},
           gguf="llama.cpp keeps Llama 3's rope scaling as a rope_freqs tensor, which "
                "transformers' GGUF reader does not read (the scaling is lost)"),
    Family("qwen2", "qwen2", "Qwen2Config"),
    Family("qwen3", "qwen3", "Qwen3Config", {"head_dim": 128}),  # the GGUF reader's head_dim
    Family("mistral", "mistral", "MistralConfig", {"sliding_window": None}),
    Family("mistral-window", "mistral", "MistralConfig", {"sliding_window": WINDOW},
           gguf="transformers' GGUF reader maps no sliding window for Mistral (it is lost)"),
    Family("phi3", "phi3", "Phi3Config", {"sliding_window": None}),
    Family("phi3-window", "phi3", "Phi3Config", {"sliding_window": WINDOW},
           gguf="transformers' GGUF reader maps no sliding window for Phi-3 (it is lost)"),
    Family("granite", "granite", "GraniteConfig", _GRANITE,
           gguf="transformers' GGUF reader does not know the granite architecture"),
    Family("olmo2", "olmo2", "Olmo2Config",
           gguf="transformers' GGUF reader does not know the olmo2 architecture"),
    # Six layers: Gemma 3's default pattern (five sliding, one full), which its GGUF implies.
    Family("gemma3_text", "gemma3_text", "Gemma3TextConfig",
           {"head_dim": 16, "sliding_window": WINDOW, "num_hidden_layers": 6}),
    # Gemma 2's caps at their defaults (the GGUF reader keeps defaults); scores pass the cap.
    Family("gemma2", "gemma2", "Gemma2Config",
           {"head_dim": 16, "sliding_window": WINDOW}, score_gain=4.0),
)
"""The matrix: every family of :data:`agentspec.engine.compat.ARCHITECTURES`; Mistral and Phi-3
with and without a window (Phi-3-mini has one, Phi-3.5 and Phi-4-mini none that a context
reaches), Llama with and without Llama 3's rope scaling."""

BY_NAME = {f.name: f for f in FAMILIES}


@functools.cache
def tokenizer() -> Any:
    """The packaged SmolLM2's tokenizer (from its converted folder)."""
    from agentspec.engine import compat
    from agentspec.engine.load import resolve_model

    return compat.load_tokenizer(resolve_model("smollm2-135m-instruct")[1])


# Tool-call wrappers that real tokenizers hold as special tokens (Mistral's, with v11's [ARGS],
# Phi-4-mini's and Granite's), added to a copy of SmolLM2's tokenizer by :func:`wrapper_tokenizer`.
WRAPPER_TOKENS = ("[TOOL_CALLS]", "<|tool_call|>", "<|/tool_call|>", "[ARGS]")


@functools.cache
def wrapper_tokenizer() -> Any:
    """A copy of SmolLM2's tokenizer with :data:`WRAPPER_TOKENS` added as special tokens
    (ids past SmolLM2's vocabulary: a model on it is built with ``tokenizer=``)."""
    from agentspec.engine import compat
    from agentspec.engine.load import resolve_model

    tok = compat.load_tokenizer(resolve_model("smollm2-135m-instruct")[1])
    tok.add_special_tokens({"additional_special_tokens": list(WRAPPER_TOKENS)})
    return tok


def build(family: Family, *, byte_vocab: bool = False, seed: int = 0,
          vocab_tokenizer: Any = None) -> Any:
    """``family``'s tiny random causal LM in fp32, in eval mode, on SmolLM2's vocabulary (or
    with ``byte_vocab`` on the GGUF files' :data:`BYTE_VOCAB` tokens, or on ``vocab_tokenizer``'s
    whole vocabulary, added tokens included).

    Norm weights and biases are drawn on a coarse binary grid, where adding and removing the
    one of Gemma's GGUF norms is exact."""
    import transformers

    if byte_vocab:
        vocab, end = BYTE_VOCAB, BYTE_VOCAB - 1
        ids = dict(bos_token_id=end, eos_token_id=end, pad_token_id=end)
    else:
        tok = vocab_tokenizer if vocab_tokenizer is not None else tokenizer()
        vocab, end = len(tok), tok.eos_token_id
        ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=end, pad_token_id=end)
    config = getattr(transformers, family.config)(vocab_size=vocab, **ids,
                                                  **{**SHAPE, **family.options})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() > 1:
                p.copy_(noise * 0.3)
            elif "norm" in name:
                # Gemma's norms scale by (1 + weight): centred on 0 there, on 1 elsewhere.
                p.copy_(_grid(noise * 0.1) + (0.0 if family.model_type.startswith("gemma") else 1.0))
            else:
                p.copy_(_grid(noise * 0.1))
            if family.score_gain != 1.0 and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(family.score_gain)
            if name.endswith("embed_tokens.weight") and family.model_type.startswith("gemma"):
                # Gemma scales its embeddings up by sqrt(hidden): drawn that much smaller, the
                # token's own embedding does not outweigh the layers (its tied head would
                # then predict the token itself, at every step).
                p.div_(config.hidden_size ** 0.5)
    model.generation_config.eos_token_id = end
    return model


def _grid(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x * 1024) / 1024


# -- GGUF ------------------------------------------------------------------------------------

def gguf_architecture(model_type: str) -> str:
    """llama.cpp's architecture name for a transformers ``model_type`` (Mistral is written as
    llama with a name saying mistral, as llama.cpp's converter does)."""
    return {"mistral": "llama", "gemma3_text": "gemma3"}.get(model_type, model_type)


def _llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """A q or k projection's rows in llama.cpp's rope layout: within each head, the rotary
    halves interleaved (row ``i`` of the first half, then row ``i`` of the second), the order
    transformers' GGUF reader undoes for the llama architecture."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


END_OF_TEXT = "<|endoftext|>"
BYTE_VOCAB = 257
"""The GGUF files' vocabulary: every byte (no merges: a byte-level BPE that splits text into its
bytes), then an end of text; such a tokenizer converts in a moment, where SmolLM2's vocabulary
takes seconds to read back from a GGUF."""


def _byte_spelling(byte: int) -> str:
    """GPT-2's printable spelling of a byte: the printable Latin-1 bytes as themselves, every
    other byte as the next free character from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if byte in printable:
        return chr(byte)
    return chr(0x100 + sum(1 for b in range(byte) if b not in printable))


def _write_byte_tokenizer(writer: Any) -> None:
    """A byte-level BPE tokenizer in llama.cpp's ``tokenizer.ggml.*`` keys: token ``b`` is
    byte ``b`` (in GPT-2's printable spelling of bytes), then the end of text."""
    tokens = [_byte_spelling(b) for b in range(256)] + [END_OF_TEXT]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3])  # normal, then control
    writer.add_token_scores([0.0] * len(tokens))  # no merges: none to derive from these
    for add in (writer.add_bos_token_id, writer.add_eos_token_id, writer.add_pad_token_id,
                writer.add_unk_token_id):  # Gemma's tokenizer class wants an unknown token
        add(256)
    writer.add_add_bos_token(False)


def _rope_theta(config: Any) -> float:
    params = config.rope_parameters
    if "rope_theta" not in params:  # one entry per layer type (Gemma 3)
        params = params["full_attention"]
    return float(params["rope_theta"])


def write_gguf(model: Any, family: Family, path: Path) -> Path:
    """``model``'s weights in F32 as a GGUF file at ``path``, with the metadata transformers'
    GGUF reader maps back to its config, and a byte-level tokenizer (``model`` is built on
    :data:`BYTE_VOCAB` tokens: ``build(family, byte_vocab=True)``).

    Tensors take llama.cpp's names (gguf's own name map, the one the reader inverts), the
    llama architecture's q/k rows its rope layout, and Gemma's norm weights llama.cpp's
    ``1 + weight``."""
    import gguf

    config = model.config
    arch = gguf_architecture(family.model_type)
    writer = gguf.GGUFWriter(str(path), arch)
    assert config.vocab_size == BYTE_VOCAB, config.vocab_size
    # Not "mistral" alone: the reader would read the file as Mistral, which its weight map
    # does not know; named otherwise it is Llama's layer, as real Mistral GGUFs load.
    writer.add_name(f"{family.name}-tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if family.window is not None:
        writer.add_sliding_window(family.window)
    _write_byte_tokenizer(writer)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, suffix = name.rsplit(".", 1)
        target = names.get_name(stem)
        assert target is not None, f"no GGUF name for {name} ({arch})"
        data = tensor.detach().float().numpy().copy()
        if arch == "llama" and stem.endswith("q_proj"):
            data = _llama_cpp_rows(data, config.num_attention_heads)
        elif arch == "llama" and stem.endswith("k_proj"):
            data = _llama_cpp_rows(data, config.num_key_value_heads)
        if family.model_type.startswith("gemma") and "norm" in stem:
            data = data + 1.0
        writer.add_tensor(f"{target}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
