"""The native kernels over quantized weights (``qmm.cpp``: the products, ``forward.cpp``: a
whole forward): compiled once per machine with the
system's C++ compiler and loaded with ctypes.

Compiled for the machine it runs on (``-march=native``: 16-lane vectors where the CPU has
AVX-512, 8-lane ones where it has AVX2 with FMA and F16C, 4-lane ones on ARMv8's NEON,
``vec.h``) and
kept under ``$AGENTSPEC_HOME/kernels``, keyed by the source, the compiler and the CPU's
feature flags; a second process finds it there. OpenMP is libgomp, the runtime torch's CPU
wheels load, so the kernels run on the torch thread's own team (``torch_thread``).
No contraction of a multiply and an add into an fma is left to the compiler
(``-ffp-contract=off``): every fma is written, so every row takes the same rounding steps.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from agentspec.home import agentspec_home

SOURCE = Path(__file__).with_name("forward.cpp")  # includes qmm.cpp
SOURCES = (SOURCE, Path(__file__).with_name("qmm.cpp"), Path(__file__).with_name("vec.h"))
ARCH = os.environ.get("AGENTSPEC_KERNEL_MARCH", "native")
"""The instruction set the kernels are built for: the machine's own unless
``AGENTSPEC_KERNEL_MARCH`` names another (``x86-64-v3``: AVX2's 8-lane vectors; ``x86-64``:
no vectors, the portable loops)."""
FLAGS = ("-O3", f"-march={ARCH}", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off",
         "-fno-fast-math")

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None


class KernelBuildError(RuntimeError):
    """The quantized kernels could not be compiled on this machine (the message says why)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str:
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError(
        "the quantized weights' kernels need a C++ compiler with OpenMP (g++ or clang++; "
        "Debian: apt-get install g++), and none is on PATH (or set CXX); load the model "
        "with dtype='float32' or 'bfloat16' instead")


def library_path() -> Path:
    """Where this machine's build of the kernels is (or will be) kept."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES), compiler, *version, *FLAGS,
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    return agentspec_home() / "kernels" / f"qmm-{key}.so"


def _build(out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [_compiler(), *FLAGS, str(SOURCE), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelBuildError(f"compiling the quantized kernels failed ({' '.join(cmd)}):\n"
                               f"{done.stderr.strip()[-2000:]}")
    os.replace(tmp, out)  # atomic: a concurrent builder either wins or finds it built


def library() -> ctypes.CDLL:
    """The kernels, built at first use on this machine."""
    global _LIB
    with _LOCK:
        if _LIB is None:
            path = library_path()
            if not path.exists():
                _build(path)
            lib = ctypes.CDLL(str(path))
            i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
            lib.as_qmm.argtypes = [ptr, i64, i64, i64, ptr, i32, i32, ptr, ptr, i32, ptr, ptr,
                                   i32]
            lib.as_qmm.restype = None
            lib.as_qrows.argtypes = [ptr, i64, i64, ptr, i32, i32, ptr, ptr, i32, ptr]
            lib.as_qrows.restype = None
            lib.as_forward.argtypes = [ptr, ptr, ptr, ptr, i32]
            lib.as_forward.restype = None
            lib.as_kv_half.argtypes = [i64]
            lib.as_kv_half.restype = i32
            lib.as_lanes.argtypes = []
            lib.as_lanes.restype = i32
            lib.as_spent.argtypes = [ptr, i32]
            lib.as_spent.restype = None
            _LIB = lib
        return _LIB


def available() -> bool:
    """Whether the kernels build (or are built) here; where not, a warning says why once."""
    from agentspec.errors import warn_once

    try:
        library()
    except (KernelBuildError, OSError) as exc:
        warn_once(f"a GGUF's weights cannot be held as stored on this machine ({exc}); loading "
                  "it dequantised to float32")
        return False
    return True


def lanes() -> int:
    """The float32 lanes of the build's vectors: 16 (AVX-512), 8 (AVX2), 4 (NEON), or 0 (none:
    the portable loops, float32 KV)."""
    return int(library().as_lanes())


def threads() -> int:
    """The kernels' thread count: torch's."""
    return torch.get_num_threads()


PARTS = ("embed", "norms", "qkv", "rope+kv", "attention", "out", "mlp", "act", "head")
"""The parts of a native forward whose time :func:`spent` reports."""


def spent(reset: bool = False) -> dict[str, float]:
    """Seconds the native forwards of this process spent in each of :data:`PARTS`."""
    out = (ctypes.c_double * len(PARTS))()
    library().as_spent(ctypes.addressof(out), int(reset))
    return dict(zip(PARTS, out, strict=True))
