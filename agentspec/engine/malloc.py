"""glibc malloc settings for a CPU target: large temporaries reused, not mapped anew.

A prefill chunk's attention allocates score tensors of many MiB per layer (a 256-row chunk
against 2,048 keys; see :mod:`agentspec.engine.kv`), freed a moment later. glibc serves such
sizes with fresh ``mmap`` regions (its threshold adapts, but only upwards from 128 KiB and as
sizes are freed) and gives freed heap tops back to the system, so the next forward may fault
every page in again, zeroed by the kernel: time in page faults instead of the forward. What
the settings save is measured by ``python -m agentspec.bench.malloc`` (BENCHMARKS.md).

:func:`tune` sets ``M_MMAP_THRESHOLD`` to glibc's maximum (32 MiB: smaller blocks come from the
heap and are reused) and ``M_TRIM_THRESHOLD`` to 512 MiB (freed memory up to that much stays
with the process). Process-wide and kept for the process's life; done once, when a CPU target
is loaded. Not done where ``AGENTSPEC_MALLOC=default``, where the user set any ``MALLOC_``
variable (theirs win), or off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 512 * 1024 * 1024
ENV = "AGENTSPEC_MALLOC"


@functools.cache
def tune() -> str:
    """Apply the settings once; returns what was done: ``"tuned"``, or why not (applying them
    twice from two threads at once is harmless: the same values)."""
    return _apply()


def state() -> str:
    """What :func:`tune` did in this process, or ``"not tuned (no CPU target loaded)"``: the
    settings are process-wide, so their state is asked here, not of a target (the bench
    reports it)."""
    return tune() if tune.cache_info().currsize else "not tuned (no CPU target loaded)"


def _apply() -> str:
    choice = os.environ.get(ENV, "tuned").strip().lower()
    if choice == "default":
        return f"off ({ENV}=default)"
    if choice != "tuned":
        raise ValueError(f"{ENV} must be 'tuned' or 'default', got {os.environ[ENV]!r}")
    if any(name.startswith("MALLOC_") for name in os.environ):
        return "off (MALLOC_ variables set)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "off (not glibc)"
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "off (no mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first (setting the trim threshold
    # alone stops the mmap threshold adapting and leaves it at 128 KiB: every temporary mapped)
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return "off (mallopt refused)"
    if mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "off (mallopt refused the trim threshold)"
    return "tuned"
