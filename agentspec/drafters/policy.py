"""Cost-aware draft sizing: speculate only as much as the target's measured costs repay.

A step that verifies ``n`` draft nodes costs ``cost(n)`` seconds (one target forward over
``n + 1`` tokens). With per-token acceptance ``alpha`` a chain of length ``L`` yields, in
expectation, ``1 + alpha + ... + alpha**L = (1 - alpha**(L+1)) / (1 - alpha)`` tokens (the
accepted ones plus the recovered/bonus token; Leviathan et al. 2023, eq. 1). The policy picks
the ``L`` that maximises tokens per second, and ``L = 0`` (no draft) when no length beats plain
decoding's ``1 / cost(0)``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Measured on the 2-core CPU with SmolLM2-135M at ~600 tokens of context (ARCHITECTURE.md §10):
# forward seconds for 1, 8, 16, 32 and 64 new tokens.
DEFAULT_COST_POINTS = ((1, 0.058), (8, 0.084), (16, 0.114), (32, 0.152), (64, 0.220))


@dataclass(frozen=True)
class CostModel:
    """Forward time as a function of tokens scored: ``seconds = base + per_token * tokens``."""

    base: float
    per_token: float

    def __post_init__(self) -> None:
        if self.base <= 0 or self.per_token < 0:
            raise ValueError(f"cost model needs base > 0 and per_token >= 0, got {self.base}, {self.per_token}")

    def seconds(self, draft_nodes: int) -> float:
        """Cost of a step scoring the root plus ``draft_nodes`` nodes."""
        return self.base + self.per_token * (draft_nodes + 1)

    @staticmethod
    def fit(points: tuple[tuple[int, float], ...] | list[tuple[int, float]]) -> CostModel:
        """Least-squares line through ``(tokens, seconds)`` points (slope clipped at 0)."""
        n = len(points)
        mx = sum(p[0] for p in points) / n
        my = sum(p[1] for p in points) / n
        var = sum((p[0] - mx) ** 2 for p in points)
        slope = max(0.0, sum((p[0] - mx) * (p[1] - my) for p in points) / var) if var else 0.0
        base = max(my - slope * mx, 1e-6)
        return CostModel(base, slope)


DEFAULT_COST = CostModel.fit(DEFAULT_COST_POINTS)


def expected_tokens(alpha: float, length: int) -> float:
    """Expected tokens per step from a chain of ``length`` with per-token acceptance ``alpha``."""
    if alpha >= 1.0:
        return length + 1.0
    return (1.0 - alpha ** (length + 1)) / (1.0 - alpha)


def best_length(alpha: float, max_length: int, cost: CostModel) -> int:
    """The draft length in ``[0, max_length]`` that maximises expected tokens per second."""
    best, best_rate = 0, 1.0 / cost.seconds(0)
    length, power, total = 0, 1.0, 1.0
    while length < max_length:
        length += 1
        power *= alpha
        total += power
        rate = total / cost.seconds(length)
        if rate > best_rate:
            best, best_rate = length, rate
        if power < 1e-4:  # further tokens add nothing measurable
            break
    return best


class Acceptance:
    """Per-token acceptance of one source, a decayed count with a Beta prior."""

    def __init__(self, prior: float = 0.6, strength: float = 4.0, decay: float = 0.9) -> None:
        self.hits = prior * strength
        self.misses = (1 - prior) * strength
        self.decay = decay

    @property
    def alpha(self) -> float:
        return self.hits / (self.hits + self.misses)

    def update(self, drafted: int, accepted: int) -> None:
        """A chain of ``drafted`` tokens had ``accepted`` accepted (then, maybe, a rejection)."""
        self.hits = self.decay * self.hits + accepted
        self.misses = self.decay * self.misses + (1.0 if accepted < drafted else 0.0)


def measure_cost(target: Any, *, sizes: tuple[int, ...] = (0, 15, 31, 63), context: int = 384,
                 repeats: int = 3, cache_file: Path | None = None) -> CostModel:
    """Time the target's forward over ``1 + n`` draft tokens at about ``context`` tokens of KV.

    One prefill, then each timed step is rolled back (all drafts rejected), so the context
    grows by one token per measurement. The fastest of ``repeats`` runs counts (noise from
    other processes only ever adds time). Cached as JSON in ``cache_file`` (per model
    fingerprint and device) when given.
    """
    if cache_file is not None and cache_file.exists():
        try:
            data = json.loads(cache_file.read_text())
            return CostModel(float(data["base"]), float(data["per_token"]))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache file is measured again
    from agentspec.types import Draft, Verdict

    prompt = [1 + t % (target.vocab_size - 1) for t in range(context)]
    target.start(prompt)
    points: list[tuple[int, float]] = []
    for n in sizes:
        draft = Draft.chain([7] * n, "cost") if n else Draft()
        best = float("inf")
        for _ in range(repeats + 1):  # the first run warms up
            t0 = time.perf_counter()
            logits = target.score(prompt[-1], draft)
            float(logits[0, 0])  # wait for the device
            best = min(best, time.perf_counter() - t0)
            target.commit(draft, Verdict((), (), prompt[-1]))
        points.append((n + 1, best))
    model = CostModel.fit(points)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps({"base": model.base, "per_token": model.per_token,
                                          "points": points}))
    return model
