"""The native kernels built without AVX-512 (``AGENTSPEC_KERNEL_MARCH=x86-64-v3``: the
portable products and attention, float32 KV), in a process of their own: the weights are still
gguf's (and bfloat16 ones the weight rounded), the products bitwise the scheme the vector
build computes (so both builds give the same bits) and a row's product the same at any row count (make test), and on the packaged model
every verified row equals the row scored alone (make test-long: a model load in a process of
its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentspec.home import agentspec_home

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import sys
import numpy as np, torch
from agentspec.engine.quant import native
from agentspec.engine.load import load_target
from tests.solo import verified_and_alone
from tests.unit.test_quant import (K, _bf16_weight, _unpacked, _weight, bf16_scheme_product,
                                   rows_depend_on_the_call, scheme_product)
assert native.library().as_kv_half(64) == 0  # the portable build keeps float32 KV
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
if sys.argv[-1] != "forward":
    print("ok")
    raise SystemExit(0)
target = load_target(device="cpu", dtype="gguf")
assert target.forward.native is not None
prompt = target.tokenizer.encode("Name three colours and a tool.")
verified, alone = verified_and_alone(target, prompt, [11, 22, 33, 44, 55, 66])
assert torch.equal(verified, alone)
print("ok")
"""


def _run(tmp_path: Path, part: str) -> None:
    env = {**os.environ, "AGENTSPEC_KERNEL_MARCH": "x86-64-v3",
           "AGENTSPEC_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "2",
           "PYTHONPATH": str(ROOT)}
    models = agentspec_home() / "models"
    if models.is_dir():  # the converted model and GGUF metadata: not what this test checks
        (tmp_path / "home").mkdir()
        (tmp_path / "home" / "models").symlink_to(models)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, part], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_the_portable_products_keep_the_weights_and_the_rows(tmp_path):
    _run(tmp_path, "products")


@pytest.mark.slow
@pytest.mark.long
def test_the_portable_forward_gives_a_verified_row_its_bits_alone(tmp_path):
    _run(tmp_path, "forward")
