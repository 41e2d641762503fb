"""The benchmark loop: every request through every system, interleaved, rotated, checked.

Systems (names as on the command line):

- ``hf-greedy``: transformers ``model.generate(do_sample=False)``, the reference (with
  temperature > 0: ``do_sample=True`` with the same temperature, top-k and top-p off).
- ``hf-pld``: the same with ``prompt_lookup_num_tokens=10`` (transformers' prompt lookup).
- ``hf-static``: the same with a static KV, the decoding forward compiled as transformers
  does it on CUDA (:mod:`agentspec.bench.hf`); warmed once, untimed, on the first measured
  request, so compiling is not timed.
- ``agentspec-plain``: :class:`~agentspec.Speculator` with ``speculate=False``.
- ``agentspec-pld``: the Speculator without memory (prompt lookup only); it runs the warmup
  lines too (its prefix cache and acceptance estimates carry over, as in use).
- ``agentspec``: all drafters and a completion memory, warmed by the workload's warmup lines
  and by every earlier measured line (``record=True``), as in real use.
- ``agentspec-chain``: the same with tree drafts off (``SpecConfig(trees=False)``: each step
  verifies its best chain), in a memory of its own: what trees add.
- ``agentspec-head``: ``agentspec`` plus the trained draft head of the model (``agentspec
  head train``; the other memory systems run without it), in a memory of its own.
- ``agentspec-suffix``: the draftless methods that index past outputs, SuffixDecoding (Oliaro
  et al. 2024: suffix matches over earlier outputs and the prompt) and REST (He et al. 2023:
  retrieval by exact suffix match from a datastore, here the earlier outputs): the suffix
  drafter over its own store of every earlier completion, and prompt lookup; no semantic
  lookup (its store's keys are hashed, not embedded by MiniLM), agentspec's engine and policy.

Per request the systems run one after another, the order rotated by one each request, so
that a slow or fast phase of a shared machine falls on every system alike (docs/architecture.md).
A system's time is wall-clock around tokenisation + generation. Outputs are compared as
token lists cut before the first stop token id (transformers stops at eos and keeps it).
"""

from __future__ import annotations

import inspect
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentspec.bench.results import (
    DTYPES,
    BenchConfig,
    BenchResult,
    Outcome,
    RequestResult,
    System,
    budget,
    grammar_of,
    prompt_of,
)
from agentspec.bench.workload import Workload, WorkloadItem
from agentspec.text import cut_at_stop

# Systems with a completion memory.
MEMORY_SYSTEMS = ("agentspec", "agentspec-chain", "agentspec-head", "agentspec-suffix")
# Systems that carry something from one call to the next (a memory, the target's prefix cache,
# the drafters' acceptance estimates): the warmup lines run through them, as the traffic
# before the measured calls would in use. agentspec-plain reuses nothing.
WARMED_SYSTEMS = ("agentspec-pld", *MEMORY_SYSTEMS)

Progress = Callable[[int, int, str], None]


class SpecSystem:
    """A :class:`~agentspec.Speculator` (plain, prompt lookup, or with memory)."""

    def __init__(self, name: str, spec: Any, *, temperature: float, record: bool = False) -> None:
        self.name, self.spec, self.temperature, self.record = name, spec, temperature, record
        self._takes_record = "record" in inspect.signature(spec.generate).parameters

    def run(self, item: WorkloadItem, max_new_tokens: int, seed: int | None) -> Outcome:
        from agentspec import SamplingParams

        sampling = SamplingParams(temperature=self.temperature, seed=seed, grammar=grammar_of(item))
        kwargs: dict[str, Any] = {"sampling": sampling, "scope": item.scope}
        if self._takes_record:
            kwargs["record"] = self.record
        started = time.perf_counter()
        gen = self.spec.generate(prompt_of(item), max_new_tokens, **kwargs)
        seconds = time.perf_counter() - started
        stats = gen.stats
        # The generation's own clock starts after the prompt is encoded; the bench's before.
        first = stats.first_token_seconds + (seconds - stats.seconds)
        return Outcome(cut_at_stop(gen.token_ids, self.spec.stop_token_ids)[0], seconds,
                       stats.steps, dict(stats.drafted_by_source), dict(stats.accepted_by_source),
                       gen.text, stats.cached_tokens, first)


