"""The fused forward: a Llama-family decoder written out in a few Triton kernels a layer, for
the fixed-width forwards the engine captures as CUDA graphs (:mod:`.llama`, :mod:`.kernels`)."""

from __future__ import annotations

import os
import sys


def interpret_without_gpu() -> bool:
    """On a machine without CUDA, have Triton run kernels in its interpreter (the CPU's tests
    and operation counter run the fused forward so). Triton decides when it is first imported
    (and torch's compiler imports it with transformers' models), so this must run before;
    returns whether the interpreter is on."""
    if "triton" not in sys.modules:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
