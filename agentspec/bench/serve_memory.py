"""``agentspec serve``'s resident memory after start-up, in each weights mode, one after the other.

    python -m agentspec.bench.serve_memory [--model NAME] [--dtypes default,float32]

Each mode starts ``agentspec serve --port 0`` on a fresh SQLite memory, waits for the line
saying it serves, waits ``--settle`` seconds, reads the process's ``VmRSS`` and ``VmHWM``
from ``/proc``, and stops it. Prints one JSON object: per mode the start-up seconds, the
resident and peak megabytes, and the load line the server printed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _status_mb(pid: int, field: str) -> int:
    found = re.search(rf"{field}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return int(found.group(1)) // 1024 if found else -1


def measure(model: str, dtypes: list[str], settle: float) -> dict[str, Any]:
    """The figures described in the module's docstring."""
    out: dict[str, Any] = {"model": model, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="agentspec-serve-memory-") as tmp:
        for dtype in dtypes:
            cmd = [sys.executable, "-m", "agentspec.cli", "--db",
                   f"sqlite:///{Path(tmp) / (dtype + '.db')}", "serve", "--model", model,
                   "--port", "0", "--log-level", "warning"]
            if dtype != "default":
                cmd += ["--dtype", dtype]
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            assert proc.stdout is not None
            loaded = ""
            for line in proc.stdout:
                if line.startswith("load "):
                    loaded = line.strip()
                if "serving" in line:
                    break
            else:
                raise RuntimeError(f"agentspec serve ({dtype}) exited before serving")
            started = time.perf_counter() - t0
            time.sleep(settle)
            out["modes"][dtype] = {"start_s": round(started, 1),
                                   "rss_mb": _status_mb(proc.pid, "VmRSS"),
                                   "peak_mb": _status_mb(proc.pid, "VmHWM"), "load": loaded}
            proc.terminate()
            proc.wait(60)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.serve_memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="default,float32",
                        help="comma-separated serve --dtype values; 'default' gives none")
    parser.add_argument("--settle", type=float, default=3.0)
    args = parser.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes:
        parser.error(f"--dtypes names no mode: {args.dtypes!r}")
    result = measure(args.model, dtypes, args.settle)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
