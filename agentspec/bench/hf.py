"""transformers ``generate`` as bench systems: ``hf-greedy``, ``hf-pld`` and ``hf-static``.

``hf-static`` is ``generate(cache_implementation="static")`` as transformers runs it for speed:
a KV of one fixed length, and on CUDA the decoding forward compiled by ``generate`` itself
(``torch.compile`` with its default ``CompileConfig``: inductor, ``reduce-overhead``; the
prefill stays eager). Every ``generate`` option goes in as a keyword, so transformers builds
a fresh ``GenerationConfig`` per call and ``model.generation_config`` is never touched (an
agentspec target refuses a model whose config asks for a static KV). What ``generate``
leaves on the model for a static KV (the compiled call, its config, the KV length) is this
system's own: swapped in around each call and the model's previous state put back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agentspec.bench.results import Outcome, grammar_of, prompt_of
from agentspec.bench.workload import WorkloadItem
from agentspec.text import cut_at_stop

PLD_TOKENS = 10
# What transformers' generate sets on the model with a static KV (generation/utils.py,
# modeling_utils.get_compiled_call; transformers 5.23): kept per system, not shared.
STATIC_STATE = ("_compiled_call", "_last_compile_config", "_previous_max_cache_length")
_MISSING = object()


class HFSystem:
    """transformers ``generate`` on the Speculator's own model: greedy, or with prompt lookup."""

    def __init__(self, name: str, spec: Any, *, temperature: float,
                 prompt_lookup: bool = False) -> None:
        self.name, self.spec, self.temperature = name, spec, temperature
        self.prompt_lookup = prompt_lookup

    def run(self, item: WorkloadItem, max_new_tokens: int, seed: int | None) -> Outcome:
        new, seconds = self._call(item, self._kwargs(max_new_tokens, seed))
        # Time to first token: the same call cut to one token, timed apart (a streamer inside
        # the measured call would add a host sync per token to transformers' loop).
        _, first = self._call(item, self._kwargs(1, seed))
        return Outcome(cut_at_stop(new, self.spec.stop_token_ids)[0], seconds,
                       first_token_seconds=first)

    def _call(self, item: WorkloadItem, kwargs: dict[str, Any]) -> tuple[list[int], float]:
        """One timed call: tokenisation and ``generate``; the new ids and its seconds."""
        started = time.perf_counter()
        ids = self.spec.encode(prompt_of(item))
        grammar = grammar_of(item)
        if grammar is not None:  # the same constraint, as transformers users apply one
            from agentspec.grammar.hf import GrammarLogitsProcessor

            kwargs["logits_processor"] = [GrammarLogitsProcessor(
                grammar, self.spec.tokenizer, vocab_size=self.spec.target.vocab_size,
                eos_ids=sorted(self.spec.stop_token_ids), prompt_len=len(ids))]
        new = self._generate(ids, kwargs)
        return new, time.perf_counter() - started

    def _kwargs(self, max_new_tokens: int, seed: int | None) -> dict[str, Any]:
        import torch

        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": False,
                                  "pad_token_id": self.spec.tokenizer.eos_token_id}
        if self.temperature > 0:
            # transformers samples from the global RNG only; top-k/top-p off as in agentspec.
            kwargs.update(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed or 0)
        if self.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = PLD_TOKENS
        return kwargs

    def _generate(self, ids: list[int], kwargs: dict[str, Any]) -> list[int]:
        """The new token ids of one ``generate`` call on ``ids``: on the CPU on the torch
        thread, whose OpenMP team agentspec's own forwards use (a caller's thread may hold one
        OpenMP thread only, :mod:`agentspec.engine.torch_thread`)."""
        from agentspec.engine.torch_thread import for_device

        return for_device(self.spec.target.model.device, self._generate_here, ids, kwargs)

    def _generate_here(self, ids: list[int], kwargs: dict[str, Any]) -> list[int]:
        import torch

        model = self.spec.target.model
        input_ids = torch.tensor([ids], device=model.device)  # [1, prompt_len]
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 **kwargs)
        return [int(t) for t in out[0, len(ids):].tolist()]


class HFStaticSystem(HFSystem):
    """``generate`` with a static KV, its decoding forward compiled where transformers does.

    Args:
        max_cache_len: the static KV's length for every call (the longest prompt plus budget
            of the workload): one shape, so the compiled forward is built once, in :meth:`warm`.
        compile_config: transformers' ``CompileConfig``; ``None`` is its default. transformers
            compiles on CUDA only (not the CPU) unless ``compile_config._compile_all_devices``.

    If compiling fails, the system goes on with the static KV uncompiled and says so once in
    :attr:`note` (the bench puts it in the report).
    """

    def __init__(self, name: str, spec: Any, *, temperature: float,
                 max_cache_len: int | None = None, compile_config: Any = None) -> None:
        super().__init__(name, spec, temperature=temperature)
        self.max_cache_len, self.compile_config = max_cache_len, compile_config
        self.compiled = spec.target.device.type == "cuda" or bool(
            getattr(compile_config, "_compile_all_devices", False))
        self.note: str | None = None if self.compiled else (
            f"{name}: static KV without torch.compile (transformers compiles generate's "
            f"forward on CUDA only; device {spec.target.device})")
        self._state: dict[str, Any] = {}

    def warm(self, item: WorkloadItem, max_new_tokens: int) -> None:
        """One untimed run (the compile happens here, not in a measured request)."""
        self.run(item, max_new_tokens, None)

    def _kwargs(self, max_new_tokens: int, seed: int | None) -> dict[str, Any]:
        kwargs = super()._kwargs(max_new_tokens, seed)
        kwargs.update(cache_implementation="static", max_cache_len=self.max_cache_len,
                      compile_config=self.compile_config, disable_compile=not self.compiled)
        return kwargs

    def _generate(self, ids: list[int], kwargs: dict[str, Any]) -> list[int]:
        try:
            with self._own_state():
                return super()._generate(ids, kwargs)
        except Exception as e:
            if not self.compiled:
                raise
            # Any failure of a compiled call (no compiler, no triton, a backend error): go on
            # uncompiled, and say so once.
            self.compiled, self._state = False, {}
            reason = (str(e).strip().splitlines() or [""])[0][:200]
            self.note = (f"{self.name}: torch.compile failed ({type(e).__name__}: {reason}); "
                         "static KV without torch.compile")
            kwargs.update(compile_config=None, disable_compile=True)
            with self._own_state():
                return super()._generate(ids, kwargs)

    @contextmanager
    def _own_state(self) -> Iterator[None]:
        """This system's static-KV state on the model for one call; the model's back after."""
        model = self.spec.target.model
        saved = {k: getattr(model, k, _MISSING) for k in STATIC_STATE}
        tokenizers_parallelism = os.environ.get("TOKENIZERS_PARALLELISM")  # set by a compile
        _set_state(model, self._state)
        try:
            yield
        finally:
            self._state = {k: v for k in STATIC_STATE
                           if (v := getattr(model, k, _MISSING)) is not _MISSING}
            _set_state(model, {k: v for k, v in saved.items() if v is not _MISSING})
            if tokenizers_parallelism is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = tokenizers_parallelism


def _set_state(model: Any, state: dict[str, Any]) -> None:
    for key in STATIC_STATE:
        if key in state:
            setattr(model, key, state[key])
        elif hasattr(model, key):
            delattr(model, key)
