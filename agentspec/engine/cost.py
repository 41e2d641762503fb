"""The cost model: what a forward over the root plus ``n`` draft nodes costs on this target
and machine, measured and kept.

:class:`CostModel` is forward time as a function of the tokens scored: measured points,
interpolated (on a CPU the curve is far from a line, and it steps at the forward widths).
:func:`measure_cost` times the engine's forwards on a scratch sequence of its pool, in
interleaved rounds, and caches the curve per model and device with a probe that tells a
curve measured under load. The drafting policy (:mod:`agentspec.drafters.policy`) sizes drafts
on it; the scheduler sizes prompt chunks on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentspec.engine.plan import draft_member
from agentspec.types import Draft, Verdict

# The fallback curve: forward seconds by tokens scored, as measured for SmolLM2-135M at 1,024
# tokens of context on a 2-core CPU (BENCHMARKS.md). A curve is not a line (a few tokens can
# cost more than a few more, and widths step), so the policy sizes drafts from measured
# points, not a fitted slope; a target's own curve is measured and cached (measure_cost).
DEFAULT_COST_POINTS = ((1, 0.0724), (2, 0.0788), (3, 0.0920), (4, 0.0747), (6, 0.0784),
                       (8, 0.0817), (12, 0.1225), (16, 0.1247), (24, 0.1556), (32, 0.1850),
                       (48, 0.2354), (64, 0.2657))
_TABLE_NODES = 130  # covers the 64-node tree budget and the 64-token depth bound
# Bumped when the measurement or the engine changes, so older cached curves are measured again.
# 6: interleaved rounds, a non-decreasing curve, one step per forward width.
# 7: CPU linears as oneDNN pointwise products on reordered weights (faster forwards).
# 8: a probe stored with the curve, re-timed whenever the cache is read.
# 9: the target's forward widths stored with the curve (finer CPU widths; a curve measured at
#    other widths is measured again).
# 10: the KV pool's attention; the seconds a token of KV adds (kv_per_token) stored with it.
COST_CACHE_VERSION = 10
# The probe: forwards of 1 and 8 rows over a short context, best of a few rounds.
PROBE_SIZES = (0, 7)
PROBE_CONTEXT = 64
# A cached curve is measured again when the probe now runs this much faster than it did then:
# the curve was measured while something else loaded the machine.
STALE_RATIO = 0.85


@dataclass(frozen=True)
class CostModel:
    """Forward time as a function of tokens scored.

    ``seconds = base + per_token * tokens`` (a least-squares line), unless measured ``points``
    are given: then the time is interpolated between them, and the line's slope continues past
    the last one.
    """

    base: float
    per_token: float
    points: tuple[tuple[int, float], ...] = ()
    # Seconds each token of another sequence's KV adds to a batched forward (its keys read):
    # the curve is measured over one sequence's KV.
    kv_per_token: float = 0.0
    # seconds(n) for n < _TABLE_NODES, computed once: the policy asks for it per node per step.
    _table: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.base <= 0 or self.per_token < 0:
            raise ValueError(f"cost model needs base > 0 and per_token >= 0, got {self.base}, {self.per_token}")
        if any(t < 1 or sec <= 0 for t, sec in self.points):
            raise ValueError(f"cost points need tokens >= 1 and seconds > 0, got {self.points}")
        object.__setattr__(self, "points", tuple(sorted((int(t), float(sec)) for t, sec in self.points)))
        object.__setattr__(self, "_table", tuple(self._interpolate(n) for n in range(_TABLE_NODES)))

    def seconds(self, draft_nodes: int) -> float:
        """Cost of a step scoring the root plus ``draft_nodes`` nodes."""
        if 0 <= draft_nodes < len(self._table):
            return self._table[draft_nodes]
        return self._interpolate(draft_nodes)

    def _interpolate(self, draft_nodes: int) -> float:
        tokens = draft_nodes + 1
        pts = self.points
        if not pts:
            return self.base + self.per_token * tokens
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            if tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        return pts[-1][1] + self.per_token * (tokens - pts[-1][0])

    @staticmethod
    def fit(points: tuple[tuple[int, float], ...] | list[tuple[int, float]]) -> CostModel:
        """The least-squares line through ``(tokens, seconds)`` points (slope clipped at 0),
        keeping the points themselves for interpolation."""
        n = len(points)
        mx = sum(p[0] for p in points) / n
        my = sum(p[1] for p in points) / n
        var = sum((p[0] - mx) ** 2 for p in points)
        slope = max(0.0, sum((p[0] - mx) * (p[1] - my) for p in points) / var) if var else 0.0
        base = max(my - slope * mx, 1e-6)
        return CostModel(base, slope, tuple((int(t), float(sec)) for t, sec in points))


DEFAULT_COST = CostModel.fit(DEFAULT_COST_POINTS)


def measure_cost(target: Any, *, sizes: tuple[int, ...] | None = None, context: int = 1024,
                 repeats: int = 5, cache_file: Path | None = None) -> CostModel:
    """Time the target's forward over ``1 + n`` draft tokens at about ``context`` tokens of KV.

    One prefill, then each timed step is rolled back (all drafts rejected), so the context
    grows by one token per measurement. ``sizes`` default: the widest draft of each of the
    target's forward widths (``target.widths``: every draft up to a width costs that width's
    forward), else a spread of sizes up to 63.

    Noise from other processes only ever adds time, and it comes in bursts. So the sizes are
    timed in interleaved rounds (a burst slows one round of every size, not every round of
    one size), each size keeps its fastest round, and a size is never dearer than a larger
    one (the curve is the running minimum from the right: a forward over more tokens cannot be
    the cheaper). Cached as JSON in ``cache_file`` (per model fingerprint and device) when
    given; a cache of another :data:`COST_CACHE_VERSION`, or of other forward widths than the
    target's (``target.widths`` once :meth:`check_widths` has settled them), is measured again.

    A load that lasts the whole measurement is no burst: it would inflate the cached curve for
    good, and the policy would draft too little on every later run. So a short probe (forwards
    of 1 and 8 rows at :data:`PROBE_CONTEXT` tokens, about a tenth of a second) is stored with
    the curve and re-timed whenever the cache is read: when either probe now runs faster than
    :data:`STALE_RATIO` of its cached time, the curve was measured under load and is measured
    again. A machine loaded now (a slower probe) keeps the cached curve. A file that passed
    the probe is not probed again in the same process (the same bytes, the same widths).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return _cached_or_measured(target, sizes, context, repeats, cache_file)


