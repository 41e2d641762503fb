"""llama.cpp's own ``llama-server`` and ``llama-bench``, built offline for the comparison.

Only :mod:`agentspec.bench.servers` uses them: llama.cpp is what a CPU user runs instead of
agentspec, on the same GGUF file, so the bench measures both side by side. Nothing else in
agentspec needs llama.cpp.

The sources are the ones vendored in the ``llama-cpp-python`` sdist of a pinned release
(:data:`VERSION`), fetched with pip from the package index (the only network this project's
machines reach), and built with cmake: ``-DGGML_NATIVE=ON`` (the processor's own instruction
set) less AMX (:data:`NO_AMX`), no HTTPS client, no web UI download, static libraries. About 8 minutes on 2 cores. The
binaries live under ``$AGENTSPEC_HOME/llama.cpp/<version>/bin``; a finished build is not
redone. Where ``AGENTSPEC_KERNEL_MARCH`` names another instruction set for agentspec's own
kernels (``x86-64-v3``: AVX2, what a processor without AVX-512 runs), llama.cpp is built for
the same one (:data:`MARCHES`), under ``<version>-<march>``, so both systems of the comparison
run that processor's instructions.

``python -m agentspec.bench.llama_cpp build`` (``make llama-cpp``) builds them;
``python -m agentspec.bench.llama_cpp where`` prints the folder.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from agentspec.engine.quant.native import ARCH
from agentspec.errors import NotFoundError
from agentspec.home import agentspec_home

VERSION = "0.3.36"
"""The llama-cpp-python release whose vendored llama.cpp is built."""
TARGETS = ("llama-server", "llama-bench")
# AMX off: on this project's Intel Xeon machines (amx_int8 in /proc/cpuinfo) this release's AMX
# matmul (ggml_backend_amx_mul_mat) crashes every model load with a segmentation fault. GCC's
# explicit -mno-* flags win over -march=native's defaults whatever their order; on processors
# without AMX they change nothing.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
MARCHES = {
    "native": ("-DGGML_NATIVE=ON",),
    "x86-64-v3": ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                  "-DGGML_BMI2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"),
}
"""The instruction sets llama.cpp is built for here (the value of ``AGENTSPEC_KERNEL_MARCH``)
and their cmake flags: x86-64-v3's are its features (AVX2, FMA, F16C, BMI2), no AVX-512."""


def cmake_flags(march: str = ARCH) -> tuple[str, ...]:
    """The build's cmake flags for ``march``.

    Raises:
        BuildError: ``march`` is not one of :data:`MARCHES`.
    """
    if march not in MARCHES:
        raise BuildError(f"AGENTSPEC_KERNEL_MARCH={march!r}: llama.cpp is built here for "
                         f"{' or '.join(map(repr, MARCHES))} only")
    return (*CMAKE_FLAGS, *MARCHES[march])
_PERCENT = re.compile(rb"^\[\s*(\d+)%\]")


class BuildError(RuntimeError):
    """The build could not start or failed; the message says what to do."""


def install_dir(version: str = VERSION, march: str = ARCH) -> Path:
    """Where a build of ``version`` for ``march`` keeps its binaries (``bin/``) and its log."""
    return agentspec_home() / "llama.cpp" / (version if march == "native" else f"{version}-{march}")


def binary(name: str, version: str = VERSION) -> Path:
    """The built ``name`` (``llama-server`` or ``llama-bench``).

    Raises:
        NotFoundError: not built yet; the message names the command that builds it.
    """
    path = install_dir(version) / "bin" / name
    if not path.is_file():
        raise NotFoundError(f"{name} is not built at {path}: run `make llama-cpp` (or python -m "
                            f"agentspec.bench.llama_cpp build), about 8 minutes on 2 cores")
    return path


