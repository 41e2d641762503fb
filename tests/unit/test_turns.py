"""Turns: first come first served, reentrant, and cleanups that never wait.

Nothing here can hang: every thread is a daemon joined with a timeout and asserted finished,
every event is waited with a timeout and its result asserted, and each test has a timeout of
its own. The same file shows the checks can fail: a Turns that serves the latest arrival
first, never passes the turn on, is not reentrant, makes ``run_soon`` wait, or keeps the turn
after a failing cleanup fails its check within seconds (``test_a_wrong_turns_fails``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import pytest

from agentspec.turns import Turns

WAIT = 2.0  # seconds a correct Turns never comes near; a wrong one fails after it
pytestmark = pytest.mark.timeout(20)

Make = Callable[[], Turns]


# --- helpers ----------------------------------------------------------------------------------
def _start(fn: Callable[[], object]) -> threading.Thread:
    """``fn`` on a daemon thread (one left blocked by a wrong Turns never holds up the exit)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def _joined(threads: list[threading.Thread], wait: float = WAIT) -> None:
    deadline = time.monotonic() + wait
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"{stuck} still blocked after {wait} s"


def _finishes(fn: Callable[[], object], wait: float = WAIT) -> None:
    """Run ``fn`` on another thread; it must return within ``wait`` (its exception re-raised)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            failed.append(e)

    _joined([_start(run)], wait)
    if failed:
        raise failed[0]


def _enter_and_leave(turns: Turns) -> None:
    with turns:
        pass


def _until(condition: Callable[[], bool], what: str, wait: float = WAIT) -> None:
    deadline = time.monotonic() + wait
    while not condition():
        assert time.monotonic() < deadline, f"not within {wait} s: {what}"
        time.sleep(0.001)


# --- the checks, each run on Turns below and on a wrong Turns at the end ----------------------
def check_arrival_order(make: Make, caplog: pytest.LogCaptureFixture) -> None:
    turns, order = make(), []
    turns.__enter__()
    threads = []

    def waiter(i: int) -> None:
        with turns:
            order.append(i)

    try:
        for i in range(5):
            threads.append(_start(functools.partial(waiter, i)))
            # It holds its ticket (the holder has ticket 0) before the next one arrives.
            _until(functools.partial(lambda n: turns._next == n, i + 2), f"waiter {i} waits")
    finally:
        turns.__exit__()
    _joined(threads)
    assert order == [0, 1, 2, 3, 4], f"served in the order {order}"


def check_reentrant(make: Make, caplog: pytest.LogCaptureFixture) -> None:
    turns = make()
    inner_left, release, other_entered = threading.Event(), threading.Event(), threading.Event()

    def holder() -> None:
        with turns:
            with turns:  # the holder enters again without waiting for itself
                pass
            inner_left.set()
            release.wait(WAIT)

    def other() -> None:
        with turns:
            other_entered.set()

    threads = [_start(holder)]
    assert inner_left.wait(WAIT), "the holder could not enter its own turn again"
    threads.append(_start(other))
    assert not other_entered.wait(0.2), "the inner exit gave the turn away"
    release.set()
    assert other_entered.wait(WAIT), "the outer exit did not give the turn back"
    _joined(threads)


def check_run_soon_now_or_deferred(make: Make, caplog: pytest.LogCaptureFixture) -> None:
    turns, ran = make(), []
    turns.run_soon(lambda: ran.append("free"))
    assert ran == ["free"]
    with turns:
        turns.run_soon(lambda: ran.append("deferred"))  # even by the holder: not mid-step
        assert ran == ["free"], f"ran {ran} while the turn was taken"
    assert ran == ["free", "deferred"]
    _finishes(lambda: _enter_and_leave(turns))  # the turn was passed on


def check_run_soon_never_waits(make: Make, caplog: pytest.LogCaptureFixture) -> None:
    turns, ran = make(), []
    entered, leave = threading.Event(), threading.Event()

    def holder() -> None:
        with turns:
            entered.set()
            leave.wait(WAIT)

    t = _start(holder)
    assert entered.wait(WAIT)
    _finishes(lambda: turns.run_soon(lambda: ran.append(threading.current_thread() is t)),
              wait=1.0)
    assert ran == []  # not run while another thread holds the turn
    leave.set()
    _joined([t])
    assert ran == [True]  # run by the holder as it gave the turn back


def check_failing_cleanup(make: Make, caplog: pytest.LogCaptureFixture) -> None:
    turns = make()
    with caplog.at_level(logging.WARNING, logger="agentspec"):
        turns.run_soon(lambda: 1 / 0)  # the turn is free: it runs now, and fails
        _finishes(lambda: _enter_and_leave(turns))  # the turn was given back
        # Deferred: run by a holder as it leaves, which still passes the turn on.
        entered, leave = threading.Event(), threading.Event()

        def holder() -> None:
            with turns:
                entered.set()
                leave.wait(WAIT)

        t = _start(holder)
        assert entered.wait(WAIT)
        turns.run_soon(lambda: 1 / 0)
        leave.set()
        _joined([t])
        _finishes(lambda: _enter_and_leave(turns))
    failures = [r for r in caplog.records if "cleanup of an abandoned generation failed" in
                r.getMessage()]
    assert len(failures) == 2 and all(r.exc_info for r in failures)


def test_waiters_are_served_in_arrival_order(caplog: pytest.LogCaptureFixture) -> None:
    check_arrival_order(Turns, caplog)


def test_reentrant_for_the_holder(caplog: pytest.LogCaptureFixture) -> None:
    check_reentrant(Turns, caplog)


def test_run_soon_runs_now_when_free_and_later_when_taken(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    check_run_soon_now_or_deferred(Turns, caplog)


def test_run_soon_from_another_thread_never_waits(caplog: pytest.LogCaptureFixture) -> None:
    check_run_soon_never_waits(Turns, caplog)


def test_a_failing_cleanup_does_not_keep_the_turn(caplog: pytest.LogCaptureFixture) -> None:
    check_failing_cleanup(Turns, caplog)


# --- Deliberately wrong Turns: the same checks must fail them, within seconds. ----------------
class LastComeFirstServed(Turns):
    """Wrong: the turn goes to the latest arrival."""

    def __init__(self) -> None:
        super().__init__()
        self._waiting: list[int] = []

    def __enter__(self) -> Turns:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            ticket = self._next
            self._next += 1
            self._waiting.append(ticket)
            while self._owner is not None or self._waiting[-1] != ticket:
                self._cond.wait()
            self._waiting.pop()
            self._owner, self._depth = me, 1
        return self

    def _pass_on(self) -> None:
        with self._cond:
            self._owner, self._depth = None, 0
            self._cond.notify_all()


class NeverPassesOn(Turns):
    """Wrong: the holder lets go, but the next ticket is never served."""

    def _pass_on(self) -> None:
        with self._cond:
            self._owner, self._depth = None, 0


class NotReentrant(Turns):
    """Wrong: the holder entering again waits for itself."""

    def __enter__(self) -> Turns:
        with self._cond:
            ticket = self._next
            self._next += 1
            while self._serving != ticket:
                self._cond.wait()
            self._owner, self._depth = threading.get_ident(), 1
        return self


class RunSoonWaits(Turns):
    """Wrong: ``run_soon`` waits for the turn (a finaliser would block on a busy model)."""

    def run_soon(self, job: Callable[[], object]) -> None:
        with self:
            job()


class FailureKeepsTheTurn(Turns):
    """Wrong: a cleanup that raises leaves the turn taken."""

    def run_soon(self, job: Callable[[], object]) -> None:
        self.__enter__()
        try:
            job()
        except Exception:  # noqa: BLE001
            logging.getLogger("agentspec").warning("cleanup of an abandoned generation failed",
                                                   exc_info=True)
            return
        self.__exit__()


WRONG = [
    (check_arrival_order, LastComeFirstServed, r"served in the order \[4, 3, 2, 1, 0\]"),
    (check_arrival_order, NeverPassesOn, "still blocked"),
    (check_reentrant, NotReentrant, "could not enter its own turn again"),
    (check_reentrant, NeverPassesOn, "did not give the turn back"),
    (check_run_soon_now_or_deferred, RunSoonWaits, "while the turn was taken"),
    (check_run_soon_never_waits, RunSoonWaits, "still blocked after 1.0 s"),
    (check_failing_cleanup, FailureKeepsTheTurn, "still blocked"),
]


@pytest.mark.parametrize(("check", "wrong", "why"), [
    pytest.param(*case, id=f"{case[0].__name__}-{case[1].__name__}") for case in WRONG])
def test_a_wrong_turns_fails(check: Callable[[Make, pytest.LogCaptureFixture], None],
                             wrong: Make, why: str, caplog: pytest.LogCaptureFixture) -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=why):
        check(wrong, caplog)
    assert time.monotonic() - started < 2 * WAIT  # failed, not hung
