"""The phase profiler: times what runs inside its block, only while on, and leaves every
patched function as it found it."""

from __future__ import annotations

import pytest

from agentspec.bench.phases import PhaseClock, format_system, profile, timing


class Target:
    def prefill(self, seq, ids, *, now=True):
        return len(ids)

    def run(self, members, *, hidden=False):
        return members


def test_timing_counts_only_while_on_and_restores_what_it_patched():
    import agentspec.decoding.loop as decode
    import agentspec.decoding.untrusted as untrusted
    from agentspec.drafters.chain import DrafterChain
    from agentspec.memory.completion import CompletionMemory

    before = (untrusted.sanitize, decode.verify, DrafterChain.propose, CompletionMemory.lookup)
    target = Target()
    clock = PhaseClock()
    with timing(clock, [target]):
        assert untrusted.sanitize is not before[0] and "run" in vars(target)
        target.run([3])  # off: not counted
        clock.on = True
        assert target.run([4]) == [4] and target.prefill(None, [1, 2]) == 2
        target.run([5])
    assert clock.calls == {"target.forward": 2, "target.prefix": 1}
    assert clock.seconds["target.forward"] >= 0
    assert (untrusted.sanitize, decode.verify, DrafterChain.propose,
            CompletionMemory.lookup) == before
    assert "run" not in vars(target) and Target.run is not None


def test_only_the_calls_own_thread_is_timed():
    import threading

    target = Target()
    clock = PhaseClock()
    with timing(clock, [target]):
        clock.on = True
        worker = threading.Thread(target=target.run, args=([1],))  # a write behind a call
        worker.start()
        worker.join()
        target.run([2])
    assert clock.calls == {"target.forward": 1}


def test_format_lists_the_dearest_phase_first():
    text = format_system("agentspec", {"requests": 2, "steps": 10, "seconds": 0.5,
                                       "host_ms_per_step": 10.0, "phases": {
        "verify": [0.01, 10], "target.forward": [0.4, 10]}})
    lines = text.splitlines()
    assert "250.0 ms per request" in lines[0] and "50.00 ms per step" in lines[0]
    assert "10.00 ms on the host" in lines[0]
    assert lines[2].split()[0] == "target.forward" and lines[3].split()[0] == "verify"


def test_bad_systems_are_named():
    with pytest.raises(ValueError, match="hf-greedy"):
        profile("prompts", ["hf-greedy"])


@pytest.mark.slow
def test_a_real_run_times_each_forward_once():
    result = profile("prompts", ["agentspec-pld"], measure=1, device="cpu")["agentspec-pld"]
    phases = result["phases"]
    assert result["requests"] == 1 and result["steps"] > 0
    # every step is one forward, and so is each prompt chunk; the forwards are part of the
    # request's time, not more
    assert result["steps"] < phases["target.forward"][1] <= result["steps"] + 4
    # and each forward commits once: a step its verdict, a prompt chunk its rows (a sequence
    # has one commit, Sequence.commit)
    assert phases["target.commit"][1] == phases["target.forward"][1]
    assert 0 < phases["target.forward"][0] < result["seconds"]
    assert phases["drafting.propose"][1] >= result["steps"] - 1
    # the host's share: the request's time less its forwards, per step
    device = phases["target.forward"][0]
    assert result["host_ms_per_step"] == pytest.approx(
        1e3 * (result["seconds"] - device) / result["steps"], abs=1e-3)
    assert 0 < result["host_ms_per_step"] < 1e3 * result["seconds"] / result["steps"]
