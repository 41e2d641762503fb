"""The model fingerprint names what a model is, not where or how it was loaded: agents on
several machines (other $AGENTSPEC_HOMEs, other transformers releases, other dtypes) share one
memory's rows and heads."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentspec.engine.target import fingerprint


class _Vocab:
    def __init__(self, size: int) -> None:
        self.vocab = {f"t{i}": i for i in range(size)}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def _tiny(folder: Path, hidden: int = 16, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=24, hidden_size=hidden, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype)


def _with_the_folder(name: str, model: LlamaForCausalLM, tokenizer: _Vocab) -> str:
    """The fingerprint before: the whole config, the folder it was read from included."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return f"{name}:{h.hexdigest()[:16]}"


def test_the_same_model_from_another_folder_or_dtype_has_one_fingerprint(tmp_path: Path):
    a, b = _tiny(tmp_path / "home-a"), _tiny(tmp_path / "home-b")
    half = _tiny(tmp_path / "home-c", dtype=torch.bfloat16)
    vocab = _Vocab(24)
    assert fingerprint("m", a, vocab) == fingerprint("m", b, vocab) == fingerprint("m", half, vocab)
    # The old fingerprint hashed the folder: two users' caches never shared a row.
    assert _with_the_folder("m", a, vocab) != _with_the_folder("m", b, vocab)


def test_another_model_or_tokenizer_has_another_fingerprint(tmp_path: Path):
    a, wider = _tiny(tmp_path / "a"), _tiny(tmp_path / "b", hidden=32)
    assert fingerprint("m", a, _Vocab(24)) != fingerprint("m", wider, _Vocab(24))
    assert fingerprint("m", a, _Vocab(24)) != fingerprint("m", a, _Vocab(23))
    assert fingerprint("m", a, _Vocab(24)) != fingerprint("n", a, _Vocab(24))
