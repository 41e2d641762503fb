"""Tiny random checkpoints of the Llama-like families the fused forward covers, built from
transformers' own configs (no download), and the depth of each family's reference checkpoint.

The fused forward's tests build them narrow (two layers, hidden size 64) to compare it with the
modules in Triton's interpreter; ``python -m agentspec.bench.engine --ops --family NAME`` builds
one as deep as the family's reference checkpoint, because a forward's kernel count depends on
its layers and not on its widths. Every norm weight and bias is drawn at random: a unit norm or
a zero bias (transformers' initial values) would let a forward that skips one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Reference:
    """The checkpoint a family's operation count stands for (its depth is what counts)."""

    checkpoint: str
    layers: int


REFERENCES: dict[str, Reference] = {
    "llama": Reference("SmolLM2-135M-Instruct", 30),
    "llama3": Reference("Llama-3.2-1B-Instruct", 16),
    "mistral": Reference("Mistral-7B-Instruct-v0.3", 32),
    "qwen2": Reference("Qwen2.5-0.5B-Instruct", 24),
    "qwen3": Reference("Qwen3-0.6B", 28),
    "phi3": Reference("Phi-3-mini-4k-instruct", 32),
    "granite": Reference("granite-3.3-2b-instruct", 40),
    "olmo2": Reference("OLMo-2-0425-1B-Instruct", 16),
}
"""Each family the fused forward covers (``llama3``: Llama with Llama 3's rope scaling), and
its reference checkpoint."""

_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                "rope_theta": 500000.0}
"""Llama 3's scaling, its original context shortened so that the tests' positions reach the
frequencies it changes."""


def tiny_config(family: str, *, layers: int = 2, vocab: int = 256) -> Any:
    """A transformers config of ``family`` (a key of :data:`REFERENCES`) with ``layers`` narrow
    layers: head dimension 32, two query heads sharing one key/value head.

    Raises:
        ValueError: ``family`` is not one of :data:`REFERENCES`.
    """
    import transformers as tf

    common: dict[str, Any] = dict(_TINY, vocab_size=vocab, num_hidden_layers=layers)
    builders: dict[str, Any] = {
        "llama": lambda: tf.LlamaConfig(head_dim=32, tie_word_embeddings=False, **common),
        "llama3": lambda: tf.LlamaConfig(head_dim=32, tie_word_embeddings=True,
                                         rope_parameters=dict(_LLAMA3_ROPE), **common),
        "mistral": lambda: tf.MistralConfig(head_dim=32, sliding_window=None, **common),
        "qwen2": lambda: tf.Qwen2Config(tie_word_embeddings=True, **common),
        "qwen3": lambda: tf.Qwen3Config(head_dim=32, tie_word_embeddings=True, **common),
        "phi3": lambda: tf.Phi3Config(**common),
        "granite": lambda: tf.GraniteConfig(embedding_multiplier=12.0, residual_multiplier=0.22,
                                            attention_multiplier=0.015625, logits_scaling=8.0,
                                            **common),
        "olmo2": lambda: tf.Olmo2Config(**common),
    }
    if family not in builders:
        raise ValueError(f"no tiny config for family {family!r}; choose one of "
                         f"{', '.join(REFERENCES)}")
    config = builders[family]()
    config._attn_implementation = "sdpa"
    return config


def tiny_model(family: str, *, layers: int = 2, seed: int = 0, vocab: int = 256,
               dtype: torch.dtype = torch.bfloat16) -> Any:
    """A random causal LM of :func:`tiny_config` in ``dtype``, in eval mode, its norm weights
    drawn around one and its biases around zero."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, layers=layers, vocab=vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model.to(dtype).eval()
