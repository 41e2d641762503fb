"""A GGUF's weights held as the file stores them (agentspec.engine.quant).

* Every held format's weights are bitwise gguf's own dequantisation of its blocks (random
  blocks of each format; the K-quants' blocks written by hand, gguf has no quantizer for them).
* The native product is bitwise the scheme ``qmm.cpp`` states (each row's inputs quantized to
  16 bits per group of 32, exact integer sums a group, float32 steps over the groups), computed
  here in numpy, and within 1e-4 of the product over the dequantised weights.
* The native product gives a row the same bits whatever rows share its call (1 to 20 rows, at
  any position, every format): the check fails on a product whose summation follows the row
  count (in this file).
* A float weight held in bfloat16 (what ``dtype="bfloat16"`` holds on the CPU): its values
  bitwise the weight rounded to bfloat16, its product bitwise the stated two fma chains per
  output (even inputs, odd inputs, added at the end), computed here in numpy (a single chain,
  the control, is not it), the same bits at any row count.
* The packaged model loaded with ``dtype="gguf"``: its weights are bitwise the float32 model's
  (transformers' GGUF loader dequantises the same blocks), held in at most 1.2x the file's
  bytes, its logits within 1e-2 of the float32 model's, the same greedy tokens; 8-bit
  activations (the control, in this file) miss that.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from agentspec.engine.load import gguf_file, load_target
from agentspec.engine.quant.formats import FORMATS, QuantWeight, Unpacked, unpack
from agentspec.engine.quant.model import QuantLinear, weight_bytes, weights_mode

N, K = 160, 512  # rows not a whole number of tiles: the padded tile is read too


def _blocks(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``kind`` for an ``[N, K]`` weight, as the file's bytes ``[N, bytes]``."""
    qtype = GGMLQuantizationType[kind]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return quants.quantize(rng.standard_normal((N, K)).astype(np.float32), qtype)
    block, size = {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}[kind]
    raw = rng.integers(0, 256, size=(N, K // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 2e-2, size=(N, K // block, 2)).astype(np.float16).view(np.uint8)
    if kind in ("Q4_K", "Q5_K"):  # d, dmin first
        raw[..., 0:4] = scales.reshape(N, K // block, 4)
    else:  # d last
        raw[..., 208:210] = scales.reshape(N, K // block, 4)[..., :2]
    return raw.reshape(N, -1)


@functools.cache
def _data(kind: str) -> np.ndarray:
    return _blocks(kind, np.random.default_rng(FORMATS.index(kind)))


def _unpacked(kind: str) -> Unpacked:
    return unpack(kind, _data(kind), N, K)


@functools.cache
def _weight(kind: str) -> tuple[QuantWeight, np.ndarray]:
    ref = quants.dequantize(_data(kind), GGMLQuantizationType[kind]).reshape(N, K)
    return QuantWeight(_unpacked(kind), kind), ref


def scheme_product(u: Unpacked, x: np.ndarray, levels: int = 32767) -> np.ndarray:
    """``x @ W.T`` as ``qmm.cpp`` states it, in numpy: each row of ``x`` quantized per group of
    32 inputs to ``round(x * levels / amax)``, integer sums per weight group, then per group
    ``((scale * S) + (offset * sum(x_q))) * d`` added in float32, groups in order."""
    x = x.astype(np.float32)
    m, k = x.shape
    xg = x.reshape(m, k // 32, 32)
    amax = np.abs(xg).max(-1)
    inv = np.divide(np.float32(levels), amax, out=np.zeros_like(amax), where=amax > 0)
    xq = np.rint(xg * inv[..., None]).astype(np.int64).reshape(m, k)
    d = amax / np.float32(levels)
    acc = np.zeros((m, u.q.shape[0]), np.float32)
    q, gs = u.q.astype(np.int64), u.group
    for g in range(k // gs):
        part = slice(g * gs, (g + 1) * gs)
        xs = xq[:, part].sum(1).astype(np.float32)[:, None]
        v = u.scale[:, g] * (xq[:, part] @ q[:, part].T).astype(np.float32)
        acc = acc + (v + u.offset[:, g] * xs) * d[:, g * gs // 32, None]
    return acc


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_holds_ggufs_own_weights(kind):
    weight, ref = _weight(kind)
    assert np.isfinite(ref).all()
    assert np.array_equal(weight.dequantized().numpy(), ref)
    ids = torch.tensor([0, N - 1, 7, 7])
    assert torch.equal(weight.rows(ids), torch.from_numpy(ref[[0, N - 1, 7, 7]]))


# Bits a weight held against the file's (rows padded to whole tiles aside): about the file's
# (Q4_0 and Q5_0 store no offsets, held as float16 ones; a K-quant's factors in 8 bits).
HELD_OVER_FILE = {"Q4_0": 1.12, "Q4_1": 1.0, "Q4_K": 1.03, "Q8_0": 1.0, "Q5_0": 1.1,
                  "Q5_1": 1.0, "Q5_K": 1.03, "Q6_K": 1.0}


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_is_held_in_about_its_files_bytes(kind):
    weight, _ = _weight(kind)
    padded = -(-N // 64) * 64
    assert weight.nbytes <= HELD_OVER_FILE[kind] * _data(kind).nbytes * padded / N


@pytest.mark.parametrize("kind", FORMATS)
def test_every_formats_product_is_the_stated_scheme_bitwise(kind):
    weight, ref = _weight(kind)
    x = torch.randn(5, K)
    x[1, 32:64] = 0.0  # a group of zeros: d = 0
    got = weight.matmul(x).numpy()
    u = _unpacked(kind)
    assert np.array_equal(got, scheme_product(u, x.numpy()))
    exact = x.double().numpy() @ ref.T.astype(np.float64)
    assert np.abs(got - exact).max() <= 1e-4 * np.abs(exact).max()
    # the control: 8-bit activations (llama.cpp's) are the same scheme yet miss both checks
    coarse = scheme_product(u, x.numpy(), levels=127)
    assert not np.array_equal(got, coarse)
    assert np.abs(coarse - exact).max() > 1e-3 * np.abs(exact).max()


def bf16_scheme_product(w: np.ndarray, x: np.ndarray, chains: int = 2) -> np.ndarray:
    """``x @ W.T`` over a bfloat16 weight as ``qmm.cpp`` states it: per (row, output) an fma
    chain over the even inputs and one over the odd ones, in order, added at the end
    (``chains=1``: one chain over every input, a control). Each fma rounds once: the product
    and the sum are exact in x87's 64-bit significands here, then rounded to float32."""
    x = x.astype(np.float32)
    wide = np.longdouble
    acc = [np.zeros((x.shape[0], w.shape[0]), np.float32) for _ in range(chains)]
    for i in range(w.shape[1]):
        c = i % chains
        acc[c] = (wide(1) * x[:, i, None] * w[None, :, i] + acc[c]).astype(np.float32)
    return acc[0] + acc[1] if chains == 2 else acc[0]


def _bf16_weight() -> tuple[QuantWeight, np.ndarray]:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(3))
    return QuantWeight.bfloat16(w), w.to(torch.bfloat16).float().numpy()


def test_a_bfloat16_weight_holds_its_values_and_its_product_is_the_stated_scheme_bitwise():
    weight, ref = _bf16_weight()
    assert np.longdouble(2) ** -60 + 1 != 1  # the scheme's fmas need x87's wide significands
    assert weight.bits == 16 and weight.nbytes == -(-N // 64) * 64 * K * 2  # 2 bytes a weight
    assert np.array_equal(weight.dequantized().numpy(), ref)
    assert torch.equal(weight.rows(torch.tensor([N - 1, 0])), torch.from_numpy(ref[[N - 1, 0]]))
    x = torch.randn(5, K)
    got = weight.matmul(x).numpy()
    assert np.array_equal(got, bf16_scheme_product(ref, x.numpy()))
    exact = x.double().numpy() @ ref.T.astype(np.float64)
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()
    # the control: the same products in one chain are not the stated scheme
    assert not np.array_equal(got, bf16_scheme_product(ref, x.numpy(), chains=1))


def test_a_bfloat16_rows_bits_do_not_depend_on_the_rows_beside_it():
    weight, _ = _bf16_weight()
    assert rows_depend_on_the_call(weight.matmul, K) == []


def test_a_bfloat16_weight_with_odd_inputs_is_refused_naming_its_shape():
    with pytest.raises(ValueError, match=r"even number of inputs, got shape \(4, 7\)"):
        QuantWeight.bfloat16(torch.zeros(4, 7))


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


def test_gguf_weights_are_refused_off_the_cpu_and_cuda_by_name():
    with pytest.raises(ValueError, match="runs on the CPU or on CUDA, not on device 'meta'"):
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


def _logits_gap() -> tuple[float, bool]:
    """The largest logit difference between the gguf and the float32 model over four bundled
    prompts' positions, and whether their greedy choices agree at every one."""
    from agentspec.text import encode_prompt
    from tests.prompts import ALL_PROMPTS

    quant, plain = _targets()
    worst, same = 0.0, True
    for prompt in ALL_PROMPTS[:4]:
        ids = torch.tensor([encode_prompt(quant.tokenizer, prompt)])
        with torch.inference_mode():
            a, b = quant.model(ids).logits[0], plain.model(ids).logits[0]
        worst = max(worst, float((a - b).abs().max()))
        same = same and torch.equal(a.argmax(-1), b.argmax(-1))
    return worst, same


@pytest.mark.slow
def test_its_logits_are_the_float32_models_within_summation_noise():
    worst, same = _logits_gap()
    assert same and worst < 1e-2, (worst, same)


@pytest.mark.slow
@pytest.mark.long  # make test's time; `python -m agentspec.bench.numerics` reports the same gap
def test_eight_bit_activations_fail_that_check():
    """The control: the same products with each row's inputs rounded to 8 bits a group of 32
    (llama.cpp's activations), summed over the dequantised weights in float64."""
    from agentspec.bench.numerics import eight_bit_activations

    with eight_bit_activations():
        worst, same = _logits_gap()
    assert not (same and worst < 1e-2), (worst, same)


@pytest.mark.slow
def test_without_a_compiler_the_default_is_the_dequantised_model_with_a_warning(monkeypatch):
    from agentspec.engine.quant import native

    def no_compiler() -> None:
        raise native.KernelBuildError("no C++ compiler (a test)")

    monkeypatch.setattr(native, "library", no_compiler)
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        target = load_target("smollm2-135m-instruct", device="cpu")
    assert weights_mode(target.model) == "float32"


def _held_bytes(w: QuantWeight) -> tuple:
    return (w.n, w.k, w.group, w.bits, w.params, w.q.numpy().tobytes(), w.scale.numpy().tobytes(),
            w.offset.numpy().tobytes())


@pytest.mark.parametrize("kind", FORMATS)
def test_a_tensor_held_a_slice_at_a_time_is_the_tensor_held_whole(kind, monkeypatch):
    from agentspec.engine.quant import formats

    order = np.random.default_rng(0).permutation(N)  # a query weight's rows, permuted
    whole = QuantWeight(unpack(kind, _data(kind)[order], N, K), kind)
    monkeypatch.setattr(formats, "ROWS_AT_ONCE", 64)  # N = 160: slices of 64, 64 and 32 rows
    assert _held_bytes(QuantWeight.of_blocks(kind, _data(kind), N, K, order)) == _held_bytes(whole)
    # the control: slices that are no whole tiles pad each to one, and hold other bytes
    monkeypatch.setattr(formats, "ROWS_AT_ONCE", 48)
    assert _held_bytes(QuantWeight.of_blocks(kind, _data(kind), N, K, order)) != _held_bytes(whole)
