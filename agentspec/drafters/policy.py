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

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from agentspec.engine.cost import DEFAULT_COST as DEFAULT_COST
from agentspec.engine.cost import CostModel as CostModel


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


