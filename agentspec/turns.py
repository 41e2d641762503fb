"""Turns on one model: a fair, reentrant lock that is never held while user code runs.

One target has one KV, so its forwards take turns. :class:`Turns` serves them first come,
first served (a ticket lock: no call waits longer than the calls ahead of it). A stream takes
a turn per step and gives it back before handing its text to the caller, so a stream that is
abandoned, or consumed slowly, blocks nobody. Cleanup of a closed or collected stream must
not wait for a turn (it may run in a garbage-collector finaliser, on a thread that holds other
locks): :meth:`Turns.run_soon` runs it at once when the model is free, else hands it to the
holder of the turn, which runs it before passing the turn on.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

logger = logging.getLogger("agentspec")


class Turns:
    """A FIFO (ticket) lock, reentrant per thread, with deferred cleanups; a context manager."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket whose holder has the turn
        self._owner: int | None = None
        self._depth = 0
        self._deferred: deque[Callable[[], object]] = deque()

    def __enter__(self) -> Turns:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            ticket = self._next
            self._next += 1
            while self._serving != ticket:
                self._cond.wait()
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            assert self._owner == threading.get_ident(), "a turn is released by its holder"
            self._depth -= 1
            if self._depth:
                return
        self._pass_on()

    def run_soon(self, job: Callable[[], object]) -> None:
        """Run ``job`` holding the turn: now if nobody has it or waits for it, else (also when
        this thread holds it) by the holder as it gives the turn back. Never waits."""
        with self._cond:
            if self._owner is not None or self._serving != self._next:
                self._deferred.append(job)
                return
            self._next += 1
            self._owner, self._depth = threading.get_ident(), 1
        _run_quietly(job)
        self._pass_on()

    def _pass_on(self) -> None:
        """Run the deferred jobs, then give the turn to the next ticket."""
        while True:
            with self._cond:
                if not self._deferred:
                    self._owner, self._depth = None, 0
                    self._serving += 1
                    self._cond.notify_all()
                    return
                job = self._deferred.popleft()
                self._depth = 1  # the job holds the turn (and may enter it again)
            _run_quietly(job)


def _run_quietly(job: Callable[[], object]) -> None:
    try:
        job()
    except Exception:  # noqa: BLE001 - a cleanup's failure must not take the turn down
        logger.warning("cleanup of an abandoned generation failed", exc_info=True)
