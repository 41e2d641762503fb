"""A GGUF's weights held as the file stores them (agentspec.engine.quant).

* Every held format's weights are bitwise gguf's own dequantisation of its blocks (random
  blocks of each format; the K-quants' blocks written by hand, gguf has no quantizer for them).
* The native product gives a row the same bits whatever rows share its call (1 to 20 rows, at
  any position, every format): the check fails on a product whose summation follows the row
  count (in this file).
* The packaged model loaded with ``dtype="gguf"``: its weights are bitwise the float32 model's
  (transformers' GGUF loader dequantises the same blocks), held in at most 1.2x the file's
  bytes, its logits within float32 summation noise of the float32 model's, the same greedy
  tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from agentspec.engine.load import gguf_file, load_target
from agentspec.engine.quant.formats import FORMATS, QuantWeight, unpack
from agentspec.engine.quant.model import QuantLinear, weight_bytes, weights_mode

N, K = 160, 512  # rows not a whole number of tiles: the padded tile is read too


def _blocks(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``kind`` for an ``[N, K]`` weight, as the file's bytes ``[N, bytes]``."""
    qtype = GGMLQuantizationType[kind]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return quants.quantize(rng.standard_normal((N, K)).astype(np.float32), qtype)
    block, size = {"Q4_K": (256, 144), "Q6_K": (256, 210)}[kind]
    raw = rng.integers(0, 256, size=(N, K // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 2e-2, size=(N, K // block, 2)).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":  # d, dmin first
        raw[..., 0:4] = scales.reshape(N, K // block, 4)
    else:  # d last
        raw[..., 208:210] = scales.reshape(N, K // block, 4)[..., :2]
    return raw.reshape(N, -1)


@functools.cache
def _weight(kind: str) -> tuple[QuantWeight, np.ndarray]:
    data = _blocks(kind, np.random.default_rng(FORMATS.index(kind)))
    ref = quants.dequantize(data, GGMLQuantizationType[kind]).reshape(N, K)
    return QuantWeight(unpack(kind, data, N, K), kind), ref


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_holds_ggufs_own_weights(kind):
    weight, ref = _weight(kind)
    assert np.isfinite(ref).all()
    assert np.array_equal(weight.dequantized().numpy(), ref)
    ids = torch.tensor([0, N - 1, 7, 7])
    assert torch.equal(weight.rows(ids), torch.from_numpy(ref[[0, N - 1, 7, 7]]))
    x = torch.randn(3, K)
    assert torch.allclose(weight.matmul(x), x @ torch.from_numpy(ref).T, rtol=1e-4, atol=1e-3)


def test_an_unheld_type_is_refused_by_name():
    with pytest.raises(ValueError, match="Q2_K"):
        unpack("Q2_K", np.zeros((2, 84), dtype=np.uint8), 2, 256)


def rows_depend_on_the_call(product: Callable[[torch.Tensor], torch.Tensor], k: int) -> list[int]:
    """Row counts at which some row's bits differ from the same row's product alone."""
    x = torch.randn(20, k)
    alone = torch.cat([product(x[i : i + 1]) for i in range(20)])
    bad = []
    for m in range(2, 21):
        for start in (0, 20 - m):
            if not torch.equal(product(x[start : start + m]), alone[start : start + m]):
                bad.append(m)
                break
    return bad


@pytest.mark.parametrize("kind", FORMATS)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(kind):
    weight, _ = _weight(kind)
    assert rows_depend_on_the_call(weight.matmul, K) == []


def test_a_product_that_follows_the_row_count_fails_the_check():
    """The control: the same weights, summed in two halves of the inputs from nine rows on (a
    kernel that splits its reduction when the rows leave threads idle)."""
    weight, ref = _weight("Q4_1")
    dense = torch.from_numpy(ref)

    def split(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= 8:
            return weight.matmul(x)
        half = K // 2
        return x[:, :half] @ dense[:, :half].T + x[:, half:] @ dense[:, half:].T

    assert rows_depend_on_the_call(split, K)


@pytest.mark.slow
def test_the_cpus_default_for_a_gguf_model_is_its_weights_as_stored():
    target = _targets()[0]  # loaded with no dtype
    assert weights_mode(target.model) == "gguf" and target.forward.native is not None


def test_gguf_weights_are_refused_off_the_cpu_by_name():
    with pytest.raises(ValueError, match="runs on the CPU"):
        load_target("smollm2-135m-instruct", device="meta", dtype="gguf")


@functools.cache
def _targets() -> tuple:
    return load_target(device="cpu"), load_target(device="cpu", dtype="float32")


@pytest.mark.slow
def test_the_packaged_model_holds_its_files_weights_bitwise_and_no_more():
    quant, plain = _targets()
    assert weights_mode(quant.model) == "gguf" and weights_mode(plain.model) == "float32"
    reference = dict(plain.model.named_parameters())
    linears = [(n, m) for n, m in quant.model.named_modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 211  # 30 layers of 7 products, and the head
    for name, module in linears:
        ref = reference.get(f"{name}.weight")
        if ref is None:  # the head: tied to the embedding
            ref = plain.model.get_output_embeddings().weight
        assert torch.equal(module.weight, ref), name
    for name, param in quant.model.named_parameters():
        assert torch.equal(param, reference[name]), name
    assert quant.fingerprint == plain.fingerprint  # one model: its memory rows serve both
    held, file = weight_bytes(quant.model), gguf_file("smollm2-135m-instruct").stat().st_size
    assert held <= 1.2 * file, (held, file)
    assert not any(isinstance(m, torch.nn.Linear) for m in quant.model.modules())


@pytest.mark.slow
def test_its_logits_are_the_float32_models_within_summation_noise():
    from agentspec.text import encode_prompt
    from tests.prompts import ALL_PROMPTS

    quant, plain = _targets()
    worst = 0.0
    for prompt in ALL_PROMPTS[:4]:
        ids = torch.tensor([encode_prompt(quant.tokenizer, prompt)])
        with torch.inference_mode():
            a, b = quant.model(ids).logits[0], plain.model(ids).logits[0]
        worst = max(worst, float((a - b).abs().max()))
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert worst < 1e-2, worst


@pytest.mark.slow
def test_without_a_compiler_the_default_is_the_dequantised_model_with_a_warning(monkeypatch):
    from agentspec.engine.quant import native

    def no_compiler() -> None:
        raise native.KernelBuildError("no C++ compiler (a test)")

    monkeypatch.setattr(native, "library", no_compiler)
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        target = load_target("smollm2-135m-instruct", device="cpu")
    assert weights_mode(target.model) == "float32"
