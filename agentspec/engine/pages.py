"""Host memory in transparent huge pages, for what a CPU forward streams whole every step.

A forward over a model's quantized weights reads tens to thousands of MB: in 4 KiB pages that
is tens of thousands of TLB misses a step, in 2 MiB pages a few dozen. (The KV pool stays on
torch's allocator: it grows often, and a huge page costs its whole 2 MiB to fault in.)
Linux gives a private anonymous mapping huge pages where it is advised to (the ``madvise``
setting, the usual default); elsewhere the mapping is plain pages and nothing else changes.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

HUGE = 2 << 20
"""The huge page's size: a buffer's start is aligned to it."""

CHUNK = 256 << 20
"""An :class:`Arena`'s mappings are at least this large."""


def huge_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes (``uint8``, starting at a 2 MiB boundary) in a private anonymous
    mapping advised to huge pages; the mapping lives as long as the tensor and its views, and
    only the pages written are ever backed."""
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
    area = mmap.mmap(-1, max(nbytes, 1) + HUGE, flags=flags)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    flat = np.frombuffer(area, dtype=np.uint8)
    at = -flat.ctypes.data % HUGE
    return torch.from_numpy(flat[at : at + nbytes])


class Arena:
    """Tensors moved one after another into mappings of at least :data:`CHUNK` bytes in huge
    pages, each at a multiple of 64 bytes: a model's weights, moved as each is made, hold their
    bytes and one weight's more at the peak (not twice the model's)."""

    def __init__(self) -> None:
        self._free = torch.empty(0, dtype=torch.uint8)
        self.nbytes = 0

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (contiguous, on the CPU) in the arena."""
        n = t.numel() * t.element_size()
        room = -(-n // 64) * 64
        if room > self._free.numel():
            self._free = huge_zeros(max(CHUNK, room))
        out = self._free[:n].view(t.dtype).reshape(t.shape)
        out.copy_(t)
        self._free = self._free[room:]
        self.nbytes += room
        return out
