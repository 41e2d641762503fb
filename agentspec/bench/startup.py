"""A process's start with the forward widths' probe verdict kept on disk, against probed.

Each pair runs ``agentspec generate`` (the packaged model, a 4-token answer) in a process of
its own twice, interleaved: once after removing the kept verdicts from ``--home``'s
``costs`` (the process probes and keeps its verdict), once with them (it reads the verdict).
The home gets the real home's converted models and cost curves, so only the probe differs.
Prints each run's wall seconds, the medians and the median of the pairs' ratios.

    python -m agentspec.bench.startup --pairs 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentspec.home import agentspec_home


def _run(home: Path) -> float:
    env = {**os.environ, "AGENTSPEC_HOME": str(home)}
    cmd = [sys.executable, "-m", "agentspec.cli", "--db", f"sqlite:///{home / 'm.db'}",
           "generate", "Hi", "--max-new-tokens", "4"]
    started = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--home", default=None, help="scratch AGENTSPEC_HOME (default: a new one)")
    args = ap.parse_args(argv)
    home = Path(args.home or tempfile.mkdtemp(prefix="agentspec-startup-"))
    real = agentspec_home()
    (home / "costs").mkdir(parents=True, exist_ok=True)
    if not (home / "models").exists():
        (home / "models").symlink_to(real / "models")
    for curve in (real / "costs").glob("*.json"):
        if not curve.name.startswith("widths-"):
            shutil.copy(curve, home / "costs" / curve.name)
    _run(home)  # converts nothing, keeps the verdict: the warm runs' state
    kept, probed = [], []
    for _ in range(args.pairs):
        for verdict in (home / "costs").glob("widths-*.json"):
            verdict.unlink()
        probed.append(_run(home))
        kept.append(_run(home))
    out = {"kept_median_s": statistics.median(kept), "probed_median_s": statistics.median(probed),
           "ratio_median": statistics.median(k / p for k, p in zip(kept, probed, strict=True))}
    print(f"kept   {' '.join(f'{t:.2f}' for t in kept)}")
    print(f"probed {' '.join(f'{t:.2f}' for t in probed)}")
    print(f"medians: kept {out['kept_median_s']:.2f} s, probed {out['probed_median_s']:.2f} s, "
          f"ratio of pairs {out['ratio_median']:.3f}")
    return out


if __name__ == "__main__":
    main()