def build_systems(target: Any, config: BenchConfig, db_url: str,
                  chain_db_url: str | None = None, *,
                  static_len: int | None = None,
                  head_db_url: str | None = None,
                  suffix_db_url: str | None = None) -> dict[str, System]:
    """The named systems on one loaded target.

    They share its weights; each agentspec system keeps a KV of its own, so prompt-prefix reuse
    only ever spans that system's own calls. ``agentspec-plain`` reuses nothing: it measures
    the loop's overhead against transformers. One-time work (the cost curve, the embedder)
    happens here, before anything is timed; ``hf-static`` compiles in its ``warm``.
    ``static_len`` is hf-static's KV length (the workload's longest prompt plus budget).
    """
    from agentspec import SpecConfig, Speculator
    from agentspec.bench.hf import HFStaticSystem, HFSystem
    from agentspec.engine.target import HFTarget

    t = config.temperature
    if "agentspec-chain" in config.systems and chain_db_url is None:
        raise ValueError("agentspec-chain needs a memory database of its own (chain_db_url)")
    plain = Speculator(HFTarget(target.model, target.tokenizer, name=target.name,
                                reuse_prefix=False), speculate=False, memory=None)
    # Prompt lookup only: no head either, even where one is trained for the model.
    pld = Speculator(target.fork(), config=SpecConfig(draft_head=False), memory=None)
    pld.warmup()
    built: dict[str, System] = {}
    for name in config.systems:
        if name == "hf-greedy":
            built[name] = HFSystem(name, plain, temperature=t, prompt_lookup=False)
        elif name == "hf-pld":
            built[name] = HFSystem(name, plain, temperature=t, prompt_lookup=True)
        elif name == "hf-static":
            built[name] = HFStaticSystem(name, plain, temperature=t, max_cache_len=static_len)
        elif name == "agentspec-plain":
            built[name] = SpecSystem(name, plain, temperature=t)
        elif name == "agentspec-pld":
            built[name] = SpecSystem(name, pld, temperature=t)
        elif name == "agentspec":
            built[name] = SpecSystem(name, memory_speculator(
                target, db_url, SpecConfig(draft_head=False)), temperature=t, record=True)
        elif name == "agentspec-chain":
            assert chain_db_url is not None
            built[name] = SpecSystem(name, memory_speculator(target, chain_db_url,
                                                              SpecConfig(trees=False,
                                                                         draft_head=False)),
                                     temperature=t, record=True)
        elif name == "agentspec-head":
            from agentspec.drafters.head import heads_exist

            if head_db_url is None or not heads_exist(target.fingerprint):
                raise ValueError("agentspec-head needs a trained head for the model "
                                 "(agentspec head train) and a memory database of its own")
            built[name] = SpecSystem(name, memory_speculator(target, head_db_url), temperature=t,
                                     record=True)
        elif name == "agentspec-suffix":
            if suffix_db_url is None:
                raise ValueError("agentspec-suffix needs a memory database of its own")
            built[name] = SpecSystem(name, suffix_speculator(target, suffix_db_url),
                                     temperature=t, record=True)
        else:
            raise ValueError(f"unknown system {name!r}")
    return built


def memory_speculator(target: Any, db_url: str, config: Any = None, cost: Any = "measure") -> Any:
    """A warmed Speculator on a fork of ``target`` with a completion memory in ``db_url``
    (the memory systems; :mod:`agentspec.bench.ab` builds its variants with it)."""
    from agentspec import Speculator
    from agentspec.memory.completion import CompletionMemory
    from agentspec.stores import SQLStore

    spec = Speculator(target.fork(), memory=CompletionMemory(SQLStore(db_url)), config=config,
                      cost=cost)
    spec.warmup()
    return spec


def suffix_speculator(target: Any, db_url: str, config: Any = None) -> Any:
    """Suffix matching over earlier outputs and prompt lookup (``agentspec-suffix``): its store
    keeps every completion for the suffix drafter; keys get a hashed vector (no model), as
    nothing looks them up."""
    from agentspec import SpecConfig, Speculator
    from agentspec.drafters.prompt_lookup import PromptLookupDrafter
    from agentspec.drafters.suffix import SuffixDrafter
    from agentspec.memory.completion import CompletionMemory
    from agentspec.memory.embedder import HashEmbedder
    from agentspec.stores import SQLStore

    fork = target.fork()
    memory = CompletionMemory(SQLStore(db_url), embedder=HashEmbedder(8))
    config = config or SpecConfig()
    spec = Speculator(fork, memory=memory, config=config,
                      drafters=[SuffixDrafter(memory, fork.fingerprint), PromptLookupDrafter(config)])
    spec.warmup()
    return spec


def rotation(names: Sequence[str], index: int) -> list[str]:
    """The run order of request ``index``: ``names`` rotated left by ``index``."""
    k = index % len(names)
    return list(names[k:]) + list(names[:k])


def _seeds(config: BenchConfig, index: int) -> list[int | None]:
    if config.temperature == 0:
        return [None]
    return [config.seed + 1000 * index + s for s in range(config.samples)]