# Cost files that passed the probe in this process, by path, bytes and widths: another
# Speculator over the same model reads its curve without timing the probe again.
_CHECKED: dict[tuple[str, bytes, tuple[int, ...]], CostModel] = {}


def _cached_or_measured(target: Any, sizes: tuple[int, ...] | None, context: int, repeats: int,
                        cache_file: Path | None) -> CostModel:
    now = None  # the probe, when a cached curve was checked with it
    settle = getattr(target, "check_widths", None)
    if callable(settle):
        settle()  # the widths a curve is cached for are those left after the probe
    widths = [int(w) for w in getattr(target, "widths", ()) or ()]
    if cache_file is not None and cache_file.exists():
        try:
            raw = cache_file.read_bytes()
            seen = _CHECKED.get((str(cache_file), raw, tuple(widths)))
            if seen is not None:  # this very file passed the probe in this process already
                return seen
            data = json.loads(raw)
            if data.get("version") == COST_CACHE_VERSION and data.get("widths", []) == widths:
                cached = CostModel(float(data["base"]), float(data["per_token"]),
                                   tuple((int(t), float(sec)) for t, sec in data["points"]),
                                   float(data.get("kv_per_token", 0.0)))
                then = [float(x) for x in data["probe"]]
                now = probe_cost(target)
                if all(n >= STALE_RATIO * t for n, t in zip(now, then, strict=True)):
                    _CHECKED[(str(cache_file), raw, tuple(widths))] = cached
                    return cached
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache file is measured again

    model, measured_at = _measure(target, sizes, context, repeats)
    probe = now if now is not None else probe_cost(target)  # taken moments ago: reused
    # The narrowest forward at the curve's context against the probe's, at PROBE_CONTEXT.
    kv = max(0.0, (model.seconds(0) - probe[0]) / max(measured_at - PROBE_CONTEXT, 1))
    model = CostModel(model.base, model.per_token, model.points, kv)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps({"version": COST_CACHE_VERSION, "base": model.base,
                                          "per_token": model.per_token,
                                          "points": [list(p) for p in model.points],
                                          "kv_per_token": kv, "probe": probe,
                                          "widths": widths}))
    return model


