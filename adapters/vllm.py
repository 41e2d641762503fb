"""agentspec's memory and drafters as vLLM's speculative proposer.

Use it through vLLM's custom proposer backend::

    LLM(model, speculative_config={"method": "custom_class", "num_speculative_tokens": 8,
                                   "model": "agentspec.adapters.vllm.Proposer"},
        additional_config={"agentspec": {"db": "postgresql+psycopg://..."}})

vLLM builds ``Proposer(vllm_config)`` in its model runner, calls ``load_model(model)`` once,
then ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` after every step: per
batch row, the chain of draft tokens it should verify next (the interface of vLLM 0.32's
``custom_class`` method). Per row the drafts come from the in-process engine's chain policy
over two drafters: the memory's neighbours of the request, and suffix matching over the
request's own text (its prompt: what prompt lookup copies), the scope's remembered
completions and what every request of this engine has generated, across scopes and while
they run (``share_outputs``; vLLM's own ``suffix`` method shares outputs so too). Drafts are
flattened to chains and at most ``num_speculative_tokens`` deep. They only change speed: vLLM
verifies them, so its outputs stay its own.

The proposer sees token ids, no request metadata: :mod:`agentspec.adapters.vllm_requests`
recognises each row's request from its tokens and derives its scope and key from the prompt's
text. The memory lookup and the decoding of the prompt run on a thread of their own; a request
drafts from the step after they finish. A finished request's completion is recorded through
the memory's write-behind worker: at a stop token, or once its row has not been seen for
``finish_after_steps`` steps (the ``max_tokens`` limit, a stop string, an abort), or when the
engine has been idle for ``idle_finish_s``. A clean shutdown (vLLM exits on SIGTERM; then
:meth:`Proposer.close` runs at exit) records the requests still followed and writes what is
queued; a process that dies loses its requests in flight and the records not yet written.

Options, under ``additional_config["agentspec"]`` (all optional):
    db: the memory: a SQLAlchemy URL (SQLite for one process, PostgreSQL shared by replicas),
        ``"default"`` (the SQLite file under ``$AGENTSPEC_HOME``), or None: no memory (suffix
        matching over the request and the engine's outputs only).
    scope: one fixed memory scope; default one per system prompt.
    record: record finished completions (default true; ``AGENTSPEC_RECORD=0`` turns it off).
    neighbours: remembered completions drafted from per request (default 8).
    share_outputs: draft from the outputs of this engine's other requests, whatever their
        scope (default true; false keeps a request's drafts to its own text and its scope's
        memory, at some acceptance on requests unlike those remembered).
    cost: what a longer draft costs against what it may save, as a step's time
        ``base + per_token * tokens``: ``"auto"`` (default) fits it to the engine's own steps
        (:class:`~agentspec.adapters.vllm_requests.StepClock`), from :data:`FALLBACK_COST`
        until it has enough of them; ``[base, per_token]`` fixes it (its units are free).
    finish_after_steps / idle_finish_s: when an unseen request counts as finished (default 64
        steps; 5 s without a step: longer than any one step, a long prefill's included).
    stats_path: a JSON file the proposer's counters are written to (about once a second).
    model_id: the memory's model fingerprint; default that of the model's config and
        tokenizer, as the in-process engine computes it (both then share rows).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from agentspec.adapters.vllm_requests import Live, Rows, StepClock, prompt_identity, verdict_for
from agentspec.config import SpecConfig
from agentspec.drafters.chain import DrafterChain
from agentspec.drafters.memory import MemoryDrafter
from agentspec.drafters.policy import CostModel
from agentspec.drafters.suffix import OutputIndex, SuffixDrafter
from agentspec.engine.model import fingerprint, stop_ids
from agentspec.errors import warn_once
from agentspec.home import recording_allowed
from agentspec.protocols import DraftContext, Drafter
from agentspec.text import cut_at_stop
from agentspec.types import EMPTY_DRAFT, Draft, Finished, Record

# A step's cost before the engine's own steps are fitted: a draft token costs 5 % of a step.
FALLBACK_COST = (1.0, 0.05)
DEFAULTS: dict[str, Any] = {"db": None, "scope": None, "record": True, "neighbours": 8,
                            "cost": "auto", "share_outputs": True, "finish_after_steps": 64,
                            "idle_finish_s": 5.0, "stats_path": None, "model_id": None}


def options_of(vllm_config: Any) -> dict[str, Any]:
    """The proposer's options: ``additional_config["agentspec"]`` over :data:`DEFAULTS`.

    Raises:
        ValueError: an unknown option (the message names it and the known ones).
    """
    extra = getattr(vllm_config, "additional_config", None) or {}
    given = dict(extra.get("agentspec", {}) if isinstance(extra, dict) else {})
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown agentspec option(s) {unknown}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **given}


class Proposer:
    """vLLM's ``custom_class`` proposer drafting from agentspec's memory (module docstring).

    Args:
        vllm_config: vLLM's ``VllmConfig`` (read: ``speculative_config.num_speculative_tokens``,
            ``model_config.model``/``tokenizer``/``max_model_len``, ``additional_config``).
        tokenizer: the model's tokenizer (default: loaded from the model's folder).
        memory: a completion memory, overriding the ``db`` option.
    """

    def __init__(self, vllm_config: Any, *, tokenizer: Any = None, memory: Any = None) -> None:
        self.options = opts = options_of(vllm_config)
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        model_config = vllm_config.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.model_path = str(getattr(model_config, "tokenizer", None) or model_config.model)
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(self.model_path)
        hf_config = getattr(model_config, "hf_config", None)
        self.vocab_size: int | None = int(getattr(hf_config, "vocab_size", 0) or 0) or None
        self.stop_ids = _stop_ids(self.tokenizer, hf_config)
        self._owns_memory = memory is None and opts["db"] is not None
        if memory is None and opts["db"] is not None:
            from agentspec.speculator import open_memory

            memory = open_memory(opts["db"])
        self.memory = memory
        self.model_id = str(opts["model_id"] or _model_id(self.model_path, model_config,
                                                          self.tokenizer))
        self.record = bool(opts["record"]) and memory is not None and recording_allowed()
        config = SpecConfig(max_draft_tokens=self.k, memory_neighbours=int(opts["neighbours"]))
        drafters: list[Drafter] = []
        if memory is not None:
            drafters.append(MemoryDrafter(memory, self.model_id, k=config.memory_neighbours,
                                          max_nodes=config.max_tree_nodes))
        # Suffix matching from one-token contexts up (a reply's first token is often all there
        # is to go on); the request's own text holds what prompt lookup would copy, so no
        # prompt lookup beside it (measured: it only drafted the weaker continuation).
        outputs = OutputIndex(n_min=1) if opts["share_outputs"] else None
        drafters.append(SuffixDrafter(memory, self.model_id, n_min=1, own_text=True,
                                      outputs=outputs))
        fixed = opts["cost"] if opts["cost"] != "auto" else FALLBACK_COST
        base, per_token = (float(x) for x in fixed)
        self.chain = DrafterChain(drafters, cost=CostModel(base, per_token), trees=False,
                                  max_depth=self.k)
        self.clock = StepClock() if opts["cost"] == "auto" else None
        self._last_end: float | None = None  # when the last propose returned
        self._last_tokens = 0  # the tokens its drafts give the next step (0: not timed)
        self._last_rows = 0
        self._started = 0  # requests first seen in the current step
        self.rows = Rows(max_gap=2 * (self.k + 1))  # a step without a proposal between
        self.stats: dict[str, Any] = {"steps": 0, "rows": 0, "host_seconds": 0.0,
                                      "host_max_seconds": 0.0, "requests": 0, "recorded": 0,
                                      "begin_seconds": 0.0, "drafted": {}, "accepted": {},
                                      "finished": {}}
        self._lock = threading.RLock()  # finish_idle holds it through finish_live
        self._last_call = time.monotonic()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="agentspec-vllm")
        self._closed = threading.Event()
        self._keeper = threading.Thread(target=_keep, args=(weakref.ref(self), self._closed),
                                        name="agentspec-vllm-keeper", daemon=True)
        self._keeper.start()
        atexit.register(self.close)

    # --- vLLM's interface ----------------------------------------------------------------
    def load_model(self, model: Any = None) -> None:
        """Called once by vLLM with the target (unused: nothing here runs a model). Loads the
        memory's embedder and index library now, not in the first request's lookup."""
        if self.memory is not None:
            try:
                self.memory.warmup()
            except Exception as e:  # an accelerator's fault: drafting without it
                warn_once(f"agentspec: the memory's warm-up failed ({type(e).__name__}: {e})")

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """Per batch row, the draft tokens to verify at the next step ([] for none).

        Args:
            sampled_token_ids: per row, the tokens this step committed (empty: the row is
                mid-prefill or its tokens were discarded; it is not drafted for).
            num_tokens_no_spec: per row, how many tokens it holds, this step's included.
            token_ids_cpu: ``[max_num_reqs, max_model_len]``, each row's token ids.
            slot_mappings: unused.
        """
        started = time.perf_counter()
        with self._lock:
            stats = self.stats
            stats["steps"] += 1
            self._last_call = time.monotonic()
            self._started = 0  # requests first seen in this step
            out = [self._guarded_row(i, sampled, int(num_tokens_no_spec[i]), token_ids_cpu[i])
                   if sampled else [] for i, sampled in enumerate(sampled_token_ids)]
            if stats["steps"] % 16 == 0:
                for live in self.rows.stale(stats["steps"],
                                            int(self.options["finish_after_steps"])):
                    self._finish(live, "unseen")
            self._time_step(started, sampled_token_ids, out)
            spent = time.perf_counter() - started
            stats["rows"] += len(sampled_token_ids)
            stats["host_seconds"] += spent
            stats["host_max_seconds"] = max(stats["host_max_seconds"], spent)
        return out

    def _time_step(self, started: float, sampled: list[list[int]], out: list[list[int]]) -> None:
        """Feed the step clock the step that just ran (when it decoded every row, none of them
        new, and its tokens are known), and refit the chain's cost every 16 steps.

        A row new in this step was prefilled in it: its prompt's time is no draft's cost
        (counted, a 1-token step after each request's prefill pulled the fitted per-token cost
        to nothing at one stream, and drafts to their longest)."""
        if self.clock is None:
            return
        decoding = all(sampled) and bool(sampled) and not self._started
        if self._last_end is not None and self._last_tokens and decoding \
                and self._last_rows == len(sampled):
            self.clock.add(self._last_tokens, started - self._last_end, len(sampled))
        self._last_tokens = sum(1 + len(d) for d in out) if decoding else 0
        self._last_rows = len(sampled)
        self._last_end = time.perf_counter()
        if self.stats["steps"] % 16 == 0:
            fitted = self.clock.row_cost()
            if fitted is not None:
                self.chain.cost = CostModel(*fitted)
                self.stats["cost"] = [round(fitted[0], 6), round(fitted[1], 6)]

    # --- one row --------------------------------------------------------------------------
    def _guarded_row(self, i: int, sampled: list[int], total: int, row: np.ndarray) -> list[int]:
        """:meth:`_propose_row`, whose failure costs the row its draft, never the engine."""
        try:
            return self._propose_row(i, sampled, total, row)
        except Exception as e:  # drafts are an accelerator: vLLM's step goes on without one
            warn_once(f"agentspec: drafting for a vLLM row failed ({type(e).__name__}: {e}); "
                      f"the row goes on without a draft")
            live = self.rows.by_row.get(i)
            if live is not None:  # its state may be half updated: the row starts afresh
                self.rows.drop(live)
            return []

    def _propose_row(self, i: int, sampled: list[int], total: int, row: np.ndarray) -> list[int]:
        before = total - len(sampled)
        live = self.rows.find(i, row, before)
        if live is None:
            live = self.rows.start(i, row, before, total, self._context)
            self.stats["requests"] += 1
            self._started += 1
            live.begun = self._pool.submit(self._begin, live)
        live.seen = self.stats["steps"]
        new = live.take(row, total)
        if live.ready:
            draft, verdict = verdict_for(live.draft, new)
            if draft.num_nodes:
                source = draft.source_of(0)
                acc = self.stats["accepted"]
                acc[source] = acc.get(source, 0) + len(verdict.accepted)
            self.chain.observe(live.context, draft, verdict)
        elif live.begun is not None and live.begun.done():
            self._ready(live)
        if any(t in self.stop_ids for t in new):
            self._finish(live, "stop")
            return []
        if not live.ready:
            return []
        room = min(self.k, self.max_model_len - total)
        if room <= 0:
            live.draft = EMPTY_DRAFT
            return []
        draft = self.chain.propose(live.context, max_tokens=room)
        ids = list(draft.token_ids)
        if self.vocab_size is not None and any(t >= self.vocab_size for t in ids):
            ids = ids[: next(j for j, t in enumerate(ids) if t >= self.vocab_size)]
            draft = Draft.chain(ids, draft.source_of(0)) if ids else EMPTY_DRAFT
        live.draft = draft
        if ids:
            drafted = self.stats["drafted"]
            drafted[draft.source_of(0)] = drafted.get(draft.source_of(0), 0) + len(ids)
        return ids

    def _context(self, prompt: list[int], prompt_len: int) -> DraftContext:
        return DraftContext(tokens=prompt, prompt_len=prompt_len)

    def _begin(self, live: Live) -> None:
        """Off the step path: the prompt's text, scope and key, then the drafters' ``begin``
        (the memory's lookup, the suffix index's catch-up)."""
        started = time.perf_counter()
        seen = live.context
        text = self.tokenizer.decode(seen.tokens[: seen.prompt_len], skip_special_tokens=False)
        live.identity = prompt_identity(text, self.options["scope"])
        # The request's context, built once its identity is known (its tokens the same list,
        # which the steps go on extending).
        live.context = context = DraftContext(tokens=seen.tokens, prompt_len=seen.prompt_len,
                                              scope=live.identity.scope,
                                              key_text=live.identity.key_text)
        self.chain.begin(context)
        self.stats["begin_seconds"] += time.perf_counter() - started

    def _ready(self, live: Live) -> None:
        """The request's ``begin`` is done: observe what it generated meanwhile, then draft."""
        assert live.begun is not None
        if live.begun.exception() is not None:
            if not live.failed:
                error = live.begun.exception()
                warn_once(f"agentspec: a request's memory lookup failed "
                          f"({type(error).__name__}: {error}); it drafts without it")
            live.failed = True
            return
        generated = live.generated
        if generated:
            _, verdict = verdict_for(live.draft, generated)
            self.chain.observe(live.context, live.draft, verdict)
        live.ready = True

    # --- the end of a request -------------------------------------------------------------
    def _finish(self, live: Live, why: str) -> None:
        """``live`` has finished: forgotten here, its completion (cut before its first stop
        token) and its drafts' credits handed to the memory off the step path."""
        self.rows.drop(live)
        ends = self.stats["finished"]
        ends[why] = ends.get(why, 0) + 1
        if live.begun is None:
            return
        self._pool.submit(self._record, live, cut_at_stop(live.generated, self.stop_ids)[0])

    def _record(self, live: Live, completion: tuple[int, ...]) -> None:
        """On the proposer's thread, after the request's ``begin``: end its drafters, then
        the credits and the record, written behind by the memory's worker."""
        if live.identity is None:
            return
        try:
            self.chain.end(live.context)
        except Exception as e:  # the drafters' cleanup: nothing to record is lost
            warn_once(f"agentspec: ending a request's drafters failed ({e})")
        if self.memory is None:
            return
        credits = tuple(sorted((rid, n) for (_, rid), n in self.chain.credits(live.context).items()))
        remember = self.record and bool(completion)
        if not (credits or remember):
            return
        ident = live.identity
        row = Record(scope=ident.scope, model=self.model_id, request_text=ident.request_text,
                     key_text=ident.key_text,
                     completion_text=self.tokenizer.decode(list(completion),
                                                           skip_special_tokens=True),
                     completion_ids=completion)
        try:
            self.memory.finish(Finished(row, remember=remember, credits=credits), behind=True)
        except Exception as e:  # an accelerator's fault: the output is vLLM's, and done
            warn_once(f"agentspec: a completion could not be recorded ({e})")
            return
        if remember:
            self.stats["recorded"] += 1

    def finish_idle(self) -> int:
        """Finish every live request when the engine has been idle for ``idle_finish_s`` (no
        step runs while no request does); returns how many were finished."""
        with self._lock:
            if time.monotonic() - self._last_call < float(self.options["idle_finish_s"]):
                return 0
            return self.finish_live("idle")

    def finish_live(self, why: str) -> int:
        """Finish every live request now (recorded as ended for ``why``); returns how many."""
        with self._lock:
            done = list(self.rows.live)
            for live in done:
                self._finish(live, why)
            return len(done)

    def settle(self) -> None:
        """Wait for the work handed to the proposer's thread so far (tests, shutdown)."""
        self._pool.submit(lambda: None).result()
        if self.memory is not None:
            self.memory.worker.settle()

    def write_stats(self) -> None:
        """Write the counters to ``stats_path`` (atomically), when the option is set."""
        path = self.options["stats_path"]
        if not path:
            return
        with self._lock:
            data = json.dumps({**self.stats, "pid": os.getpid(), "live": len(self.rows.live)})
        target = Path(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(data)
        tmp.replace(target)

    def close(self) -> None:
        """Finish every live request, write what is queued, and stop the threads."""
        if self._closed.is_set():
            return
        self._closed.set()
        atexit.unregister(self.close)
        self.finish_live("close")
        self._pool.shutdown(wait=True)
        try:
            self.write_stats()
        except OSError:
            pass
        if self.memory is not None and self._owns_memory:
            self.memory.close()
        elif self.memory is not None:
            self.memory.worker.settle()


def _keep(ref: weakref.ReferenceType[Proposer], closed: threading.Event) -> None:
    """The keeper thread: finishes the requests of an idle engine and writes the counters."""
    ticks = 0
    while not closed.wait(0.25):
        proposer = ref()
        if proposer is None:
            return
        ticks += 1
        try:
            proposer.finish_idle()
            if ticks % 4 == 0:
                proposer.write_stats()
        except Exception as e:  # never let housekeeping take the engine down
            warn_once(f"agentspec: the vLLM proposer's housekeeping failed ({e})")
        del proposer


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _stop_ids(tokenizer: Any, hf_config: Any) -> frozenset[int]:
    """The tokens that end a generation: the tokenizer's and the model config's end ids (the
    in-process engine's rule, :func:`agentspec.engine.model.stop_ids`)."""
    return stop_ids((getattr(tokenizer, "eos_token_id", None),
                     getattr(hf_config, "eos_token_id", None)))


def _model_id(path: str, model_config: Any, tokenizer: Any) -> str:
    """The in-process engine's fingerprint of this model (config and vocabulary), so both
    draft from each other's records; the folder's name where it cannot be computed."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        return fingerprint(Path(path).name, SimpleNamespace(config=config), tokenizer)
    except Exception:  # a config transformers cannot read here: the name alone
        return Path(path).name or str(getattr(model_config, "model", "model"))
