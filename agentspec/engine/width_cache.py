"""The forward widths' probe verdicts, kept on disk between processes.

:meth:`HFTarget.check_widths <agentspec.engine.target.HFTarget.check_widths>` scores rows at
every forward width and beside other sequences to find the widths that give a row the same
bits; it costs seconds at every start (a dozen forwards, the widest a few hundred rows). Its
verdict is a function of the computation, not of the weights' values: the kernels each width
runs, chosen by the shapes, the dtype, the device, the thread count and the code. So the
verdict is kept under ``agentspec_home()/costs`` (beside the cost curves), in a file named by
a digest of all of those:

- the model's architecture and shapes (its config, its class, its attention implementation),
  the dtype and device;
- the widths asked for, the fused forward or the modules, torch's thread count and oneDNN;
- torch's, transformers' and Triton's versions, and the engine's own source files;
- the processor (its model name and instruction-set flags) or the GPU (its name and compute
  capability).

Any change to one of them is another file, so the probe runs again; a file that does not read
back whole is probed again and rewritten. Deleting the folder forces every probe.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from agentspec.home import agentspec_home

Verdict = tuple[tuple[int, ...], tuple[int, ...], bool]  # widths, prefill widths, batches
VERSION = 1


@functools.cache
def _engine_digest() -> str:
    """A digest of the engine's source files (its kernels and its forward)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _cpu() -> str:
    """The processor's model name and instruction-set flags (Linux), else what Python knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    keep = sorted({line.strip() for line in lines
                   if line.startswith(("model name", "flags", "Features", "CPU part"))})
    return "\n".join(keep) or f"{platform.machine()} {platform.processor()}"


def _device(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"{torch.cuda.get_device_name(index)} {torch.cuda.get_device_capability(index)}"
    return _cpu()


def _versions() -> dict[str, str]:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = ""
    return out


def cache_file(model: Any, asked: tuple[Any, ...], device: torch.device) -> Path:
    """The file of the verdict for ``model`` probed as ``asked`` (HFTarget's key: widths,
    prefill widths, device, dtype, fused, threads, oneDNN) on ``device``."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    key = {"version": VERSION, "config": config,
           "class": type(model).__qualname__,
           "attention": str(getattr(model.config, "_attn_implementation", "")),
           "asked": repr(asked), "versions": _versions(), "engine": _engine_digest(),
           "device": _device(device)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return agentspec_home() / "costs" / f"widths-{digest[:32]}.json"


def read(path: Path) -> Verdict | None:
    """The verdict kept in ``path``; None when there is none or it does not read back whole."""
    try:
        data = json.loads(path.read_text())
        widths = tuple(int(w) for w in data["widths"])
        prefill = tuple(int(w) for w in data["prefill_widths"])
        batches = data["batches"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if data.get("version") != VERSION or not widths or not isinstance(batches, bool):
        return None
    return widths, prefill, batches


def write(path: Path, verdict: Verdict) -> None:
    """Keep ``verdict`` in ``path`` (whole or not at all: written aside, then renamed). A home
    that cannot be written only costs the next start its probe."""
    widths, prefill, batches = verdict
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_suffix(f".{os.getpid()}.tmp")
        aside.write_text(json.dumps({"version": VERSION, "widths": list(widths),
                                     "prefill_widths": list(prefill), "batches": batches}))
        aside.replace(path)
    except OSError:
        pass
