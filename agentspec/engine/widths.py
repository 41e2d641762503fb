"""The forward widths: the row counts a forward runs at, all of one reduction class.

A forward is padded to the narrowest width that holds its rows (and each sequence's rows, in
attention, to the narrowest that holds them), so every width is a step of the cost curve the
policy sizes drafts on. :meth:`HFTarget.check_widths
<agentspec.engine.target.HFTarget.check_widths>` measures at first use that every width gives
a row the same bits, and drops any that does not.
"""

from __future__ import annotations

from collections.abc import Sequence

# The CPU's forward widths. A draft is scored at the narrowest width that holds it, so every
# width is a step of the cost curve the policy sizes drafts on; on a CPU a forward's time grows
# with its rows, and with powers of two only a draft just past one paid for twice the rows.
# The steps between let the policy draft as far as a copy is worth (BENCHMARKS.md has the
# side-by-side figures). Every width computes a row's bits alike (oneDNN's pointwise products,
# from 2 rows), and check_widths drops any that does not.
CPU_WIDTHS = (2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
# Prompt chunks: 256 rows, and the last chunk at the narrowest width that holds it. An agent's
# call adds a tail (a user turn, a tool's result) to a prompt whose prefix is in the KV; the
# widths between 96 and 256 keep a short tail from paying for a whole 256-row chunk.
CPU_PREFILL_WIDTHS = (96, 128, 160, 192, 256)
# The native forward over a GGUF's weights as stored (agentspec.engine.quant.runner) pads no
# row: every operation computes a row alone, so these are only the steps of the cost curve the
# policy sizes drafts on, one row the first.
NATIVE_WIDTHS = (1, *CPU_WIDTHS)
# The fused forward's widths (agentspec.engine.fused): its products are fixed tiles of 16 rows,
# so every multiple of 16 computes a row's bits alike, and prompt chunks can be far wider than
# steps. A graph is captured per width.
FUSED_WIDTHS = (16, 32, 64)
FUSED_PREFILL_WIDTHS = (128, 256, 512)


def default_widths(fused: bool, cuda: bool,
                   native: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The default forward and prefill widths of the fused forward, of the native one
    (``native``, the CPU's over a GGUF's weights as stored), or of the modules on CUDA (one
    width) or on the CPU."""
    if fused:
        return FUSED_WIDTHS, FUSED_PREFILL_WIDTHS
    if native:
        return NATIVE_WIDTHS, CPU_PREFILL_WIDTHS
    return ((64,), ()) if cuda else (CPU_WIDTHS, CPU_PREFILL_WIDTHS)


def ordered_widths(widths: Sequence[int], name: str = "widths", shown: str | None = None) -> tuple[int, ...]:
    """``widths`` as a tuple, checked: distinct positive integers, smallest first (or none).

    Raises:
        ValueError: they are not; the message names ``name`` and shows ``shown`` (default the
            widths themselves).
    """
    out = tuple(widths)
    if out and (out[0] < 1 or list(out) != sorted(set(out))):
        raise ValueError(f"{name} must be distinct positive integers, smallest first, "
                         f"got {out if shown is None else shown}")
    return out



