"""A GGUF's weights as the fused forward holds them on a GPU (agentspec.engine.quant.tiles).

Without CUDA the fused kernels run in Triton's interpreter (tests/conftest.py), on the CPU's
tensors: the same kernel code a GPU compiles. What is checked:

* Every held format's :class:`TileWeight` is bitwise gguf's own dequantisation of its blocks,
  and so is a stack of different formats (a Q4_K_M layer's Q4_K and Q6_K rows).
* A fused product over a held weight (each tile dequantised as it is loaded) is bitwise the
  product over the weight dequantised and rounded to bfloat16, in every format; a tile that
  reads its nibbles the other way round (the control) is not.
* A tiny Llama whose every weight is held so gives, on the fused forward, bitwise the logits
  of the bfloat16 model with the dequantised weights, a row the same bits in a forward of 16
  rows and of 32; the swapped-nibble control does not; speculative decoding over it gives plain
  decoding's tokens. (That a row's bits do not depend on its forward is the fused kernels' rule,
  checked with its control in tests/unit/test_fused.py; the tiles change no tile shape.)
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from agentspec.engine.fused import kernels
from agentspec.engine.quant.formats import FORMATS, QuantWeight, unpack
from agentspec.engine.quant.model import QuantEmbedding, QuantLinear, weight_bytes, weights_mode
from agentspec.engine.quant.tiles import TileWeight
from agentspec.engine.target import HFTarget
from agentspec.types import Draft
from tests.solo import solo
from tests.tiny_model import TinyTokenizer
from tests.unit.test_fused import PROMPT, V, WrongThenRight, _generate, tiny_llama
from tests.unit.test_quant import K, N, _data

pytestmark = pytest.mark.skipif(
    not kernels.AVAILABLE or not (torch.cuda.is_available() or kernels.INTERPRETED),
    reason="needs Triton (on CUDA or in its interpreter)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tiles(kind: str) -> TileWeight:
    return TileWeight.of(unpack(kind, _data(kind), N, K), kind, device=DEVICE)


def _reference(kind: str) -> torch.Tensor:
    return QuantWeight(unpack(kind, _data(kind), N, K), kind).dequantized()


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_is_held_as_ggufs_own_weights(kind):
    ref = quants.dequantize(_data(kind), GGMLQuantizationType[kind]).reshape(N, K)
    w = _tiles(kind)
    assert np.array_equal(w.dequantized().cpu().numpy(), ref)
    ids = torch.tensor([0, N - 1, 7, 7])
    assert torch.equal(w.rows(ids).cpu(), torch.from_numpy(ref[[0, N - 1, 7, 7]]).bfloat16())
    # about the file's bytes: values a nibble (4-bit) or a byte, a float16 or float32 scale and
    # offset per group (more than the file's only where it packs 5 and 6 bits or 6-bit scales)
    assert w.nbytes <= 2.0 * _data(kind).nbytes


def test_a_stack_of_formats_is_each_ones_weights():
    kinds = ("Q4_K", "Q6_K", "Q4_0")
    stack = TileWeight.stacked([_tiles(k) for k in kinds])
    assert (stack.bits, stack.group) == (8, 16)
    want = torch.cat([_reference(k) for k in kinds])
    assert torch.equal(stack.dequantized().cpu(), want)
    assert torch.equal(stack.view_rows(N, 2 * N).dequantized().cpu(), want[N : 2 * N])


def _product(weight) -> torch.Tensor:
    x = torch.randn(16, K, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEVICE)
    return kernels.norm_matmul(x, None, weight).cpu()


def _swapped(w: TileWeight) -> TileWeight:
    """The control: a weight whose tiles read each byte's nibbles the other way round."""
    codes = ((w.codes >> 4) | (w.codes << 4)).to(w.codes.dtype)
    return TileWeight(codes, w.scale, w.offset, w.bits, w.group, w.kind, w.dtype)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_fused_product_over_held_weights_is_the_bfloat16_weights_product(kind):
    dense = _reference(kind).bfloat16().to(DEVICE)
    got = _product(_tiles(kind))
    assert torch.equal(got, _product(dense))
    if kind in ("Q4_0", "Q4_1", "Q4_K"):
        assert not torch.equal(_product(_swapped(_tiles(kind))), got)


