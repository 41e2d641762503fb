"""Host buffers in huge pages (agentspec.engine.pages) and the weights kept in one.

* ``huge_zeros`` gives zeroed bytes at a 2 MiB boundary.
* An ``Arena`` copies each tensor in at a 64-byte boundary, opening a new mapping when one is
  full, and counts the bytes it holds.
* ``keep`` moves a model's quantized weights into one arena without changing a product's
  bits, the tied head and the embedding still one table.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from agentspec.engine import pages
from agentspec.engine.quant.formats import QuantWeight, unpack
from agentspec.engine.quant.model import QuantEmbedding, QuantLinear, keep


def test_huge_zeros_are_zero_and_aligned():
    buf = pages.huge_zeros(5 << 20)
    assert buf.dtype == torch.uint8 and buf.numel() == 5 << 20
    assert buf.data_ptr() % pages.HUGE == 0
    assert int(buf.sum()) == 0


def test_an_arena_takes_tensors_whole_across_its_mappings(monkeypatch):
    monkeypatch.setattr(pages, "CHUNK", 4096)
    arena = pages.Arena()
    parts = [torch.randn(300), torch.arange(1000, dtype=torch.int16), torch.randn(2000)]
    held = [arena.take(t) for t in parts]
    assert all(torch.equal(a, b) for a, b in zip(parts, held, strict=True))
    assert all(h.data_ptr() % 64 == 0 for h in held)
    assert held[2].data_ptr() % pages.HUGE == 0  # 8,000 bytes: a mapping of its own
    assert arena.nbytes == 1216 + 2048 + 8000


def _weight(rng: np.random.Generator, n: int, k: int, kind: str) -> QuantWeight:
    data = quants.quantize(rng.standard_normal((n, k)).astype(np.float32),
                           GGMLQuantizationType[kind])
    return QuantWeight(unpack(kind, data, n, k), kind)


def test_keep_keeps_every_products_bits_and_the_tied_table():
    rng = np.random.default_rng(3)
    table = _weight(rng, 96, 64, "Q8_0")
    model = torch.nn.Module()
    model.embed = QuantEmbedding(table)
    model.proj = QuantLinear(_weight(rng, 64, 64, "Q4_1"))
    model.head = QuantLinear(table)
    x = torch.randn(5, 64)
    before = [model.proj(x), model.head(x), model.embed(torch.tensor([0, 95]))]
    arena = pages.Arena()
    for weight in (table, model.proj.qweight):  # each once, as a loader keeps them
        keep(weight, arena)
    held = arena.nbytes
    assert held >= table.nbytes + model.proj.qweight.nbytes
    after = [model.proj(x), model.head(x), model.embed(torch.tensor([0, 95]))]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert model.head.qweight is model.embed.qweight
    ptrs = sorted(t.data_ptr() for w in (table, model.proj.qweight)
                  for t in (w.q, w.scale, w.offset) if t.numel())
    assert ptrs[-1] - ptrs[0] < held  # one buffer
