"""A real ``agentspec serve`` process for the server tests, and what they share with it.

The server runs the packaged model in a subprocess on a free port, with a private
AGENTSPEC_HOME (its memory, index files) that borrows the real home's converted models and
cost curves, so nothing is converted again and nothing of the user's memory is touched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentspec.home import agentspec_home

MODEL = "smollm2-135m-instruct"
# Two tools the client and tool-format tests bind.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}
MASTER_KEY = "test-master-key"
TENANT_KEYS = {"key-a": ["tenant-a"], "key-b": ["tenant-b", "tenant-b2"]}
_READY = re.compile(r"serving \S+ at (http://\S+)/v1")


@dataclass
class Server:
    """A running server: its base URL (``.../v1``), its memory's URL, its log file."""

    url: str
    db: str
    log: Path
    proc: subprocess.Popen[bytes]

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


async def post_chat(app: Any, request: dict[str, Any]) -> dict[str, Any]:
    """``request`` to ``/v1/chat/completions`` of an in-process server's ASGI ``app``; the
    answer's JSON (a 200 is asserted)."""
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 timeout=300) as client:
        res = await client.post("/v1/chat/completions", json=request)
    assert res.status_code == 200, res.text
    return res.json()  # type: ignore[no-any-return]


def private_home(tmp: Path) -> Path:
    """A fresh AGENTSPEC_HOME whose ``models`` and ``costs`` are the real home's (the same
    one again for ``tmp`` already used: a restart on the same memory and index files)."""
    home = tmp / "home"
    home.mkdir(parents=True, exist_ok=True)
    real = agentspec_home()
    for name in ("models", "costs"):
        if (real / name).is_dir() and not (home / name).exists():
            (home / name).symlink_to(real / name)
    return home


def start_server(tmp: Path, *args: str, timeout: float = 600.0) -> Server:
    """``agentspec serve`` on a free port with ``args``; returns once it answers."""
    home = private_home(tmp)
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(TENANT_KEYS))
    db = f"sqlite:///{tmp / 'memory.db'}"
    log = tmp / "server.log"
    # One torch thread, as the modules here run theirs (the one_thread fixture): the same
    # CPU kernels in both processes, and no two thread pools spinning over two cores.
    env = {**os.environ, "AGENTSPEC_HOME": str(home), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("AGENTSPEC_DB", None)
    env.pop("AGENTSPEC_API_KEY", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            # fp32, as the library's reference (the ``spec`` fixture) the answers are held to
            [sys.executable, "-m", "agentspec.cli", "--db", db, "serve", "--model", MODEL,
             "--dtype", "float32", "--port", "0", "--api-key", MASTER_KEY, "--keys", str(keys),
             "--log-level", "warning", *args],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _READY.search(log.read_text(errors="replace"))
        if found:
            return Server(found.group(1) + "/v1", db, log, proc)
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not start in {timeout} s:\n{log.read_text()[-3000:]}")


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(timeout=10)


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the modules here (loading and warming a model is most of their time):
    a small max_tokens bound and body limit, keys :data:`MASTER_KEY` (any scope) and
    :data:`TENANT_KEYS` (their own scopes only)."""
    pytest.importorskip("uvicorn", reason="the server needs: pip install 'agentspec-llm[serve]'")
    running = start_server(tmp_path_factory.mktemp("server"), "--max-tokens", "48",
                           "--max-body-bytes", "65536")
    yield running
    stop_server(running)
