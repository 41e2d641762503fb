"""Synthetic GGUF files (``agentspec.bench.synthetic``) load with their weights held as stored.

The tiny shape in Q8_0 (its output tied to the embedding, as Llama-3.2-1B's) and in Q4_0 (an
``output.weight`` of its own, as Llama-3.1-8B's) is written, loaded with ``dtype="gguf"``,
checked for the config written, the weights held against the file's size, and finite logits
of a forward. The controls, in the same files: a file cut short, a file missing a tensor, and
a type whose blocks do not divide a width, each refused with an error.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from agentspec.bench import synthetic
from agentspec.bench.synthetic import SHAPES, write_synthetic

TINY = SHAPES["tiny"]


# Q8_0 (tied) and Q5_K in `make test-long`: the formats' blocks are held bitwise in make test
# by tests/unit/test_quant.py, and the writer and loader by the Q4_0 case.
@pytest.mark.parametrize(("qtype", "tied"), [pytest.param("Q8_0", True, marks=pytest.mark.long),
                                             ("Q4_0", False),
                                             pytest.param("Q5_K", False, marks=pytest.mark.long)])
def test_synthetic_file_loads_held_as_stored(tmp_path: Path, qtype: str, tied: bool) -> None:
    from agentspec.engine.load import load_target
    from agentspec.engine.plan import draft_member
    from agentspec.engine.quant.model import QuantLinear, weight_bytes
    from agentspec.engine.target import HFTarget
    from agentspec.types import Draft

    shape = dataclasses.replace(TINY, tied=tied)
    path = write_synthetic(tmp_path / f"tiny-{qtype}.gguf", shape, qtype)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
    target = load_target(str(path), dtype="gguf", device="cpu")
    cfg = target.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (
        shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim,
        shape.intermediate, shape.vocab)
    assert cfg.tie_word_embeddings is tied
    assert cfg.max_position_embeddings == shape.context
    assert len(target.tokenizer) == shape.vocab
    head = target.model.get_output_embeddings()
    assert isinstance(head, QuantLinear) and head.qweight.kind == qtype
    assert (head.qweight is target.model.get_input_embeddings().qweight) is tied
    held = weight_bytes(target.model)
    assert 0.5 * path.stat().st_size < held <= 1.3 * path.stat().st_size

    # One width: a forward with no width probe (the probe is the engine's, tested there).
    engine = HFTarget(target.model, target.tokenizer, widths=(8,), prefill_widths=(),
                      reuse_prefix=False)
    prompt = target.tokenizer("The capital of France is")["input_ids"]
    seq = engine.new_sequence(cached=False)
    try:
        engine.prefill(seq, prompt)
        logits = engine.run([draft_member(seq, prompt[-1], Draft.chain([7, 8, 9], "test"))])[0]
    finally:
        seq.release()
    assert logits is not None and logits.shape == (4, shape.vocab)
    assert torch.isfinite(logits).all()
    assert float(logits.std()) > 0.1  # the scales keep the logits spread, not flat


def _config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def test_broken_files_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Controls: what the test above passes, these files fail. No tokenizer is written into
    them (the loader's own step is called: the tokenizer's parse is slow and checked above)."""
    from agentspec.engine.quant.model import load_quantized

    monkeypatch.setattr(synthetic, "_add_tokenizer", lambda writer, vocab: None)
    small = dataclasses.replace(TINY, vocab=512)
    good = write_synthetic(tmp_path / "good.gguf", small, "Q8_0")
    assert load_quantized(good, _config(good)).config.vocab_size == 512

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-1000])  # the last tensor's data cut short
    with pytest.raises(ValueError):
        _config(cut)

    full = synthetic.tensors
    for missing in ("blk.1.ffn_norm.weight", "blk.1.ffn_up.weight"):
        monkeypatch.setattr(synthetic, "tensors", lambda shape, missing=missing: (
            (n, s) for n, s in full(shape) if n != missing))
        holed = write_synthetic(tmp_path / "holed.gguf", small, "Q8_0")
        # A norm's absence is a ValueError naming it; a linear layer's is a KeyError of its
        # name from the loader's table of tensors (either way the tensor is named).
        with pytest.raises((ValueError, KeyError), match=missing.replace(".", r"\.")):
            load_quantized(holed, _config(holed))

    with pytest.raises(ValueError, match="blocks of 256"):
        write_synthetic(tmp_path / "odd.gguf", dataclasses.replace(small, intermediate=320),
                        "Q4_K")
    assert sorted(os.listdir(tmp_path)) == ["cut.gguf", "good.gguf", "holed.gguf"]
