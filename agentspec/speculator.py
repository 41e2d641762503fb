"""The facade users hold: ``Speculator.generate``, ``stream`` and ``session``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentspec.config import SamplingParams, SpecConfig
from agentspec.decode import NoDrafter, Step, decode
from agentspec.drafters.chain import DrafterChain
from agentspec.drafters.policy import CostModel, measure_cost
from agentspec.home import agentspec_home
from agentspec.memory import conversation_key
from agentspec.protocols import DraftContext, Drafter
from agentspec.sampling import make_generator
from agentspec.session import Session, current_session
from agentspec.target import HFTarget, load_target
from agentspec.text import Prompt, StopStrings, TextDeltas, encode_prompt, validate_prompt
from agentspec.types import Generation, GenerationStats


@dataclass
class _Run:
    """Mutable bookkeeping of one generation, turned into a Generation at the end."""

    prompt_len: int
    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    generation: Generation | None = None

    def count(self, step: Step) -> None:
        self.steps += 1
        draft = step.draft
        for node in range(draft.num_nodes):
            src = draft.source_of(node)
            self.drafted[src] = self.drafted.get(src, 0) + 1
        for node in step.verdict.path:
            src = draft.source_of(node)
            self.accepted[src] = self.accepted.get(src, 0) + 1

    def stats(self) -> GenerationStats:
        return GenerationStats(steps=self.steps, new_tokens=len(self.token_ids),
                               prompt_tokens=self.prompt_len,
                               seconds=time.perf_counter() - self.started,
                               drafted=dict(self.drafted), accepted=dict(self.accepted))


class Speculator:
    """Exact speculative decoding on one target model with draftless drafters.

    Args:
        target: the loaded model (see :func:`agentspec.load_target`).
        memory: a :class:`agentspec.memory.CompletionMemory` to draft from and record into;
            None drafts from the prompt only.
        drafters: draft sources, overriding the default (memory, suffix, prompt lookup).
        config: draft-size limits.
        speculate: False runs plain decoding through the same loop (the baseline).
        cost: the target's forward cost model; ``"measure"`` times it once per model and
            device (cached under ``$AGENTSPEC_HOME/costs``).
        draft_model: a small causal LM (a loaded ``HFTarget``, or a name for ``load_target``)
            added last to the default drafters as the fallback
            (:class:`~agentspec.drafters.model.ModelDrafter`); ignored when ``drafters`` is given.
    """

    def __init__(self, target: HFTarget, *, memory: Any = None,
                 drafters: Sequence[Drafter] | None = None, config: SpecConfig | None = None,
                 speculate: bool = True, cost: CostModel | str = "measure",
                 draft_model: str | HFTarget | None = None) -> None:
        self.target = target
        self.memory = memory
        self.config = config or SpecConfig()
        self.speculate = speculate
        self.stop_token_ids = _stop_ids(target)
        self.draft_model = draft_model
        self.drafters = list(drafters) if drafters is not None else self._default_drafters()
        self._cost = cost
        self._chain: DrafterChain | None = None
        # One model, one KV: calls from several threads take turns (batch size 1 per call).
        self._lock = threading.RLock()

    @classmethod
    def from_pretrained(cls, name: str = "smollm2-135m-instruct", *, speculate: bool = True,
                        memory: Any = "default", device: str | None = None,
                        config: SpecConfig | None = None,
                        cost: CostModel | str = "measure",
                        draft_model: str | HFTarget | None = None) -> Speculator:
        """Load a packaged or local model (offline) and wrap it.

        Args:
            memory: ``"default"`` (the SQLite file under ``$AGENTSPEC_HOME``), a SQLAlchemy URL,
                a :class:`~agentspec.memory.CompletionMemory`, or None for no memory.
            draft_model: a small model drafting when nothing better does (see ``__init__``).
        """
        target = load_target(name, device=device)
        return cls(target, memory=open_memory(memory), config=config, speculate=speculate,
                   cost=cost, draft_model=draft_model)

    def warmup(self) -> None:
        """Do the one-time work now rather than inside the first call: measure the target's
        forward cost (cached per model and device) and load the memory's embedder."""
        self._drafter()
        if self.memory is not None:
            self.memory.embedder.embed(["warm up"])

    def _default_drafters(self) -> list[Drafter]:
        from agentspec.drafters.memory import MemoryDrafter
        from agentspec.drafters.prompt_lookup import PromptLookupDrafter
        from agentspec.drafters.suffix import SuffixDrafter

        drafters: list[Drafter] = []
        if self.memory is not None:
            fp = self.target.fingerprint
            drafters += [MemoryDrafter(self.memory, fp, max_nodes=self.config.max_tree_nodes),
                         SuffixDrafter(self.memory, fp)]
        drafters.append(PromptLookupDrafter(self.config))
        if self.draft_model is not None:
            drafters.append(self._model_drafter(self.draft_model))
        return drafters

    def _model_drafter(self, draft_model: str | HFTarget) -> Drafter:
        from agentspec.drafters.model import ModelDrafter

        if draft_model is self.target:
            raise ValueError("draft_model must be another model (or another HFTarget): the "
                             "target's own KV cannot also hold the drafts")
        if isinstance(draft_model, str):
            draft_model = load_target(draft_model, device=str(self.target.device))
        return ModelDrafter(draft_model, self.tokenizer)

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a raw prompt, or of messages through the chat template."""
        return encode_prompt(self.tokenizer, prompt)

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, *,
                 sampling: SamplingParams | None = None, stop: Sequence[str] = (),
                 scope: str | None = None, record: bool = True) -> Generation:
        """Generate a completion; greedy output is token-identical to plain decoding.

        Args:
            prompt: a raw string, or ``[{"role", "content"}]`` messages (chat template applied,
                generation prompt added).
            max_new_tokens: upper bound on generated tokens.
            sampling: default greedy.
            stop: stop strings; the text is cut before the first one.
            scope: the memory scope (tenant / agent role) of this call; default the current
                session's scope, else ``"default"``.
            record: add the completion to the memory (when there is one).
        """
        run = self._new_run(prompt, max_new_tokens)
        for _ in self._run(run, prompt, max_new_tokens, sampling, stop, scope, record):
            pass
        assert run.generation is not None
        return run.generation

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, *,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (),
               scope: str | None = None, record: bool = True) -> Iterator[str]:
        """Like :meth:`generate`, yielding text deltas as steps commit them."""
        run = self._new_run(prompt, max_new_tokens)
        yield from self._run(run, prompt, max_new_tokens, sampling, stop, scope, record)

    def _new_run(self, prompt: Prompt, max_new_tokens: int) -> _Run:
        validate_prompt(prompt)
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        return _Run(prompt_len=0)

    def _run(self, run: _Run, prompt: Prompt, max_new_tokens: int,
             sampling: SamplingParams | None, stop: Sequence[str],
             scope: str | None, record: bool) -> Iterator[str]:
        with self._lock:
            yield from self._run_locked(run, prompt, max_new_tokens, sampling, stop, scope, record)

    def _run_locked(self, run: _Run, prompt: Prompt, max_new_tokens: int,
                    sampling: SamplingParams | None, stop: Sequence[str],
                    scope: str | None, record: bool) -> Iterator[str]:
        session = current_session(self)
        scope = scope or (session.scope if session else "default")
        sampling = sampling or SamplingParams()
        stops = StopStrings(stop)
        prompt_ids = self.encode(prompt)
        run.prompt_len = len(prompt_ids)
        self.target.check_length(len(prompt_ids) + max_new_tokens)
        key_text = conversation_key(prompt) if self.memory is not None else ""
        generator = make_generator(sampling.seed, self.target.device)
        context = DraftContext(tokens=list(prompt_ids), prompt_len=len(prompt_ids), scope=scope,
                               key_text=key_text,
                               extra_sources=tuple(session.sources) if session else (),
                               sampling=sampling, generator=generator)
        deltas = TextDeltas(self.tokenizer, stops)
        steps = decode(self.target, self._drafter(), context, sampling=sampling,
                       max_new_tokens=max_new_tokens, stop_token_ids=self.stop_token_ids,
                       generator=generator)
        for step in steps:
            run.count(step)
            run.token_ids.extend(step.new_tokens)
            delta, hit_stop = deltas.push(step.new_tokens)
            if delta:
                yield delta
            if step.stopped or hit_stop:
                run.finish_reason = "stop"
                if hit_stop:
                    run.token_ids[:] = run.token_ids[: deltas.kept_tokens]
                break
        tail = deltas.flush()
        if tail:
            yield tail
        run.text = deltas.text
        run.generation = Generation(run.text, tuple(run.token_ids), run.stats(), run.finish_reason)
        if session is not None:
            session.observe(run.generation)
        if record and self.memory is not None and run.token_ids:
            self.memory.record(scope=scope, model=self.target.fingerprint,
                               request_text=_request_text(prompt), key_text=key_text,
                               completion_text=run.text, completion_ids=list(run.token_ids))

    def session(self, name: str, *, scope: str = "default") -> Session:
        """A context manager grouping the calls of one agent task; see :mod:`agentspec.session`."""
        return Session(self, name, scope=scope)

    def tool_loop(self, *, scope: str = "default", name: str | None = None) -> Any:
        """Decorator: run each call of an agent-loop function in one session; see :mod:`agentspec.adapters.decorators`."""
        from agentspec.adapters.decorators import tool_loop

        return tool_loop(self, scope=scope, name=name)

    def _drafter(self) -> Drafter:
        if not self.speculate or not self.drafters:
            return NoDrafter()
        if self._chain is None:  # kept across calls: per-source acceptance is learned over time
            cost = self._cost if isinstance(self._cost, CostModel) else self._measure_cost()
            self._chain = DrafterChain(self.drafters, cost=cost,
                                       trees=self.config.trees and self.target.supports_trees,
                                       max_depth=self.config.max_draft_tokens)
        return self._chain

    def _measure_cost(self) -> CostModel:
        fp = self.target.fingerprint.replace(":", "-")
        dtype = str(next(self.target.model.parameters()).dtype).removeprefix("torch.")
        cache = agentspec_home() / "costs" / f"{fp}-{self.target.device.type}-{dtype}.json"
        return measure_cost(self.target, cache_file=cache)


def open_memory(memory: Any) -> Any:
    """``"default"`` | URL | CompletionMemory | None -> a CompletionMemory or None."""
    if memory is None or not isinstance(memory, str):
        return memory
    from agentspec.memory import CompletionMemory

    url = None if memory == "default" else memory
    return CompletionMemory.open(url, index_dir=agentspec_home() / "index")


def _request_text(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps([dict(m) for m in prompt])


def _stop_ids(target: HFTarget) -> frozenset[int]:
    ids: set[int] = set()
    for source in (target.model.generation_config.eos_token_id, target.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)
