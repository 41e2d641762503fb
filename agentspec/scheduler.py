"""The step scheduler: many requests, one model, one forward a step.

Calls on one :class:`~agentspec.Speculator` from any number of threads become rows of the same
forwards (continuous batching at step granularity). Each step:

1. retire what was cancelled; admit waiting requests up to ``max_batch`` (a sequence each, its
   prompt's cached prefix held, the rest a :class:`~agentspec.engine.plan.Prefill`:
   :meth:`HFTarget.prefill`);
2. plan every decoding request's rows (:meth:`Decoding.plan`), one after the other, each draft
   sized by its marginal cost in this forward (:class:`~agentspec.protocols.StepShare`, handed
   to it as a value; it answers the tokens it expects): the more rows the step carries, the
   likelier a node must be to earn its row, so drafts shrink as load grows;
3. give the prompts being prefilled what rows are left, oldest first, within a bound that keeps
   the decoding requests' step time (``prefill_latency``);
4. one forward over all of it (:meth:`HFTarget.run`);
5. conclude each decoding request (verify, commit, observe) and hand it its step; commit the
   prompt chunks; retire the finished.

The scheduler enters the engine in one place: :meth:`Scheduler._engine_step`, the only call
that hops to the torch thread and the only one that runs a forward; who may run it is decided
by one hand-off (:meth:`Scheduler._take_engine`).

Nothing here changes a token: a row's bits depend neither on its forward's width, nor on its
place, nor on the other sequences in it (:mod:`agentspec.engine.plan`), and each request
samples from its own generator. So each output is what the request gives alone
(``tests/integration/test_batching.py``).

There is no engine thread of its own. A caller that needs its next step and finds none queued
runs the next step, for every live request (leader and followers; on the CPU the step itself
runs on the torch thread, :mod:`agentspec.engine.torch_thread`): a single caller's steps are
its own, and many callers take turns leading steps that carry them all. A request's steps are
queued for its caller, so a stream read slowly runs ahead of its reader (at most its
``max_new_tokens``) and holds nobody back; a stream closed or dropped frees its sequence at
the next step, or at once when no step is running.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from agentspec.config import SamplingParams
from agentspec.decoding.loop import Decoding, Planned, Step
from agentspec.engine.plan import Member
from agentspec.engine.sequence import Sequence as KVSequence
from agentspec.engine.target import HFTarget
from agentspec.engine.torch_thread import for_device
from agentspec.jobs import DONE as _DONE
from agentspec.jobs import Job as Job
from agentspec.jobs import Load as Load
from agentspec.protocols import DraftContext, Drafter, StepObserver, StepShare

logger = logging.getLogger("agentspec")

class Scheduler:
    """The steps of every live request on ``target``.

    Args:
        target: the model.
        max_batch: the most requests live at once (more wait, first come first served).
        cost: seconds of a forward by rows beyond the first (``seconds(rows - 1)``; a
            :class:`~agentspec.drafters.policy.CostModel`) and its ``kv_per_token``, for
            sizing drafts and prompt chunks; None: no sizing (no drafts to size).
        prefill_latency: a step that carries prompt rows beside decoding requests costs at
            most this many times the step without them (at least one tile of rows).
    """

    def __init__(self, target: HFTarget, *, max_batch: int = 16, cost: Any = None,
                 prefill_latency: float = 2.0) -> None:
        if type(max_batch) is not int or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if not prefill_latency >= 1.0:
            raise ValueError(f"prefill_latency must be >= 1, got {prefill_latency!r}")
        self.target, self.max_batch, self.cost = target, max_batch, cost
        self.prefill_latency = prefill_latency
        self._cond = threading.Condition(threading.Lock())  # not reentrant: see cancel()
        self._waiting: deque[Job] = deque()
        self._live: list[Job] = []
        self._running = False
        self._turn = 0  # rotates which request plans first
        self.steps = 0

    # -- callers ------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cond:
            job.state = "waiting"
            self._waiting.append(job)

    def next(self, job: Job) -> Step | None:
        """The job's next step, running steps (for every live request) while none is queued;
        None once it has finished. Raises what failed the request."""
        while True:
            with self._cond:
                while True:
                    if job.events:
                        event = job.events.popleft()
                        if event is _DONE:
                            return None
                        if isinstance(event, BaseException):
                            raise event
                        return event  # type: ignore[no-any-return]
                    if job.state == "ended":
                        return None
                    if self._take_engine(wait=False):
                        break
                    self._cond.wait()
            try:
                self._engine_step()
            finally:
                self._give_engine()

    def cancel(self, job: Job) -> None:
        """End ``job`` early (a stream closed or dropped). Never waits: this may run in a
        garbage collector's finaliser, on a thread inside this scheduler's own lock, so the
        job is retired here only when the lock and the engine are free, else by the next
        step."""
        job.cancelled = True
        if job.state == "ended":  # it ended before its caller read its end: abandoned still
            self._abandoned(job)
            return
        if not self._cond.acquire(blocking=False):
            return
        try:
            if not self._take_engine(wait=False):
                return
        finally:
            self._cond.release()
        try:
            self._retire_cancelled()
        finally:
            self._give_engine()

    def close(self, job: Job) -> None:
        """End ``job`` early and wait until it is retired (its drafters ended, its sequence
        back in the pool): a caller that stops reading a request it is done with."""
        job.cancelled = True
        with self._cond:
            while job.state != "ended" and not self._take_engine(wait=False):
                self._cond.wait()
            if job.state == "ended":
                return
        try:
            self._retire_cancelled()
        finally:
            self._give_engine()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine between steps (warm-up, building the drafters: work that runs
        forwards of its own)."""
        with self._cond:
            self._take_engine(wait=True)
        try:
            yield
        finally:
            self._give_engine()

    def _take_engine(self, *, wait: bool) -> bool:
        """The one hand-off of the engine (held with the condition's lock): take it when no
        step or other holder has it; with ``wait``, wait until then. False: taken by another."""
        while self._running:
            if not wait:
                return False
            self._cond.wait()
        self._running = True
        return True

    def _give_engine(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()

    def load(self) -> Load:
        """What the scheduler carries now: requests admitted, requests waiting, and its
        ``max_batch`` (what a server reports and refuses by)."""
        with self._cond:
            return Load(len(self._live), len(self._waiting), self.max_batch)

    @property
    def live(self) -> int:
        """Requests admitted and not ended."""
        return len(self._live)

    @property
    def waiting(self) -> int:
        """Requests waiting for room."""
        return len(self._waiting)

    # -- one step -----------------------------------------------------------------------------

    def _engine_step(self) -> None:
        """The scheduler's one entry into the engine: a step, on the CPU on the torch thread
        (one OpenMP team for every caller: agentspec.engine.torch_thread), where it plans,
        runs one forward and concludes."""
        for_device(self.target.device, self._step)

    def _step(self) -> None:
        self._retire_cancelled()
        self._admit()
        if not self._live:
            return
        prefilling = [j for j in self._live if j.state == "prefill"]
        decoding = [j for j in self._live if j.state == "decode"]
        if not self.target.batches and decoding:  # a forward carries one sequence
            prefilling, decoding = [], decoding[:1]
        elif not self.target.batches:
            prefilling = prefilling[:1]
        members: list[tuple[Job, Member]] = []
        budget = self.target.widest
        prefill_rows = self._prefill_rows(len(decoding), prefilling)
        share_tokens, share_rows = 0.0, prefill_rows
        order = decoding[self._turn % len(decoding):] + decoding[: self._turn % len(decoding)] \
            if decoding else []
        self._turn += 1
        for i, job in enumerate(order):
            later = len(order) - i - 1  # each takes a root row at least
            room = budget - share_rows - later
            planned = self._plan(job, StepShare(share_tokens + later, share_rows + later,
                                                self._kv_seconds(order, job)), room)
            if planned is None:
                continue
            members.append((job, planned.rows))
            share_rows += len(planned.rows.ids)
            share_tokens += planned.expected_tokens
        rows_left = budget - sum(len(m.ids) for _, m in members)
        for job in prefilling:
            if rows_left <= 0 or prefill_rows <= 0:
                break
            assert job.prefill is not None
            chunk = job.prefill.chunk(min(rows_left, prefill_rows, self.target.widest))
            members.append((job, chunk))
            rows_left -= len(chunk.ids)
            prefill_rows -= len(chunk.ids)
        if members:
            self._forward(members)
        self._retire_cancelled()  # closed during the step: no later step may come to do it

    def _plan(self, job: Job, share: StepShare, room: int) -> Planned | None:
        loop = job.decoding
        assert loop is not None
        try:
            return loop.plan(max(room, 1) - 1, share if self.cost is not None and share.rows else None)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            self._fail(job, e)
            return None

    def _forward(self, members: list[tuple[Job, Member]]) -> None:
        wants_hidden = any(j.decoding is not None and j.state == "decode" and j.decoding.wants_hidden
                           for j, _ in members)
        try:
            scored = self.target.run([m for _, m in members], hidden=wants_hidden)
        except Exception as e:  # noqa: BLE001 - every request of the step fails with it
            for job, _ in members:
                self._fail(job, e)
            return
        self.steps += 1
        argmax = self._argmax(members, scored)
        for (job, member), rows, hidden in zip(members, scored, scored.hidden, strict=True):
            if job.state == "prefill":
                assert job.prefill is not None
                job.prefill.written(member)
                if job.prefill.done:
                    job.state = "decode"
                continue
            assert job.decoding is not None and rows is not None
            try:
                step = job.decoding.conclude(rows, hidden, argmax.get(id(job)))
            except Exception as e:  # noqa: BLE001
                self._fail(job, e)
                continue
            with self._cond:
                job.events.append(step)
            if job.decoding.done:
                self._retire(job, _DONE)

    @staticmethod
    def _argmax(members: list[tuple[Job, Member]],
                logits: list[Any]) -> dict[int, list[int]]:
        """The rows' argmax of every request whose verdict it decides (greedy, no mask), in
        one device-to-host copy for the whole step."""
        picked = [(job, rows) for (job, _), rows in zip(members, logits, strict=True)
                  if job.state == "decode" and job.decoding is not None and rows is not None
                  and job.decoding.argmax_decides]
        if not picked:
            return {}
        tops = torch.cat([rows.argmax(dim=-1) for _, rows in picked]).tolist()
        out, at = {}, 0
        for job, rows in picked:
            out[id(job)] = tops[at : at + rows.shape[0]]
            at += rows.shape[0]
        return out

    # -- admission and retirement -------------------------------------------------------------

    def _admit(self) -> None:
        deferred: list[Job] = []
        try:
            while True:
                with self._cond:
                    limit = self.max_batch if self.target.batches else 1
                    if not self._waiting or len(self._live) >= limit:
                        return
                    job = self._waiting.popleft()
                if job.cancelled:
                    self._retire(job, _DONE, abandoned=True)
                elif self._sharer(job) is not None:
                    deferred.append(job)
                else:
                    self._start(job)
        finally:
            if deferred:
                with self._cond:  # ahead of later arrivals, in their order
                    self._waiting.extendleft(reversed(deferred))

    def _sharer(self, job: Job) -> Job | None:
        """A request being prefilled whose prompt shares whole blocks with ``job``'s that the
        pool does not have yet: ``job`` waits for those blocks to be sealed (its prefill then
        holds them) rather than compute them a second time. A team's calls that arrive
        together with one system prompt and tool docs prefill them once."""
        for other in self._live:
            if other.state == "prefill" and self.target.shared_rows(job.prompt_ids,
                                                                    other.prompt_ids):
                return other
        return None

    def _start(self, job: Job) -> None:
        """Admit ``job``: its sequence, its prompt's cached prefix held, its decode loop."""
        try:
            job.seq = self.target.new_sequence()
            job.prefill = self.target.prefill(job.seq, job.prompt_ids, now=False)
            job.cached_tokens = job.seq.reused_tokens
            job.decoding = job.make(job.seq)
            job.decoding.begin()
        except Exception as e:  # noqa: BLE001
            self._fail(job, e)
            return
        job.admitted = time.perf_counter()
        job.state = "decode" if job.prefill.done else "prefill"
        self._live.append(job)

    def _retire_cancelled(self) -> None:
        for job in [j for j in self._live if j.cancelled]:
            self._retire(job, _DONE, abandoned=True)
        with self._cond:
            gone = [j for j in self._waiting if j.cancelled]
            for job in gone:
                self._waiting.remove(job)
        for job in gone:
            self._retire(job, _DONE, abandoned=True)

    def _fail(self, job: Job, error: BaseException) -> None:
        self._retire(job, error, abandoned=True)

    def _retire(self, job: Job, event: Any, *, abandoned: bool = False) -> None:
        """End a job: its drafters' end, its sequence back to the pool, its last event."""
        if job.state == "ended":
            return
        if job in self._live:
            self._live.remove(job)
        try:
            if job.decoding is not None:
                job.decoding.end()
        except Exception:  # noqa: BLE001 - a drafter's cleanup must not take the step down
            logger.warning("a drafter's end of a request failed", exc_info=True)
        finally:
            if job.seq is not None:
                job.seq.release()
            with self._cond:
                job.state = "ended"
                job.events.append(event)
                self._cond.notify_all()
        if abandoned:
            self._abandoned(job)

    @staticmethod
    def _abandoned(job: Job) -> None:
        """The job's ``on_abandon``, once."""
        if job.on_abandon is None or job._abandon_done:
            return
        job._abandon_done = True
        try:
            job.on_abandon()
        except Exception:  # noqa: BLE001
            logger.warning("cleanup of an abandoned generation failed", exc_info=True)

    # -- sizing -------------------------------------------------------------------------------

    def _kv_seconds(self, order: list[Job], me: Job) -> float:
        """Seconds the other requests' keys add to the forward beyond one sequence's (the
        cost curve is measured over one sequence's KV)."""
        per_token = float(getattr(self.cost, "kv_per_token", 0.0) or 0.0)
        if not per_token:
            return 0.0
        return per_token * sum(j.seq.kv_len for j in order if j is not me and j.seq is not None)

    def _prefill_rows(self, decoding: int, prefilling: list[Job]) -> int:
        """Prompt rows this step may carry: every row of the widest forward when nothing is
        decoding; else as many as keep the step within ``prefill_latency`` times its cost
        without them (at least 16)."""
        if not prefilling:
            return 0
        widest = self.target.widest
        if not decoding or self.cost is None:
            return widest - decoding
        base = self.cost.seconds(decoding - 1)
        rows = 16
        while rows < widest - decoding and \
                self.cost.seconds(decoding + rows) <= self.prefill_latency * base:
            rows += 16
        return min(rows, widest - decoding)


def decode(target: HFTarget, drafter: Drafter, context: DraftContext, *,
           sampling: SamplingParams, max_new_tokens: int, stop_token_ids: frozenset[int],
           generator: torch.Generator | None = None, grammar_drafts: bool = True,
           lazy_masks: bool = True,
           observers: Sequence[StepObserver] = ()) -> Generator[Step, None, None]:
    """Generate up to ``max_new_tokens`` tokens after ``context.tokens``, one forward a step,
    appending to ``context.tokens`` (see :class:`Decoding` for the arguments): one request run
    alone through a scheduler of its own on ``target``, the path every request takes."""
    def make(seq: KVSequence) -> Decoding:
        return Decoding(target, seq, drafter, context, sampling=sampling,
                        max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                        generator=generator, grammar_drafts=grammar_drafts,
                        lazy_masks=lazy_masks, observers=observers)

    scheduler = Scheduler(target, max_batch=1)
    job = Job(list(context.tokens), make)
    scheduler.submit(job)
    try:
        while (step := scheduler.next(job)) is not None:
            yield step
    finally:
        scheduler.close(job)
