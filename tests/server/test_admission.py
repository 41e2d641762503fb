"""The door's arithmetic without a model: the load the server reports and refuses by is the
scheduler's, and the requests admitted but not handed to it yet fill its free room first."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from agentspec.adapters.lifecycle import Lifecycle, ServiceConfig  # noqa: E402
from agentspec.adapters.openai_errors import ApiError  # noqa: E402
from agentspec.scheduler import Load  # noqa: E402


class _Scheduler:
    """What the scheduler says it carries (set by the test)."""

    def __init__(self, max_batch: int) -> None:
        self.now = Load(running=0, waiting=0, max_batch=max_batch)

    def load(self) -> Load:
        return self.now


def _refused(lifecycle: Lifecycle) -> bool:
    try:
        lifecycle.admit()
    except ApiError as e:
        assert (e.status, e.code) == (429, "queue_full")
        return True
    return False


def test_requests_not_yet_at_the_scheduler_fill_its_room_then_wait() -> None:
    """max_batch 1, max_queue 1: of three at once, the first takes the batch's room, the
    second waits, the third is refused; once handed, the figures are the scheduler's."""
    scheduler = _Scheduler(max_batch=1)
    door = Lifecycle(ServiceConfig(max_queue=1), load=scheduler.load)
    first, second = door.admit(), door.admit()
    assert door.load() == Load(running=0, waiting=1, max_batch=1)
    assert _refused(door)
    first.hand(None)
    second.hand(None)
    scheduler.now = Load(running=1, waiting=1, max_batch=1)  # both with the scheduler now
    assert door.load() == scheduler.now and door.counts() == (1, 1)
    assert _refused(door)
    door.release(first)
    scheduler.now = Load(running=1, waiting=0, max_batch=1)
    assert door.load() == scheduler.now
    assert not _refused(door)  # one may wait again
    assert len(door.tickets) == 2  # in flight: the second, and the one just admitted


def test_the_scheduler_s_own_load_counts_and_no_bound_refuses_nothing() -> None:
    """Work the scheduler has from elsewhere fills the batch too; max_queue 0 refuses any
    request that would wait; without a bound, nothing is refused."""
    scheduler = _Scheduler(max_batch=2)
    scheduler.now = Load(running=2, waiting=0, max_batch=2)
    assert _refused(Lifecycle(ServiceConfig(max_queue=0), load=scheduler.load))
    scheduler.now = Load(running=1, waiting=0, max_batch=2)
    door = Lifecycle(ServiceConfig(max_queue=0), load=scheduler.load)
    assert not _refused(door) and _refused(door)
    unbounded = Lifecycle(ServiceConfig(), load=scheduler.load)
    assert not any(_refused(unbounded) for _ in range(5))
    assert unbounded.load() == Load(running=1, waiting=4, max_batch=2)
