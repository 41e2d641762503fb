"""Cost-aware draft sizing: speculate only as much as the target's measured costs repay.

A step that verifies ``n`` draft nodes costs ``cost(n)`` seconds (one target forward over
``n + 1`` tokens). With per-token acceptance ``alpha`` a chain of length ``L`` yields, in
expectation, ``1 + alpha + ... + alpha**L = (1 - alpha**(L+1)) / (1 - alpha)`` tokens (the
accepted ones plus the recovered/bonus token; Leviathan et al. 2023, eq. 1). The policy picks
the ``L`` that maximises tokens per second, and ``L = 0`` (no draft) when no length beats plain
decoding's ``1 / cost(0)``. ``cost`` is measured per model and device, point by point: on a
CPU it is far from a line (scoring 2-3 tokens can cost more than 4-8).
"""

from __future__ import annotations

import contextlib
import heapq
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def expected_tokens(alpha: float, length: int) -> float:
    """Expected tokens per step from a chain of ``length`` with per-token acceptance ``alpha``."""
    if alpha >= 1.0:
        return length + 1.0
    return (1.0 - alpha ** (length + 1)) / (1.0 - alpha)


def best_length(alpha: float, max_length: int, cost: CostModel, overhead: float = 0.0) -> int:
    """The draft length in ``[0, max_length]`` that maximises expected tokens per second;
    ``overhead`` is the drafter's own time to propose, paid by any draft."""
    best, best_rate = 0, 1.0 / cost.seconds(0)
    length, power, total = 0, 1.0, 1.0
    while length < max_length:
        length += 1
        power *= alpha
        total += power
        rate = total / (cost.seconds(length) + overhead)
        if rate > best_rate:
            best, best_rate = length, rate
        if power < 1e-4:  # further tokens add nothing measurable
            break
    return best


@dataclass(frozen=True)
class SharedCost:
    """A forward's seconds as one request's draft sizing sees them inside a batched step:
    ``cost`` (by rows beyond the first) at the step's other ``rows`` plus the draft's, plus the
    ``extra`` seconds the other rows add beyond their count (their keys read)."""

    cost: CostModel
    rows: int
    extra: float = 0.0

    def seconds(self, draft_nodes: int) -> float:
        return self.cost.seconds(self.rows + draft_nodes) + self.extra


def best_tree_rate(alpha: float, cost: CostModel | SharedCost, overhead: float = 0.0, *,
                   max_depth: int, alternative: float | None = None, max_nodes: int = 64,
                   base: float = 0.0) -> float:
    """The highest expected tokens per second any draft of up to ``max_nodes`` nodes and
    ``max_depth`` deep can give from a source with these acceptances (chain or tree): the
    rate of the most probable nodes of the source's infinite tree (every node with a first
    child and endless alternatives, probabilities as :func:`node_probabilities` gives them).
    ``alternative=0`` bounds chains; ``base``: tokens the step's other rows yield (a batched
    step). Used to skip asking a source that cannot win."""
    beta = alpha if alternative is None else alternative
    miss = (1.0 - alpha) * beta
    best_rate, total = (1.0 + base) / cost.seconds(0), 1.0 + base
    # Nodes come off the heap most probable first: a node enters once the node it cannot be
    # more probable than is out (its first child and first alternative once it is; the k+1-th
    # alternative once the k-th is). Entries: (-p, the parent's p, sibling rank, depth).
    heap: list[tuple[float, float, int, int]] = []

    def children(p: float, depth: int) -> None:
        if depth < max_depth:
            heapq.heappush(heap, (-p * alpha, p, 0, depth + 1))
            if miss > 0:
                heapq.heappush(heap, (-p * miss, p, 1, depth + 1))

    children(1.0, 0)
    for n in range(1, max_nodes + 1):
        if not heap:
            break
        neg, parent, rank, depth = heapq.heappop(heap)
        if -neg < 1e-4:  # further nodes add nothing measurable
            break
        total -= neg
        best_rate = max(best_rate, total / (cost.seconds(n) + overhead))
        children(-neg, depth)
        if rank >= 1:
            heapq.heappush(heap, (neg * (1.0 - beta), parent, rank + 1, depth))
    return best_rate


def node_probabilities(parents: tuple[int, ...] | list[int], alpha: float | Sequence[float],
                       alternative: float | None = None) -> list[float]:
    """P(node accepted) for a draft tree whose candidates come best first.

    The first child of an accepted node is accepted with probability ``alpha``: one rate for
    every node, or one per node (its acceptance class's). Its later siblings are
    alternatives, tried where the first child fails: the ``k``-th (``k >= 1``) with
    ``(1 - a) * beta * (1 - beta) ** (k - 1)``, ``a`` the first child's rate and ``beta =
    alternative`` (how often an alternative was right where the first child was wrong;
    default ``a``). Siblings exclude each other; a chain of one rate gets ``alpha ** depth``;
    no node is more probable than its parent.
    """
    rates = [float(alpha)] * len(parents) if isinstance(alpha, float | int) else list(alpha)
    if len(rates) != len(parents):
        raise ValueError(f"{len(rates)} acceptance rates for {len(parents)} nodes")
    probs: list[float] = []
    first: dict[int, float] = {}  # parent -> its first child's rate
    count: dict[int, int] = {}
    for node, parent in enumerate(parents):
        rank = count.get(parent, 0)
        count[parent] = rank + 1
        above = 1.0 if parent < 0 else probs[parent]
        if rank == 0:
            step = first[parent] = rates[node]
        else:
            lead = first[parent]
            beta = lead if alternative is None else alternative
            step = (1.0 - lead) * beta * (1.0 - beta) ** (rank - 1)
        probs.append(above * step)
    return probs


