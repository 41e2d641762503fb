"""agentspec's vLLM proposer (``agentspec.adapters.vllm.Proposer``) driven without vLLM: numpy
arrays shaped as vLLM's model runner passes them and a small config object, as vLLM's own
tests of custom proposers do. Each claim is checked beside a variant built to break it."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from agentspec.adapters.vllm import Proposer, options_of
from agentspec.adapters.vllm_requests import Rows, StepClock, prompt_identity
from agentspec.text import conversation_key
from tests.adapters.vllm_fakes import (
    EOS,
    VOCAB,
    CharTokenizer,
    FakeBatch,
    chatml,
    memory,
    vllm_config,
)

TOOLS = 'Tools: get_weather(city), get_time(zone). Reply with a JSON list of calls.'
OTHER = 'You summarise documents in one sentence.'
CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def proposer(mem=None, k: int = 4, **opts) -> Proposer:
    return Proposer(vllm_config(k=k, **opts), tokenizer=CharTokenizer(), memory=mem)


@pytest.fixture
def closing():
    made: list[Proposer] = []
    yield made
    for p in made:
        p.close()


def make(closing, *args, **kw) -> Proposer:
    p = proposer(*args, **kw)
    closing.append(p)
    return p


def test_imports_without_vllm():
    # This module imported the proposer above; vLLM's types are only ever duck-typed.
    assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="unknown agentspec option"):
        options_of(vllm_config(dbb="sqlite://"))


def test_prompt_identity_reads_the_turns_back():
    same = prompt_identity(chatml(TOOLS, "weather in Paris?"))
    other_user = prompt_identity(chatml(TOOLS, "time in Tokyo?"))
    other_role = prompt_identity(chatml(OTHER, "weather in Paris?"))
    # The key is the in-process engine's key of the same messages.
    assert same.key_text == conversation_key([{"role": "system", "content": TOOLS},
                                              {"role": "user", "content": "weather in Paris?"}])
    assert same.scope == other_user.scope != other_role.scope
    assert prompt_identity("no template here").scope == "vllm:default"
    assert prompt_identity(chatml(TOOLS, "x"), scope="tenant-a").scope == "tenant-a"


def _within(drafts: list[list[int]], k: int) -> bool:
    return all(0 < len(d) <= k and all(0 <= t < VOCAB for t in d) for d in drafts)


def test_chains_stay_within_k(closing):
    mem = memory()
    first = make(closing, mem, k=3)
    FakeBatch(first).run((chatml(TOOLS, "weather in Paris?"), CALL))
    first.settle()
    p = make(closing, mem, k=3)
    batch = FakeBatch(p)
    batch.run((chatml(TOOLS, "weather in Paris?"), CALL), (chatml(OTHER, CALL * 2), CALL * 2))
    assert batch.drafts and _within(batch.drafts, 3)
    # The same check on a proposer allowed deeper chains than vLLM asked for fails.
    wrong = make(closing, mem, k=3)
    wrong.k = wrong.chain.max_depth = 8
    bad = FakeBatch(wrong)
    bad.run((chatml(TOOLS, "weather in Paris?"), CALL))
    assert not _within(bad.drafts, 3)


def _memory_accepted(p: Proposer) -> int:
    return sum(n for src, n in p.stats["accepted"].items() if src == "memory")


def test_second_replica_drafts_what_the_first_generated(closing):
    mem = memory()  # one store, two proposers: two engines sharing one memory
    a = make(closing, mem)
    (done,) = FakeBatch(a).run((chatml(TOOLS, "weather in Paris?"), CALL))
    a.settle()
    assert a.stats["recorded"] == 1
    assert [r.completion_text for r in mem.records()] == [CALL]
    b = make(closing, mem)
    (again,) = FakeBatch(b).run((chatml(TOOLS, "weather in Paris?"), CALL))
    assert again.out == done.out  # the output is the answer whatever was drafted
    assert _memory_accepted(b) >= len(CALL) // 2 and again.steps < done.steps / 2
    # Scope isolation: the same request under another fixed scope finds nothing remembered.
    c = make(closing, mem, scope="another-tenant")
    FakeBatch(c).run((chatml(TOOLS, "weather in Paris?"), CALL))
    assert _memory_accepted(c) == 0


def test_scopes_follow_the_system_prompt(closing):
    mem = memory()
    FakeBatch(make(closing, mem)).run((chatml(TOOLS, "weather in Paris?"), CALL))
    # Another role's request with the same user text: its scope holds nothing. What it drafts
    # comes from its own text, as a proposer without any memory drafts it.
    p = make(closing, mem)
    FakeBatch(p).run((chatml(OTHER, "weather in Paris?"), "A short summary."))
    alone = make(closing, None)
    FakeBatch(alone).run((chatml(OTHER, "weather in Paris?"), "A short summary."))
    assert _memory_accepted(p) == 0 and p.stats["accepted"] == alone.stats["accepted"]
    # The variant that must be caught: the same role's request drafts from the memory.
    q = make(closing, mem)
    FakeBatch(q).run((chatml(TOOLS, "weather in Paris!"), CALL))
    assert _memory_accepted(q) > 0


def test_outputs_draft_across_scopes_unless_turned_off(closing):
    """One engine's requests draft from each other's outputs whatever their scope (vLLM's
    own ``suffix`` method does so), not with ``share_outputs`` off; no memory is needed."""
    answer = "Sorry, I can only reply with a JSON list of calls."

    def accepted(**opts) -> int:
        p = make(closing, None, **opts)
        batch = FakeBatch(p)
        batch.run((chatml(TOOLS, "weather in Paris?"), answer))
        (req,) = batch.run((chatml(OTHER, "summarise this"), answer))
        return len(req.out) - req.steps  # the draft tokens the second request accepted

    shared, apart = accepted(), accepted(share_outputs=False)
    assert shared >= len(answer) // 2 and apart < shared // 2


def test_poisoned_memory_costs_only_acceptance(closing):
    rng = np.random.default_rng(0)
    poisoned = memory()
    scope = prompt_identity(chatml(TOOLS, "weather in Paris?")).scope
    key = prompt_identity(chatml(TOOLS, "weather in Paris?")).key_text
    for _ in range(4):
        # The answer's opening, then junk (ids beyond the vocabulary too): followed, then wrong.
        junk = tuple(CharTokenizer().encode(CALL[:2])) + tuple(
            int(t) for t in rng.integers(0, 10 * VOCAB, 60))
        poisoned.record(scope=scope, model="char-model", request_text="x", key_text=key,
                        completion_text="junk", completion_ids=junk)
    plain = make(closing, None)
    (ref,) = FakeBatch(plain).run((chatml(TOOLS, "weather in Paris?"), CALL))
    p = make(closing, poisoned, record=False)  # the memory stays poisoned
    batch = FakeBatch(p)
    (got,) = batch.run((chatml(TOOLS, "weather in Paris?"), CALL))
    assert got.out == ref.out
    assert _within(batch.drafts, 4)  # nothing out of the vocabulary reaches vLLM
    assert got.steps <= ref.steps + 2  # wrong drafts are learned to be wrong, and cut
    # The vocabulary check is what keeps the junk out: without it the same check fails.
    unguarded = make(closing, poisoned, record=False)
    unguarded.vocab_size = None
    leaky = FakeBatch(unguarded)
    leaky.run((chatml(TOOLS, "weather in Paris?"), CALL))
    assert not _within(leaky.drafts, 4)


def test_a_moved_row_keeps_its_request(closing):
    p = make(closing, memory())
    batch = FakeBatch(p)
    batch.add(chatml(TOOLS, "a?"), "x")  # finishes first: the last row moves into row 0
    batch.add(chatml(TOOLS, "b?"), "y")
    batch.add(chatml(OTHER, "c?"), CALL)
    while batch.rows:
        batch.step()
    assert p.stats["requests"] == 3
    # A tracker that only looks at each row's last request takes the moved one for new.
    q = make(closing, memory())
    original = Rows.find
    try:
        Rows.find = lambda self, i, row, before: (  # type: ignore[method-assign]
            self.by_row[i] if i in self.by_row and self.by_row[i].holds(row, before, 10) else None)
        wrong = FakeBatch(q)
        wrong.add(chatml(TOOLS, "a?"), "x")
        wrong.add(chatml(TOOLS, "b?"), "y")
        wrong.add(chatml(OTHER, "c?"), CALL)
        while wrong.rows:
            wrong.step()
    finally:
        Rows.find = original  # type: ignore[method-assign]
    assert q.stats["requests"] > 3


def test_unseen_and_idle_requests_are_recorded(closing):
    mem = memory()
    p = make(closing, mem, finish_after_steps=2, idle_finish_s=0.0)
    batch = FakeBatch(p)
    req = batch.add(chatml(TOOLS, "weather in Paris?"), CALL)
    for _ in range(3):
        batch.step()
    batch.rows.clear()  # the request leaves the batch (its max_tokens) without a stop token
    assert p.finish_idle() == 1
    p.settle()
    assert [r.completion_ids for r in mem.records()] == [tuple(t for t in req.out if t != EOS)]


def test_host_time_is_counted(closing):
    p = make(closing, memory())
    FakeBatch(p).run((chatml(TOOLS, "weather in Paris?"), CALL))
    assert p.stats["steps"] > 0 and 0 < p.stats["host_seconds"] < 5


def _next_turn(p: Proposer) -> list[tuple[int, ...]]:
    """One request that ends at its token limit (no stop token), then, in the same row, the
    agent's next turn: a prompt that starts with all of the first request's tokens."""
    batch = FakeBatch(p)
    first = chatml(TOOLS, "weather in Paris?")
    req = batch.add(first, CALL)
    for _ in range(4):
        batch.step()
    said = CharTokenizer().decode(req.out)
    batch.rows.clear()
    batch.tokens[:] = 0
    batch.add(first + said + "<|im_end|>\n<|im_start|>user\nand in Rome?<|im_end|>\n"
              "<|im_start|>assistant\n", CALL.replace("Paris", "Rome"))
    while batch.rows:
        batch.step()
    p.close()
    return [r.completion_ids for r in p.memory.records()]


def test_the_next_turn_is_another_request(closing):
    records = _next_turn(make(closing, memory(), finish_after_steps=10**6, idle_finish_s=10**6))
    rome = tuple(CharTokenizer().encode(CALL.replace("Paris", "Rome")))
    assert len(records) == 2 and rome in records and len(set(records) - {rome}) == 1
    # Taking any longer row for the same request merges the two turns into one record.
    wrong = make(closing, memory(), finish_after_steps=10**6, idle_finish_s=10**6)
    wrong.rows.max_gap = 10**6
    assert len(_next_turn(wrong)) == 1


def test_a_failing_draft_costs_the_row_its_draft_not_the_engine(closing):
    p = make(closing, memory())

    def broken(*args, **kw):
        raise RuntimeError("boom")

    p.chain.propose = broken  # type: ignore[method-assign]
    with pytest.warns(UserWarning, match="drafting for a vLLM row failed"):
        (req,) = FakeBatch(p).run((chatml(TOOLS, "weather in Paris?"), CALL))
    assert req.out[-1] == EOS and req.steps == len(CALL) + 1  # plain decoding, to the end
    # The same failure without the guard reaches vLLM's step.
    p._guarded_row = p._propose_row  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"):
        FakeBatch(p).run((chatml(TOOLS, "again?"), CALL))


def _fit(steps: list[tuple[int, float, int]]) -> tuple[float, float] | None:
    clock = StepClock(min_steps=8)
    for tokens, seconds, rows in steps:
        clock.add(tokens, seconds, rows)
    return clock.row_cost()


def test_the_step_clock_fits_the_engines_cost():
    rng = np.random.default_rng(1)
    # Two rows; a step costs 20 ms plus 2 ms per verified token, with noise.
    decode = [(int(t), 0.020 + 0.002 * t + float(rng.normal(0, 0.0005)), 2)
              for t in rng.integers(2, 12, 64)]
    base, per_token = _fit(decode)
    mean_tokens = np.mean([t for t, _, _ in decode])
    assert per_token == pytest.approx(0.002, rel=0.15)
    assert base == pytest.approx(0.020 + 0.002 * mean_tokens / 2, rel=0.15)  # + the other row
    # Timing a prefill as if it were a decode step (its tokens unseen) breaks the fit: this
    # is why only steps that decoded every row are fed to the clock.
    prefills = [(2, 0.5, 2)] * 4
    wrong = _fit(decode[:30] + prefills + decode[30:])
    assert wrong is not None and wrong[1] != pytest.approx(0.002, rel=0.15)


def test_a_prefill_step_is_not_timed_as_a_draft_cost(closing):
    """At one stream each request's first step holds its prompt's prefill: the clock skips it
    (and the step after, whose tokens it then does not know)."""

    def timed_steps(p: Proposer) -> tuple[int, int]:
        assert p.clock is not None
        batch = FakeBatch(p)
        steps = 0
        for user in ("weather in Paris?", "time in Tokyo?", "weather in Rome?"):
            (req,) = batch.run((chatml(TOOLS, user), CALL))
            steps += req.steps
        return p.clock.count, steps

    timed, steps = timed_steps(make(closing, memory()))
    assert timed == steps - 2 * 3
    # The variant that must be caught: new rows not noticed, every request's prefill step and
    # the one after are timed (only the engine's very first step is not).
    p = make(closing, memory())
    propose_row = p._propose_row

    def unnoticed(*args):
        out = propose_row(*args)
        p._started = 0
        return out

    p._propose_row = unnoticed  # type: ignore[method-assign]
    timed, steps = timed_steps(p)
    assert timed == steps - 1


def test_the_fitted_cost_reaches_the_chain(closing):
    p = make(closing, memory())
    batch = FakeBatch(p)
    batch.add(chatml(TOOLS, "weather in Paris?"), CALL * 3)
    batch.add(chatml(OTHER, "summarise this"), CALL * 3)
    while batch.rows:
        batch.step()
    assert p.clock is not None and p.clock.count > 32 and "cost" in p.stats
    assert p.chain.cost.per_token == pytest.approx(p.stats["cost"][1], abs=1e-6)
    fixed = make(closing, memory(), cost=[1.0, 0.05])
    assert fixed.clock is None and fixed.chain.cost.per_token == 0.05
