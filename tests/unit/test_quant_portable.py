"""The native kernels built for other instruction sets than this machine's, each in a process
of its own (``AGENTSPEC_KERNEL_MARCH``):

* ``x86-64-v3`` (AVX2: ``vec.h``'s 8-lane vectors, float16 KV) and ``x86-64`` (no vectors:
  the portable loops, float32 KV): the weights are still gguf's (and bfloat16 ones the weight
  rounded), the products bitwise the scheme the 16-lane build computes and a row's product the
  same at any row count (make test);
* the AVX2 build gives the bits of this machine's build: the tiny families' verified rows
  (int8 and bfloat16 held; attention, float16 KV, the activation) equal in both, and the
  packaged model's (make test-long: make test holds the kernels' own outputs so in
  ``tests/unit/test_kernel_builds.py``). The
  control, in this file: the build without vectors keeps float32 KV, and the same comparison
  finds its rows differ;
* on the packaged model every verified row equals the row scored alone, in both builds
  (make test-long).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agentspec.home import agentspec_home

ROOT = Path(__file__).resolve().parents[2]
VECTORS, NO_VECTORS = "x86-64-v3", "x86-64"

_SCRIPT = """
import sys
import numpy as np, torch
from agentspec.engine.quant import native
from agentspec.engine.load import load_target
from tests.solo import verified_and_alone
from tests.unit.test_quant import (K, _bf16_weight, _unpacked, _weight, bf16_scheme_product,
                                   rows_depend_on_the_call, scheme_product)
from tests.unit.test_quant_portable import family_rows
march, part, out = sys.argv[1:4]
assert native.library().as_kv_half(64) == (march != "x86-64")  # float16 KV where vectors
for kind in ("Q4_1", "Q8_0", "Q6_K"):
    w, ref = _weight(kind)
    assert np.array_equal(w.dequantized().numpy(), ref)
    x = torch.randn(9, K)
    assert np.array_equal(w.matmul(x).numpy(), scheme_product(_unpacked(kind), x.numpy()))
    assert rows_depend_on_the_call(w.matmul, K) == []
w, ref = _bf16_weight()  # bfloat16 weights: the same two fma chains a output
assert np.array_equal(w.dequantized().numpy(), ref)
x = torch.randn(9, K)
assert np.array_equal(w.matmul(x).numpy(), bf16_scheme_product(ref, x.numpy()))
assert rows_depend_on_the_call(w.matmul, K) == []
if part == "families":
    np.savez(out, **family_rows())
if part == "forward":
    target = load_target(device="cpu", dtype="gguf")
    assert target.forward.native is not None
    prompt = target.tokenizer.encode("Name three colours and a tool.")
    verified, alone = verified_and_alone(target, prompt, [11, 22, 33, 44, 55, 66])
    assert torch.equal(verified, alone)
    np.save(out, verified.numpy())
print("ok")
"""


def family_rows() -> dict[str, np.ndarray]:
    """Verified rows of a chain after a prompt on the tiny random checkpoints of
    ``tests/families.py`` whose heads take the vector attention (Qwen3's head_dim 128, and a
    Llama given SmolLM2's 64), held in int8 and in bfloat16."""
    from agentspec.engine.quant.quantize import hold_bfloat16, quantize_model
    from agentspec.engine.target import HFTarget
    from tests.families import BY_NAME, Family, build, tokenizer
    from tests.solo import verified_and_alone
    from tests.unit.test_native_families import CHAIN, PROMPT

    ids = tokenizer()(PROMPT)["input_ids"]
    out = {}
    for family in (BY_NAME["qwen3"], Family("llama-64", "llama", "LlamaConfig", {"head_dim": 64})):
        for held, hold in (("int8", lambda m: quantize_model(m, "int8")), ("bf16", hold_bfloat16)):
            target = HFTarget(hold(build(family)), tokenizer(), name=family.name)
            assert target.forward.native is not None
            out[f"{family.name}-{held}"] = verified_and_alone(target, ids, CHAIN)[0].numpy()
    return out


def _run(tmp_path: Path, march: str, part: str) -> Path:
    """The script in a process whose kernels are built for ``march``; what it saved."""
    home = tmp_path / f"home-{march}"
    env = {**os.environ, "AGENTSPEC_KERNEL_MARCH": march, "AGENTSPEC_HOME": str(home),
           "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    models = agentspec_home() / "models"
    if models.is_dir():  # the converted model and GGUF metadata: not what this test checks
        home.mkdir(exist_ok=True)
        if not (home / "models").exists():
            (home / "models").symlink_to(models)
    out = tmp_path / f"{march}-{part}.{'npz' if part == 'families' else 'npy'}"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, march, part, str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    return out


# The build without vectors in make test-long: tests/unit/test_kernel_builds.py holds its
# products byte for byte this machine's in make test, which test_quant.py holds to the scheme.
@pytest.mark.parametrize("march", [VECTORS, pytest.param(NO_VECTORS, marks=pytest.mark.long)])
def test_a_build_keeps_the_weights_and_the_rows(tmp_path, march):
    _run(tmp_path, march, "products")


def _differing(theirs: Path) -> list[str]:
    ours = family_rows()
    with np.load(theirs) as saved:
        assert sorted(saved.files) == sorted(ours)
        return [k for k in ours if not np.array_equal(saved[k], ours[k])]


# This check and its control in make test-long: tests/unit/test_kernel_builds.py holds the
# AVX2 build's forwards (a tree and a chain verified, 4- to 8-bit weights, head_dim 64 and
# 128) byte for byte this machine's in make test.
@pytest.mark.long
def test_the_avx2_build_gives_this_machines_bits(tmp_path):
    assert _differing(_run(tmp_path, VECTORS, "families")) == []


@pytest.mark.long
def test_a_build_with_other_kv_misses_that_check(tmp_path):
    assert sorted(_differing(_run(tmp_path, NO_VECTORS, "families"))) == sorted(family_rows())


@pytest.mark.slow
@pytest.mark.long
def test_the_packaged_model_verifies_alike_in_both_builds(tmp_path):
    """Each build's verified rows equal its rows scored alone (in the script); the AVX2
    build's equal this machine's build's."""
    vectors = np.load(_run(tmp_path, VECTORS, "forward"))
    here = np.load(_run(tmp_path, "native", "forward"))
    assert np.array_equal(vectors, here)
    _run(tmp_path, NO_VECTORS, "forward")
