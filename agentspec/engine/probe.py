"""The width probe: which forward widths give a row the same bits, and whether a sequence's
rows are the same bits beside other sequences'.

A forward is padded to the narrowest width that holds its rows, so a row's bits must not
depend on the width: the probe scores the same rows at every width over an empty KV and
compares the logits bitwise. Widths whose rows differ are dropped (with a warning): padding
to a wider forward costs speed, a width of another class would let drafts change outputs.
Then two sequences' steps and a prompt chunk are scored alone and together; where they
differ, forwards carry one sequence each (:attr:`Forward.batches
<agentspec.engine.forward.Forward.batches>` False, with a warning).

The verdict is kept per loaded model in this process, and on disk for the next process that
runs the same computation (:mod:`agentspec.engine.width_cache`), which then probes nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from agentspec.engine import width_cache
from agentspec.engine.forward import Forward
from agentspec.engine.plan import Member, Prefill, causal, draft_member
from agentspec.engine.quant.model import weights_mode
from agentspec.engine.sequence import Sequence
from agentspec.errors import warn_once
from agentspec.types import Draft

# Verdicts per model: one probe per loaded model, not per engine over it.
_WIDTH_CLASS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], width_cache.Verdict]] = (
    weakref.WeakKeyDictionary())


def check_widths(forward: Forward, vocab_size: int) -> tuple[int, ...]:
    """Settle ``forward``'s widths (see the module's docstring), once; its widths."""
    if forward.probed:
        return forward.widths
    known = _WIDTH_CLASS.setdefault(forward.model, {})
    hit = known.get(asked(forward))
    if hit is not None:  # probed already on another engine over this model
        settle(forward, *hit)
        return forward.widths
    if forward.fused is not None:  # its first forward: one that fails falls back here
        _probe(forward, [0] * forward.widths[0], forward.widths[0])
    key = asked(forward)  # the module path's, where the fused forward fell back
    stored = width_cache.cache_file(forward.model, key, forward.device)
    verdict = width_cache.read(stored)
    if verdict is not None and set(verdict[0]) <= set(forward.widths) \
            and set(verdict[1]) <= set(forward.prefill_widths):
        settle(forward, *verdict)
        known[key] = verdict
        return forward.widths
    verdict = _measure(forward, vocab_size)
    known[key] = verdict
    width_cache.write(stored, verdict)
    return forward.widths


def asked(forward: Forward) -> tuple[Any, ...]:
    """What a probe's verdict holds for: the widths asked, the device, dtype and path."""
    return (forward.widths, forward.prefill_widths, str(forward.device),
            weights_mode(forward.model), forward.fused is not None,
            torch.get_num_threads(),  # CPU kernels split rows by thread count
            torch.backends.mkldnn.is_available())  # the CPU's products (engine.kernels)


def settle(forward: Forward, widths: tuple[int, ...], prefill: tuple[int, ...], batches: bool,
           *, was: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> None:
    """Give ``forward`` a verdict (this process's probe, or one kept), warning of what it
    drops from the widths asked (``was``; default the forward's now)."""
    was_widths, was_prefill = was or (forward.widths, forward.prefill_widths)
    kind_device = forward.device.type
    for kind, before, now in (("forward", was_widths, widths), ("prefill", was_prefill, prefill)):
        if now != before:
            warn_once(f"{forward.name}: {kind} widths {sorted(set(before) - set(now))} compute "
                      f"rows in another order on this {kind_device}; using {now}")
    if not batches:
        warn_once(f"{forward.name}: a sequence's rows differ beside other sequences' on this "
                  f"{kind_device}; every forward carries one sequence")
    forward.settle(widths, prefill, batches)


def _measure(forward: Forward, vocab_size: int) -> width_cache.Verdict:
    """The probe itself: every width, then the prefill widths, then the batch check."""
    gen = torch.Generator().manual_seed(0)
    was = (forward.widths, forward.prefill_widths)
    widths = forward.widths
    ids = torch.randint(0, vocab_size, (widths[0],), generator=gen).tolist()
    rows = {w: _probe(forward, ids, w) for w in widths}
    widths = tuple(w for w in widths if torch.equal(rows[w], rows[widths[-1]]))
    prefill = forward.prefill_widths
    if prefill:
        # A prompt chunk's rows must be the bits a decode-width forward gives them (a
        # prefix written by one call is reused by the next): a whole widest-width chain,
        # compared row for row.
        n = widths[-1]
        ids = torch.randint(0, vocab_size, (n,), generator=gen).tolist()
        ref = _probe(forward, ids, n)
        prefill = tuple(w for w in prefill if torch.equal(_probe(forward, ids, w), ref))
    forward.widths, forward.prefill_widths = widths, prefill
    verdict = (widths, prefill, _batches(forward, vocab_size, gen))
    settle(forward, *verdict, was=was)
    return verdict


def _probe(forward: Forward, ids: list[int], width: int) -> torch.Tensor:
    """Logits of a chain of ``ids`` over an empty KV in a forward of ``width`` rows."""
    seq = Sequence(forward.pool, cached=False)
    try:
        out = forward.run([Member(seq, ids, list(range(len(ids))), causal(len(ids)))],
                          width=width, wq=width)[0]
        assert out is not None
        return out.clone()
    finally:
        seq.release()


def _batches(forward: Forward, vocab_size: int, gen: torch.Generator) -> bool:
    """Whether sequences' rows are the same bits in one forward as alone: two sequences of
    other lengths (one past a block), a chain and a tree, and a prompt chunk beside them
    where the widest forward has room for it."""
    seqs = [Sequence(forward.pool, cached=False) for _ in range(3)]
    try:
        for seq, length in zip(seqs, (300, 41, 0), strict=True):
            ids = torch.randint(0, vocab_size, (length,), generator=gen).tolist()
            forward.fill(Prefill(seq, ids))
        tokens = torch.randint(0, vocab_size, (9,), generator=gen).tolist()
        tree = Draft(tuple(tokens[:4]), (-1, 0, 0, 2), "probe")
        chain = Draft.chain(tokens[4:7], "probe")
        makes = [lambda: draft_member(seqs[0], tokens[7], tree),
                 lambda: draft_member(seqs[1], tokens[8], chain)]
        room = forward.widest - sum(forward.rows_taken(n) for n in (5, 4))
        chunk_len = min(70, room)
        if chunk_len > 0:
            chunk = torch.randint(0, vocab_size, (chunk_len,), generator=gen).tolist()
            makes.append(lambda: Member(seqs[2], chunk, list(range(chunk_len)),
                                        causal(chunk_len)))
        alone = [forward.run([make()])[0] for make in makes]
        together = forward.run([make() for make in reversed(makes)])[::-1]
        return all(a is not None and b is not None and torch.equal(a, b)
                   for a, b in zip(alone, together, strict=True))
    finally:
        for seq in seqs:
            seq.release()
