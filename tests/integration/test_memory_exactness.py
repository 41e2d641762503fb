"""The memory never changes an output: poisoned entries, real repeats, greedy identity."""

from __future__ import annotations

import random

import pytest

from agentspec import SpecConfig, Speculator
from agentspec.drafters.policy import DEFAULT_COST
from agentspec.memory import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores import SQLStore
from agentspec.text import conversation_key
from agentspec.types import Record
from tests.prompts import ALL_PROMPTS

MAX_NEW = 32
PROMPTS = [ALL_PROMPTS[i] for i in (2, 4, 8, 10, 13)]


@pytest.fixture()
def memory(tmp_path):
    return CompletionMemory(SQLStore(f"sqlite:///{tmp_path}/m.db"), embedder=HashEmbedder())


@pytest.fixture(scope="module")
def references(spec):
    plain = Speculator(spec.target, speculate=False, memory=None)
    return [list(plain.generate(p, MAX_NEW).token_ids) for p in PROMPTS]


@pytest.mark.slow
def test_poisoned_memory_leaves_greedy_output_identical(spec, memory, references):
    rng = random.Random(0)
    fp = spec.target.fingerprint
    for prompt, ref in zip(PROMPTS, references, strict=True):
        key = conversation_key(prompt)
        # Adversarial entries under the very same key: the right start, then garbage; pure noise;
        # and the right answer with one token flipped in the middle.
        flipped = list(ref)
        flipped[len(ref) // 2] = (flipped[len(ref) // 2] + 1) % spec.target.vocab_size
        # Out-of-vocabulary ids, too: they are pruned from the draft, the rest still drafts.
        for n, ids in enumerate((ref[:5] + [rng.randrange(spec.target.vocab_size) for _ in range(40)],
                                 [rng.randrange(spec.target.vocab_size) for _ in range(40)], flipped,
                                 ref[:3] + [spec.target.vocab_size + 5] + ref[3:])):
            memory.record(scope="s", model=fp, request_text=key, key_text=key,
                          completion_text=f"poison {n}", completion_ids=ids)
    poisoned = Speculator(spec.target, memory=memory, cost=DEFAULT_COST)
    for prompt, ref in zip(PROMPTS, references, strict=True):
        out = poisoned.generate(prompt, MAX_NEW, scope="s", record=False)
        assert list(out.token_ids) == ref
        assert out.stats.drafted.get("memory", 0) > 0  # the poison really was drafted


@pytest.mark.slow
def test_memory_on_is_identical_and_repeats_take_few_steps(spec, memory, references):
    with_memory = Speculator(spec.target, memory=memory, cost=DEFAULT_COST)
    for prompt, ref in zip(PROMPTS, references, strict=True):
        assert list(with_memory.generate(prompt, MAX_NEW, scope="s").token_ids) == ref
    for prompt, ref in zip(PROMPTS, references, strict=True):  # exact repeats, memory warm
        out = with_memory.generate(prompt, MAX_NEW, scope="s")
        assert list(out.token_ids) == ref
        assert out.stats.steps <= 3 and out.stats.accepted.get("memory", 0) >= len(ref) - 3
    # An exact duplicate bumps hits instead of adding rows.
    assert len(memory.store) == len(PROMPTS)


def test_a_memory_that_fails_to_record_does_not_fail_the_call(spec, references):
    """The call is done and exact when its completion is recorded: a memory that raises there
    (a bug of its own, a user's memory object) costs the completion's row, not the answer."""

    class Broken(CompletionMemory):
        def record(self, **row):
            raise RuntimeError("index out of order")

    broken = Broken(SQLStore("sqlite://"), embedder=HashEmbedder())
    speculator = Speculator(spec.target, memory=broken, cost=DEFAULT_COST)
    with pytest.warns(UserWarning, match="could not record a completion.*index out of order"):
        out = speculator.generate(PROMPTS[0], MAX_NEW)
    assert list(out.token_ids) == references[0]


class Listening:
    """A memory of the user's that remembers one completion and logs what it hears."""

    def __init__(self, ids: list[int], model: str) -> None:
        self.ids, self.model, self.heard = ids, model, []

    def lookup(self, key_text, *, scope, model, k=8):
        return [(Record(scope, self.model, "r", key_text, "c", tuple(self.ids), id=7), 0.99)]

    def record(self, **row):
        self.heard.append(("record", tuple(row["completion_ids"])))
        return 8

    def credit(self, record_id, accepted_tokens):
        self.heard.append(("credit", record_id, accepted_tokens))


@pytest.mark.slow
@pytest.mark.parametrize("behind", [False, True])
def test_a_call_ends_in_one_exit_credits_then_record_and_an_abandoned_one_credits(
        spec, references, behind):
    """The memory hears a call once it ends: the accepted tokens each remembered completion
    drafted, then the completion; a stream closed early still pays its credits, records
    nothing."""
    listening = Listening(references[0], spec.target.fingerprint)
    speculator = Speculator(spec.target, memory=listening, cost=DEFAULT_COST,
                            config=SpecConfig(write_behind=behind))
    out = speculator.generate(PROMPTS[0], MAX_NEW)
    assert list(out.token_ids) == references[0]
    accepted = out.stats.accepted.get("memory", 0)
    assert accepted > 0
    assert 0 < out.stats.first_token_seconds < out.stats.seconds  # the first step of several
    assert listening.heard == [("credit", 7, accepted), ("record", tuple(references[0]))]
    listening.heard.clear()
    stream = speculator.stream(PROMPTS[0], MAX_NEW)
    next(stream)
    stream.close()
    assert [h[:2] for h in listening.heard] == [("credit", 7)]
    assert stream.generation is None