def missing_tools(which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """The build tools this machine lacks: cmake, a C compiler, a C++ compiler."""
    missing = [] if which("cmake") else ["cmake"]
    if not (which("cc") or which("gcc") or which("clang")):
        missing.append("a C compiler (cc, gcc or clang)")
    if not (which("c++") or which("g++") or which("clang++")):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    return missing


def _run(cmd: Sequence[str], log: Path, on_percent: Callable[[int], None] | None = None,
         cwd: Path | None = None) -> None:
    """``cmd`` with its output appended to ``log``; cmake's ``[ NN%]`` lines reported."""
    with log.open("ab") as out:
        out.write(b"$ " + " ".join(cmd).encode() + b"\n")
        out.flush()
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=cwd)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            found = _PERCENT.match(line)
            if found and on_percent is not None:
                on_percent(int(found[1]))
        code = proc.wait()
    if code != 0:
        tail = log.read_bytes()[-2000:].decode(errors="replace")
        raise BuildError(f"{cmd[0]} exited {code} (the whole log: {log}):\n{tail}")


def fetch_sources(version: str, into: Path, log: Path) -> Path:
    """The llama.cpp folder vendored in llama-cpp-python ``version``'s sdist, unpacked."""
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          "--disable-pip-version-check", "-d", str(into), f"llama-cpp-python=={version}"], log)
    sdists = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not sdists:
        raise BuildError(f"pip left no llama_cpp_python-{version}.tar.gz in {into} (log: {log})")
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdists[0]) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise BuildError(f"{sdists[0].name} vendors no llama.cpp ({prefix} is missing)")
        tar.extractall(into, members=members, filter="data")
    return into / prefix


def build(version: str = VERSION, *, jobs: int | None = None,
          on_percent: Callable[[int], None] | None = None, force: bool = False) -> Path:
    """Build ``llama-server`` and ``llama-bench`` of ``version`` (see the module docstring);
    returns the folder of the binaries. Already built (and not ``force``): nothing is done.

    Raises:
        BuildError: a build tool is missing, the sources could not be fetched, or the build
            failed (the message names the log).
    """
    home = install_dir(version)
    bin_dir = home / "bin"
    if not force and all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir
    flags = cmake_flags()
    missing = missing_tools()
    if missing:
        raise BuildError(f"building llama.cpp needs {', '.join(missing)}; on Debian or Ubuntu: "
                         f"apt-get install cmake build-essential")
    home.mkdir(parents=True, exist_ok=True)
    log = home / "build.log"
    log.write_bytes(b"")
    with tempfile.TemporaryDirectory(prefix="llama-cpp-", dir=home) as tmp:
        src = fetch_sources(version, Path(tmp), log)
        build_dir = Path(tmp) / "build"
        _run(["cmake", "-S", str(src), "-B", str(build_dir), *flags], log)
        _run(["cmake", "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 2),
              "--target", *TARGETS], log, on_percent)
        bin_dir.mkdir(exist_ok=True)
        for target in TARGETS:
            built = build_dir / "bin" / target
            if not built.is_file():
                raise BuildError(f"the build finished without {built} (log: {log})")
            shutil.copy2(built, bin_dir / target)
    (home / "flags.txt").write_text(" ".join(flags) + "\n")
    return bin_dir


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentspec.bench.llama_cpp",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("build", "where"))
    ap.add_argument("--version", default=VERSION,
                    help=f"llama-cpp-python release whose llama.cpp to build (default {VERSION})")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: cores)")
    ap.add_argument("--force", action="store_true", help="build again even if built")
    args = ap.parse_args(argv)
    if args.command == "where":
        print(install_dir(args.version) / "bin")
        return 0
    from tqdm import tqdm

    bar = tqdm(total=100, desc=f"llama.cpp {args.version}", unit="%", file=sys.stderr)

    def step(percent: int) -> None:
        bar.update(max(0, percent - bar.n))

    try:
        where = build(args.version, jobs=args.jobs, on_percent=step, force=args.force)
    except BuildError as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    bar.update(100 - bar.n)
    bar.close()
    print(f"built {', '.join(TARGETS)} in {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
