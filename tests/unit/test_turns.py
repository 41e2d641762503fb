"""Turns: first come first served, reentrant, and cleanups that never wait."""

from __future__ import annotations

import threading
import time

from agentspec.turns import Turns


def test_waiters_are_served_in_arrival_order():
    turns, order = Turns(), []
    turns.__enter__()
    threads = []
    for i in range(5):
        t = threading.Thread(target=lambda i=i: (turns.__enter__(), order.append(i), turns.__exit__()))
        t.start()
        threads.append(t)
        time.sleep(0.05)  # each one takes its ticket before the next arrives
    turns.__exit__()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4]


def test_reentrant_for_the_holder():
    turns = Turns()
    with turns, turns:
        pass
    with turns:  # released fully
        pass


def test_run_soon_runs_now_when_free_and_later_when_taken():
    turns, ran = Turns(), []
    turns.run_soon(lambda: ran.append("free"))
    assert ran == ["free"]
    with turns:
        turns.run_soon(lambda: ran.append("deferred"))  # even by the holder: not mid-step
        assert ran == ["free"]
    assert ran == ["free", "deferred"]
    with turns:  # the turn was passed on
        pass


def test_run_soon_from_another_thread_never_waits():
    turns, ran = Turns(), []
    entered, leave = threading.Event(), threading.Event()

    def holder():
        with turns:
            entered.set()
            leave.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    entered.wait(5)
    started = time.perf_counter()
    turns.run_soon(lambda: ran.append(threading.current_thread() is t))
    assert time.perf_counter() - started < 0.5 and ran == []
    leave.set()
    t.join(5)
    assert ran == [True]  # run by the holder as it gave the turn back


def test_a_failing_cleanup_does_not_keep_the_turn(caplog):
    turns = Turns()
    turns.run_soon(lambda: 1 / 0)
    with turns:
        pass
