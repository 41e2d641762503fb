"""The native kernels built for each instruction set they have vectors for give the same bits.

``tests/kernels/bits.cpp`` runs the products (every held format, 1-11 rows) and a tiny model's
forwards (prefills, a tree and a chain verified in one forward, head_dim 64 and 128) on fixed
pseudo-random inputs and writes every output. Built here for AVX-512 (where this machine has
it), for AVX2 (``x86-64-v3``) and for ARMv8's NEON (a cross compiler, run under qemu: Debian's
``g++-aarch64-linux-gnu`` and ``qemu-user``, which ``.ci/run`` installs; skipped without
them), its files are equal byte for byte: a user's outputs do not depend on which processor
runs them. The control, in this file: the build with no vectors (``x86-64``) keeps float32 KV,
and the same comparison finds its forwards differ (its products, the same integer sums and
float steps, are equal).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from agentspec.engine.quant import native

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "kernels" / "bits.cpp"
DIMS = (64, 128)
PRODUCTS = 9 * (1 + 3 + 8 + 11) * 80 * 4
"""The bytes of the products' part of a file (bits.cpp: nine formats, four row counts, 80
outputs)."""
ARM = ("aarch64-linux-gnu-g++", "qemu-aarch64")
pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="the builds compared are x86's (and ARM's, cross)")


def _flags(march: str) -> list[str]:
    """native.FLAGS for an executable built for ``march``."""
    keep = [f for f in native.FLAGS if f not in ("-shared", "-fPIC") and not f.startswith("-march")]
    return [*keep, f"-march={march}", f"-I{native.SOURCE.parent}"]


def _outputs(tmp_path: Path, march: str) -> dict[int, bytes]:
    """bits.cpp's file for each head_dim, built for ``march`` (``arm``: the cross build)."""
    exe = tmp_path / f"bits-{march}"
    if march == "arm":
        compiler, flags, run = ARM[0], _flags("armv8-a"), [ARM[1], "-L", "/usr/aarch64-linux-gnu"]
    else:
        compiler, flags, run = native._compiler(), _flags(march), []
    subprocess.run([compiler, *flags, str(SOURCE), "-o", str(exe)], check=True,
                   capture_output=True, timeout=300)
    out = {}
    for dim in DIMS:
        path = tmp_path / f"{march}-{dim}.bin"
        subprocess.run([*run, str(exe), str(path), str(dim)], check=True, capture_output=True,
                       timeout=300)
        out[dim] = path.read_bytes()
    return out


@pytest.fixture(scope="module")
def here(tmp_path_factory):
    return _outputs(tmp_path_factory.mktemp("native"), "native")


def test_the_avx2_build_gives_this_machines_bits(here, tmp_path):
    assert _outputs(tmp_path, "x86-64-v3") == here


@pytest.mark.skipif(not all(shutil.which(t) for t in ARM),
                    reason="no aarch64 cross compiler and qemu (Debian: g++-aarch64-linux-gnu "
                           "qemu-user)")
def test_the_neon_build_gives_this_machines_bits(here, tmp_path):
    assert _outputs(tmp_path, "arm") == here


def test_a_build_without_vectors_misses_that_check(here, tmp_path):
    theirs = _outputs(tmp_path, "x86-64")
    for dim in DIMS:
        assert theirs[dim][:PRODUCTS] == here[dim][:PRODUCTS]  # the products: the same bits
        assert theirs[dim][PRODUCTS:] != here[dim][PRODUCTS:]  # float32 KV: other forwards
        assert len(theirs[dim]) == len(here[dim])
