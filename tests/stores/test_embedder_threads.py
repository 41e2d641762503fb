"""Warming the memory's MiniLM embedder up on a caller's thread starts no OpenMP team there.

A parallel op on a thread of two starts a second OpenMP team whose threads stay alive; with
more OpenMP threads than cores, libgomp throttles its waiting threads and every forward on the
engine's torch thread runs ~1.7x slower from then on (BENCHMARKS.md, many agents on one
engine). Each check runs in a fresh process (an OpenMP runtime's threads cannot be taken
back) and counts the process's threads before and after a warm-up on the main thread; the
same warm-up with the embedder's one-thread guard switched off starts the team and fails.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

_SCRIPT = """
import os, sys, torch
import agentspec.memory.embedder as E
if sys.argv[1] == "unguarded":
    E._one_thread_off_the_torch_thread = lambda: None
torch.set_num_threads(2)
embedder = E.MiniLMEmbedder(device="cpu")
before = len(os.listdir("/proc/self/task"))
embedder.warmup()
print(len(os.listdir("/proc/self/task")) - before)
"""


def _new_threads(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True,
                         timeout=300, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_warming_the_embedder_up_starts_no_openmp_team_on_the_callers_thread():
    unguarded = _new_threads("unguarded")
    if unguarded == 0:
        pytest.skip("this torch build starts no OpenMP threads for the warm-up's ops")
    assert _new_threads("guarded") < unguarded