def run_requests(workload: Workload, systems: dict[str, System], config: BenchConfig,
                 *, encode: Callable[[Any], list[int]],
                 on_progress: Progress | None = None,
                 warmup_outputs: dict[str, tuple[int, ...]] | None = None,
                 warmed: Sequence[str] = WARMED_SYSTEMS) -> tuple[RequestResult, ...]:
    """Warmup lines through the warmed systems (``warmed``, untimed), a system with a ``warm`` method (one
    that compiles) once on the first measured line (untimed), then each measured line through
    every system in rotated order. Pure loop over the :class:`System` seam (tests inject
    systems). ``warmup_outputs``, when given, receives the first warmed system's output of
    each warmup line (by id)."""
    warm = [name for name in warmed if name in systems]
    warmup = workload.warmup if warm else ()
    measure = workload.measure
    total, done = len(warmup) + len(measure), 0
    for item in warmup:
        for name in warm:
            out = systems[name].run(item, budget(item, config), None)
            if warmup_outputs is not None and name == warm[0]:
                warmup_outputs[item.id] = out.token_ids
        done += 1
        if on_progress:
            on_progress(done, total, f"warmup {item.id}")
    for name, system in systems.items():
        warm_once = getattr(system, "warm", None)  # compiles: once, untimed, on a real prompt
        if callable(warm_once) and measure:
            if on_progress:
                on_progress(done, total, f"warmup {name} on {measure[0].id}")
            warm_once(measure[0], budget(measure[0], config))
    results = []
    for index, item in enumerate(measure):
        outcomes: dict[str, list[Outcome]] = {name: [] for name in systems}
        for seed in _seeds(config, index):
            for name in rotation(list(systems), index):
                outcomes[name].append(systems[name].run(item, budget(item, config), seed))
        results.append(RequestResult(item, len(encode(prompt_of(item))), budget(item, config),
                                     {k: tuple(v) for k, v in outcomes.items()}))
        done += 1
        if on_progress:
            times = ", ".join(f"{k} {sum(o.seconds for o in v):.1f}s/"
                              f"{sum(len(o.token_ids) for o in v)}t" for k, v in outcomes.items())
            on_progress(done, total, f"measure {item.id}: {times}")
    return tuple(results)


def run_bench(workload: Workload, model: str, config: BenchConfig,
              *, on_progress: Progress | None = None) -> BenchResult:
    """Load ``model``, build the systems and run the workload.

    Args:
        workload: from :func:`agentspec.bench.workload.load_workload`.
        model: target name for :func:`agentspec.load_target`.
        config: systems and sampling.
        on_progress: called with ``(done, total, label)`` after every request.
    """
    from agentspec import Speculator, load_target

    target = load_target(model, device=config.device, dtype=_torch_dtype(config.dtype),
                         quantize=config.quantize, prefix_cache_bytes=config.prefix_cache_bytes)
    encode = Speculator(target, speculate=False, memory=None).encode
    static_len = max((len(encode(prompt_of(i))) + budget(i, config) for i in workload.measure),
                     default=None) if "hf-static" in config.systems else None
    with tempfile.TemporaryDirectory(prefix="agentspec-bench-") as tmp:
        db_url = config.db or f"sqlite:///{Path(tmp) / 'memory.db'}"
        systems = build_systems(target, config, db_url, f"sqlite:///{Path(tmp) / 'chain.db'}",
                                static_len=static_len,
                                head_db_url=f"sqlite:///{Path(tmp) / 'head.db'}",
                                suffix_db_url=f"sqlite:///{Path(tmp) / 'suffix.db'}")
        warmup_outputs: dict[str, tuple[int, ...]] = {}
        requests = run_requests(workload, systems, config, encode=encode,
                                on_progress=on_progress, warmup_outputs=warmup_outputs)
        for name in MEMORY_SYSTEMS:
            close_memory(systems.get(name))
    ceiling = None
    if config.temperature == 0 and "agentspec" in systems:
        from agentspec.bench.replay import Constraint, bench_ceiling

        ceiling = bench_ceiling(workload, warmup_outputs, requests, target.tokenizer,
                                config.max_new_tokens, Constraint.of(target),
                                save_to=config.lines_out)
    notes = tuple(note for s in systems.values() if (note := getattr(s, "note", None)))
    # The machine may be shared: the 1/5/15-minute load at the end says how loaded it was.
    return BenchResult(str(workload.path), model, str(target.device), config,
                       len(workload.warmup) if set(WARMED_SYSTEMS) & set(systems) else 0,
                       requests, os.getloadavg(), notes=notes, ceiling_tokens_per_step=ceiling,
                       **environment(target.model))


def _torch_dtype(name: str | None) -> Any:
    import torch

    if name is None or DTYPES[name] == "gguf":
        return None if name is None else "gguf"
    return getattr(torch, DTYPES[name])


def environment(model: Any) -> dict[str, Any]:
    """What ran it: the weights' dtype (a :data:`DTYPES` key), the GPU's name, the versions."""
    import torch
    import transformers

    from agentspec.engine.quant.model import weights_mode

    param = next(model.parameters())
    names = {v: k for k, v in DTYPES.items()}
    dtype = weights_mode(model)
    return {"dtype": names.get(dtype, dtype),
            "gpu_name": torch.cuda.get_device_name(param.device)
            if param.device.type == "cuda" else None,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}


def close_memory(system: System | None) -> None:
    """Close the memory of a system's Speculator, if it has one (before its folder goes)."""
    memory = getattr(getattr(system, "spec", None), "memory", None)
    close = getattr(memory, "close", None)
    if callable(close):
        close()