def _q4_weights(model, kind: str = "Q4_1", swap: bool = False):
    """Two copies of ``model``: its weights quantized to ``kind`` and held as tiles, and its
    weights replaced by their dequantised values in bfloat16."""
    held, dense = copy.deepcopy(model), copy.deepcopy(model)
    qtype = GGMLQuantizationType[kind]
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        w = module.weight.detach().float().numpy()
        raw = quants.quantize(w, qtype)
        tiles = TileWeight.of(unpack(kind, raw, *w.shape), kind)
        if swap and "down_proj" in name:
            tiles = _swapped(tiles)
        values = torch.from_numpy(quants.dequantize(raw, qtype).reshape(w.shape)).bfloat16()
        dense.get_submodule(name).weight.data = values
        parent, _, leaf = name.rpartition(".")
        holder = held.get_submodule(parent) if parent else held
        if isinstance(module, torch.nn.Embedding):
            setattr(holder, leaf, QuantEmbedding(tiles))
        else:
            setattr(holder, leaf, QuantLinear(tiles))
    return held, dense


def _target(model, widths=(16,)) -> HFTarget:
    # one width and no prefill widths: nothing to probe (the interpreter's probe takes a minute)
    return HFTarget(model, TinyTokenizer(V), name="tiny", reuse_prefix=False, fused=True,
                    widths=widths, prefill_widths=())


SHORT = PROMPT[:24]  # the interpreter's time grows with the rows a test runs


def _scored(model, draft: Draft, widths=(16,)) -> torch.Tensor:
    t = _target(model, widths)
    solo(t).start(SHORT)
    return solo(t).score(SHORT[-1], draft).clone()


@pytest.fixture(scope="module")
def pair():
    model = tiny_llama(seed=3)
    model.config.tie_word_embeddings = False
    return _q4_weights(model)


def test_a_model_held_quantized_gives_the_bfloat16_models_bits_on_the_fused_forward(pair):
    held, dense = pair
    assert weights_mode(held) == "gguf"
    assert weight_bytes(held) < weight_bytes(dense) / 2
    draft = Draft.chain(PROMPT[:12], "x")
    got = _scored(held, draft)
    assert torch.equal(got, _scored(dense, draft))
    assert torch.equal(_scored(held, draft, widths=(32,)), got)  # in 32 rows, not 16


def test_a_model_whose_tiles_read_the_wrong_nibbles_does_not(pair):
    _, dense = pair
    wrong, _ = _q4_weights(tiny_llama(seed=3), swap=True)
    draft = Draft.chain(PROMPT[:12], "x")
    assert not torch.equal(_scored(wrong, draft), _scored(dense, draft))


def test_speculative_decoding_over_held_weights_gives_plain_decodings_tokens(pair):
    from agentspec.decoding.loop import NoDrafter

    held, _ = pair
    t = _target(held)
    plain = _generate(t, NoDrafter(), SHORT, 8)
    assert len(plain) == 8
    assert _generate(t, WrongThenRight(plain, len(SHORT)), SHORT, 8) == plain


@pytest.mark.slow
def test_the_packaged_gguf_loads_as_tiles_holding_the_files_weights():
    # What dtype="gguf" on CUDA loads, here on the CPU: every weight bitwise the CPU-held
    # model's (gguf's values), the rest the bfloat16 model's, in about the file's bytes; the
    # fused forward covers it and stacks its layers' weights without a second copy.
    from agentspec.engine.fused import llama
    from agentspec.engine.load import gguf_file, load_target
    from agentspec.engine.quant.model import load_quantized

    cpu = load_target("smollm2-135m-instruct", device="cpu", dtype="gguf").model
    path = gguf_file("smollm2-135m-instruct")
    held = load_quantized(path, cpu.config, "cpu", tiles=True)
    assert weights_mode(held) == "gguf"
    assert weight_bytes(held) <= 1.2 * path.stat().st_size
    mine = dict(held.named_modules())
    for name, module in cpu.named_modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            tiles = mine[name].qweight
            assert isinstance(tiles, TileWeight)
            if name.endswith(("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj",
                              "layers.7.mlp.down_proj", "embed_tokens")):
                assert torch.equal(tiles.dequantized(), module.qweight.dequantized())
    dense = dict(held.named_parameters())
    for name, param in cpu.named_parameters():
        assert dense[name].dtype == torch.bfloat16
        assert torch.equal(dense[name], param.detach().bfloat16())
    assert llama.unsupported(held) is None
    before = weight_bytes(held)
    fused = llama.select(held, required=True)
    layer = held.model.layers[0]
    assert isinstance(fused.layers[0].qkv, TileWeight)
    assert layer.self_attn.k_proj.qweight.codes.data_ptr() == (
        fused.layers[0].qkv.codes[576:].data_ptr())  # a view into the stack
    assert weight_bytes(held) == before