def _measure(target: Any, sizes: tuple[int, ...] | None, context: int,
             repeats: int) -> tuple[CostModel, int]:
    widest = max(sizes) if sizes else 63
    context = max(2, min(context, target.max_context - widest - (len(sizes) if sizes else 12) * (repeats + 1) - 2))
    prompt = [1 + t % (target.vocab_size - 1) for t in range(context)]
    widths = tuple(getattr(target, "widths", ()) or ())
    if sizes is None:
        sizes = tuple(w - 1 for w in widths) if widths else (0, 1, 2, 3, 5, 7, 11, 15, 23, 31, 47, 63)
    sizes = tuple(sorted(set(sizes)))
    best = dict(zip(sizes, _fastest_rounds(target, prompt, sizes, repeats), strict=True))
    return CostModel.fit(cost_points(best, widths)), context


def probe_cost(target: Any, *, rounds: int = 3) -> list[float]:
    """Seconds of the target's forwards over 1 and 8 rows (:data:`PROBE_SIZES`) at
    :data:`PROBE_CONTEXT` tokens of KV, the fastest of ``rounds`` interleaved rounds (after
    one warm-up round): a cheap fingerprint of how fast the machine runs the target now."""
    prompt = [1 + t % (target.vocab_size - 1) for t in range(PROBE_CONTEXT)]
    return _fastest_rounds(target, prompt, PROBE_SIZES, rounds)


def _fastest_rounds(target: Any, prompt: list[int], sizes: tuple[int, ...],
                    rounds: int) -> list[float]:
    """The fastest of ``rounds`` interleaved rounds of the target's forward per draft size
    (after one warm-up round that is not counted), on a scratch sequence holding ``prompt``
    (its rows are of no later call's use: the pool never caches them); each draft is rolled
    back (all rejected), so the context grows by one token per forward."""
    seq = target.new_sequence(cached=False)
    try:
        target.prefill(seq, prompt)
        last = prompt[-1]
        best = [float("inf")] * len(sizes)
        for round_ in range(rounds + 1):
            for i, n in enumerate(sizes):
                draft = Draft.chain([7] * n, "cost") if n else Draft()
                t0 = time.perf_counter()
                logits = target.run([draft_member(seq, last, draft)])[0]
                float(logits[0, 0])  # wait for the device
                if round_:
                    best[i] = min(best[i], time.perf_counter() - t0)
                seq.commit(last, Verdict((), (), last))
        return best
    finally:
        seq.release()


def cost_points(best: dict[int, float], widths: tuple[int, ...] = ()) -> list[tuple[int, float]]:
    """``(tokens scored, seconds)`` points from the fastest time per draft size: made
    non-decreasing (the running minimum from the right), and with ``widths`` a step per width
    (a point at each end of a width's range, so interpolation stays flat inside it)."""
    sizes = sorted(best)
    floor = float("inf")
    clean: dict[int, float] = {}
    for n in reversed(sizes):
        floor = min(floor, best[n])
        clean[n] = floor
    if not widths:
        return [(n + 1, clean[n]) for n in sizes]
    points: list[tuple[int, float]] = []
    low = 1
    for w in widths:
        inside = [clean[n] for n in sizes if low <= n + 1 <= w]
        if inside:
            points += [(low, min(inside))] + ([(w, min(inside))] if w > low else [])
        low = w + 1
    return points