def best_subtree(parents: tuple[int, ...] | list[int], alpha: float | Sequence[float],
                 cost: CostModel | SharedCost, overhead: float = 0.0,
                 alternative: float | None = None, *, base: float = 0.0) -> tuple[list[int], float]:
    """The nodes worth verifying and the expected tokens per second they give.

    Keeps the ``n`` most probable nodes (always a subtree: parents are at least as probable
    as their children and come first on ties), ``n`` maximising expected tokens, ``1 + sum
    of P(node)``, per second of ``cost(n) + overhead``. ``([], plain rate)`` when no draft pays.
    ``alpha``: one acceptance rate, or one per node (:func:`node_probabilities`). For a chain
    of one rate this is :func:`best_length`. In a batched step ``cost`` is a
    :class:`SharedCost` and ``base`` the tokens the step's other rows yield: a node is kept
    only where it raises the whole step's rate.
    """
    probs = node_probabilities(parents, alpha, alternative)
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    best_n, best_rate, total = 0, (1.0 + base) / cost.seconds(0), 1.0 + base
    for n, node in enumerate(order, 1):
        if probs[node] < 1e-4:  # further nodes add nothing measurable
            break
        total += probs[node]
        rate = total / (cost.seconds(n) + overhead)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return sorted(order[:best_n]), best_rate


class Acceptance:
    """Per-token acceptance of one class of draft nodes, a decayed count with a Beta prior.

    ``alpha`` is the rate with the prior ``prior`` of weight ``strength``, decayed with the
    evidence. :meth:`alpha_over` is the rate of a class that refines a coarser one: the
    coarser class's rate as a prior of weight ``strength`` that does not decay, so a
    refinement starts as its coarser class and leaves it as its own evidence grows.
    """

    def __init__(self, prior: float = 0.6, strength: float = 4.0, decay: float = 0.9) -> None:
        self.hits = prior * strength
        self.misses = (1 - prior) * strength
        self.strength = strength
        self.decay = decay

    @classmethod
    def refining(cls, strength: float = 4.0, decay: float = 0.9) -> Acceptance:
        """A class with no evidence and no prior of its own (read it with :meth:`alpha_over`)."""
        acc = cls(0.0, strength, decay)
        acc.hits = acc.misses = 0.0
        return acc

    @property
    def alpha(self) -> float:
        return self.hits / (self.hits + self.misses)

    def alpha_over(self, prior: float) -> float:
        """The rate over a prior rate ``prior`` (the coarser class's) of weight ``strength``."""
        return (self.hits + self.strength * prior) / (self.hits + self.misses + self.strength)

    def update(self, drafted: int, accepted: int) -> None:
        """A chain of ``drafted`` tokens had ``accepted`` accepted (then, maybe, a rejection)."""
        self.add(accepted, 1.0 if accepted < drafted else 0.0)

    def add(self, hits: float, misses: float) -> None:
        """One draft's evidence: ``hits`` accepted nodes and ``misses`` rejected ones."""
        self.hits = self.decay * self.hits + hits
        self.misses = self.decay * self.misses + misses


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
    # The synthetic prompts' rows are of no later call's use: measured on a scratch sequence
    # the pool never caches (HFTarget.uncached).
    uncached = getattr(target, "uncached", None)
    with uncached() if callable(uncached) else contextlib.nullcontext():
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
    target.start(prompt)  # the first forward settles the target's widths (HFTarget.check_widths)
    widths = tuple(getattr(target, "widths", ()) or ())
    if sizes is None:
        sizes = tuple(w - 1 for w in widths) if widths else (0, 1, 2, 3, 5, 7, 11, 15, 23, 31, 47, 63)
    sizes = tuple(sorted(set(sizes)))
    best = dict(zip(sizes, _fastest_rounds(target, prompt[-1], sizes, repeats), strict=True))
    return CostModel.fit(cost_points(best, widths)), context


def probe_cost(target: Any, *, rounds: int = 3) -> list[float]:
    """Seconds of the target's forwards over 1 and 8 rows (:data:`PROBE_SIZES`) at
    :data:`PROBE_CONTEXT` tokens of KV, the fastest of ``rounds`` interleaved rounds (after
    one warm-up round): a cheap fingerprint of how fast the machine runs the target now."""
    prompt = [1 + t % (target.vocab_size - 1) for t in range(PROBE_CONTEXT)]
    target.start(prompt)
    return _fastest_rounds(target, prompt[-1], PROBE_SIZES, rounds)


def _fastest_rounds(target: Any, last: int, sizes: tuple[int, ...], rounds: int) -> list[float]:
    """The fastest of ``rounds`` interleaved rounds of the target's forward per draft size
    (after one warm-up round that is not counted); each draft is rolled back (all rejected),
    so the context grows by one token per forward."""
    from agentspec.types import Draft, Verdict

    best = [float("inf")] * len(sizes)
    for round_ in range(rounds + 1):
        for i, n in enumerate(sizes):
            draft = Draft.chain([7] * n, "cost") if n else Draft()
            t0 = time.perf_counter()
            logits = target.score(last, draft)
            float(logits[0, 0])  # wait for the device
            if round_:
                best[i] = min(best[i], time.perf_counter() - t0)
            target.commit(draft, Verdict((), (), last))
    return best


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
