"""What a bench run is asked and what it gives: its config, one system's outcome on one
request, the results; and how a workload item is put to every system.

The lowest module of the bench's run (:mod:`~agentspec.bench.harness` runs the systems,
:mod:`~agentspec.bench.hf` holds transformers' ones, :mod:`~agentspec.bench.report` sums
the results, :mod:`~agentspec.bench.replay` replays them): each imports these from here, so
none of them imports another for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentspec.bench.workload import WorkloadItem

# The system every other is compared with.
REFERENCE = "hf-greedy"
# --dtype names -> torch dtype attribute names.
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "gguf": "gguf"}
"""The bench's ``--dtype`` names and what each loads (``gguf``: a GGUF's weights held as the
file stores them, :mod:`agentspec.engine.quant`)."""
QUANTIZE = ("int8", "int4")
"""The bench's ``--quantize`` schemes: ``load_target``'s ``quantize``
(:data:`agentspec.engine.quant.quantize.SCHEMES`, named here so that checking them imports no
torch)."""


@dataclass(frozen=True)
class BenchConfig:
    """What to run.

    Attributes:
        systems: system names, the reference ``hf-greedy`` first.
        temperature: 0 is greedy.
        max_new_tokens: overrides every line's budget when set.
        samples: seeds per request when ``temperature > 0``.
        db: memory database URL of the ``agentspec`` system; ``None``: a fresh temporary file.
        seed: first seed of the sampled runs.
        device: where the target runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``); ``None``: CUDA
            when available, else the CPU (:func:`agentspec.load_target`'s default).
        dtype: the target's weights, a key of :data:`DTYPES`; ``None``: bf16 on CUDA, fp32 on
            the CPU.
        quantize: the target's weights quantized at load, one of :data:`QUANTIZE` (fp32
            loaded, then quantized; the CPU); ``None``: not.
        lines_out: a greedy run also writes its outputs (warmup and measured) here, in the
            offline replay's ``--outputs`` format (:mod:`agentspec.bench.replay`).
        prefix_cache_bytes: each agentspec system's prefix cache budget (``None``: the
            default, 0: off; :class:`~agentspec.engine.target.HFTarget`).
    """

    systems: tuple[str, ...]
    temperature: float = 0.0
    max_new_tokens: int | None = None
    samples: int = 1
    db: str | None = None
    seed: int = 1234
    device: str | None = None
    dtype: str | None = None
    lines_out: Path | None = None
    prefix_cache_bytes: int | None = None
    quantize: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got "
                             f"{self.quantize!r}")
        if not self.systems or self.systems[0] != REFERENCE:
            raise ValueError(f"systems must start with the reference 'hf-greedy', got {self.systems}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")


@dataclass(frozen=True)
class Outcome:
    """One system on one request (one seed).

    Attributes:
        token_ids: the output cut before the first stop token.
        seconds: wall-clock time of tokenisation + generation.
        steps: target forwards after the prefill (``None`` for transformers).
        drafted, accepted: draft tokens by source (agentspec only).
        text: the output text (agentspec only).
        cached_tokens: prompt tokens whose KV rows the call did not compute (held from the
            call before or restored from the prefix cache; agentspec only).
        first_token_seconds: from the call's start to its first new token (tokenisation,
            prefill, the first step); None where the system does not say.
    """

    token_ids: tuple[int, ...]
    seconds: float
    steps: int | None = None
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    text: str | None = None
    cached_tokens: int = 0
    first_token_seconds: float | None = None


class System(Protocol):
    """One way of generating: ``run`` one request and time it."""

    name: str

    def run(self, item: WorkloadItem, max_new_tokens: int, seed: int | None) -> Outcome: ...


@dataclass(frozen=True)
class RequestResult:
    """Every system's outcomes on one measured request (one outcome per seed)."""

    item: WorkloadItem
    prompt_tokens: int
    max_new_tokens: int
    outcomes: dict[str, tuple[Outcome, ...]]


@dataclass(frozen=True)
class BenchResult:
    """What :func:`agentspec.bench.harness.run_bench` measured, ready for
    :func:`agentspec.bench.report.summarize`."""

    workload: str
    model: str
    device: str
    config: BenchConfig
    warmup_requests: int
    requests: tuple[RequestResult, ...]
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    dtype: str | None = None
    gpu_name: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    # Tokens per step of the offline replay's hindsight ceiling over the measured requests
    # (greedy runs with the agentspec system only; see agentspec.bench.replay).
    ceiling_tokens_per_step: float | None = None


def prompt_of(item: WorkloadItem) -> Any:
    """The item's chat messages (as fresh dicts) or raw prompt, as the systems take it."""
    return [dict(m) for m in item.messages] if item.messages is not None else item.prompt


def grammar_of(item: WorkloadItem) -> Any:
    """The item's :class:`~agentspec.grammar.Grammar` (compiled once per distinct spec), or None."""
    if item.grammar is None:
        return None
    from agentspec.grammar import compiled

    return compiled(item.grammar)


def budget(item: WorkloadItem, config: BenchConfig) -> int:
    """The item's token budget under ``config``: its override, else the item's own."""
    out = config.max_new_tokens or item.max_new_tokens
    assert out is not None  # load_workload fills every line's budget
    return out
