"""Where the bench's target runs and how its weights are held: ``--device``, ``--dtype`` and
``--quantize``, checked (exit 2 naming the value) before anything loads.

Importing this module imports no torch: a bad name fails before it is imported.
"""

from __future__ import annotations

from agentspec.cli.common import EXIT_USAGE, fail


def placement(model: str, device: str | None, dtype: str | None,
              quantize: str | None) -> tuple[str, str, str | None]:
    """``(device, dtype, quantize)`` resolved and checked: the names first (before torch is
    imported), then the device, the dtype's default on it, and ``--quantize`` against the
    model, device and dtype as ``load_target`` checks it."""
    if dtype is not None:
        resolve_dtype(dtype, "cpu")
    resolve_quantize(quantize)
    resolved = resolve_device(device)
    dtype = resolve_dtype(dtype, resolved)
    return resolved, dtype, resolve_quantize(quantize, model, resolved, dtype)


def resolve_dtype(text: str | None, device: str) -> str:
    """``--dtype``: bf16, fp16, fp32 or gguf (a GGUF's weights as stored, CPU or CUDA); default
    bf16 on CUDA, fp32 on the CPU."""
    from agentspec.bench.results import DTYPES

    if text is None:
        return "bf16" if device.startswith("cuda") else "fp32"
    if text not in DTYPES:
        fail(f"unknown dtype {text!r}; choices: {', '.join(DTYPES)}", EXIT_USAGE)
    return text


def resolve_quantize(text: str | None, model: str | None = None, device: str | None = None,
                     dtype: str | None = None) -> str | None:
    """``--quantize``: int8 or int4 (None: none), checked by name, then, given ``model``,
    ``device`` and ``dtype``, as ``load_target`` checks it (a GGUF model, a GPU or a dtype
    other than fp32 is refused): exit 2 naming it."""
    from agentspec.bench.results import QUANTIZE

    if text is None:
        return None
    if text not in QUANTIZE:
        fail(f"unknown quantize {text!r}; choices: {', '.join(QUANTIZE)}", EXIT_USAGE)
    if model is not None:
        from agentspec.engine.load import check_quantize

        try:
            check_quantize(model, device, dtype, text)
        except ValueError as e:
            fail(f"--quantize {text}: {e}", EXIT_USAGE)
    return text


def resolve_device(text: str | None) -> str:
    """``--device``: cpu, cuda or cuda:N (checked to exist); default cuda when available."""
    import torch

    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        fail(f"unknown device {text!r}; use cpu, cuda or cuda:N", EXIT_USAGE)
    if device.type not in ("cpu", "cuda"):
        fail(f"device {text!r} is not supported by the bench; use cpu, cuda or cuda:N", EXIT_USAGE)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"device {text!r} needs CUDA, which is not available here (torch "
             f"{torch.__version__}); use --device cpu", EXIT_USAGE)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        fail(f"device {text!r} does not exist: {torch.cuda.device_count()} CUDA device(s)",
             EXIT_USAGE)
    return text
