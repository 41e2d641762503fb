"""The suffix drafter's matching: the longest shared context ranks occurrences, the draft
walks the most frequent continuation level by level, the request's own text and the engine's
outputs (:class:`OutputIndex`) are matched beside the scope's completions. Each claim is
checked beside a variant built to break it."""

from __future__ import annotations

import pytest

from agentspec.drafters import suffix as suffix_module
from agentspec.drafters.suffix import OutputIndex, SuffixDrafter, gram_lengths, match_class
from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.protocols import DraftContext
from agentspec.stores import InMemoryStore
from agentspec.types import Verdict


@pytest.fixture()
def memory():
    return CompletionMemory(InMemoryStore(), embedder=HashEmbedder())


def remember(memory, ids, scope="s"):
    key = f"request {len(list(memory.completions(scope=scope, model='m')))}"  # one record each
    memory.record(scope=scope, model="m", request_text=key, key_text=key,
                  completion_text="", completion_ids=ids)


def ctx(generated=(), prompt=(900, 901, 902), scope="s"):
    return DraftContext(tokens=list(prompt) + list(generated), prompt_len=len(prompt),
                        scope=scope, key_text="k")


def test_gram_lengths_are_the_ends_and_the_powers_of_two_between():
    assert gram_lengths(1, 8) == (1, 2, 4, 8)
    assert gram_lengths(3, 8) == (3, 4, 8)
    assert gram_lengths(5, 6) == (5, 6)
    assert match_class(1) == 1 and match_class(7) == 6 and match_class(40) == 24


# Three completions continue the 3-gram (2, 3, 4) with 8; one shares a longer context with
# the request (1, 2, 3, 4) and continues with 7.
LONGER = [1, 2, 3, 4, 7, 7]
FREQUENT = ([5, 2, 3, 4, 8, 8], [6, 2, 3, 4, 8, 8], [9, 2, 3, 4, 8, 8])


def test_the_longest_shared_context_outranks_the_frequent_continuation(memory, monkeypatch):
    for ids in (LONGER, *FREQUENT):
        remember(memory, ids)
    drafter = SuffixDrafter(memory, "m", n_min=2, n_max=3)
    c = ctx([1, 2, 3, 4])
    drafter.begin(c)
    draft = drafter.propose(c, max_tokens=2)
    assert draft.token_ids[:2] == (7, 7)
    assert draft.acceptance == "suffix/3"  # a 4-token context: the class of 3 to 5
    # The variant that must be caught: occurrences not extended backwards (every one has the
    # 3-gram's context): the frequent continuation wins.
    monkeypatch.setattr(suffix_module, "_context_length", lambda tokens, stop, tail, n, lim: n)
    drafter = SuffixDrafter(memory, "m", n_min=2, n_max=3)
    c = ctx([1, 2, 3, 4])
    drafter.begin(c)
    assert drafter.propose(c, max_tokens=2).token_ids[:2] == (8, 8)


def test_the_walk_takes_the_most_frequent_token_at_each_depth(memory, monkeypatch):
    # After (1, 2): three completions go on with 5 (then 6, 7 or 8), two with 9 9 9. The
    # whole continuation most often repeated is 9 9 9, but most go on with 5.
    for ids in ([1, 2, 5, 6, 3], [1, 2, 5, 7, 3], [1, 2, 5, 8, 3], [1, 2, 9, 9, 9],
                [1, 2, 9, 9, 9]):
        remember(memory, ids)

    def first_path() -> tuple[int, ...]:
        drafter = SuffixDrafter(memory, "m", n_min=2, n_max=2, max_branches=1)
        c = ctx([1, 2])
        drafter.begin(c)
        draft = drafter.propose(c, max_tokens=3)
        assert draft.support is not None
        return draft.token_ids, draft.support

    assert first_path() == ((5, 8, 3), (3, 1, 1))  # a tie (6, 7, 8): the most recent
    # The variant that must be caught: the most repeated whole continuation.
    monkeypatch.setattr(suffix_module, "_frequency_walk", lambda conts: max(conts, key=conts.count))
    assert first_path()[0] == (9, 9, 9)


def test_own_text_copies_from_the_prompt_without_any_memory():
    prompt = (50, 51, 52, 60, 61, 62, 63, 53)
    drafter = SuffixDrafter(None, "m", n_min=2, own_text=True)
    c = ctx([52, 60], prompt=prompt)
    drafter.begin(c)
    assert drafter.propose(c, max_tokens=3).token_ids[:3] == (61, 62, 63)
    # The variant: no own text, nothing to match.
    other = SuffixDrafter(None, "m", n_min=2)
    c = ctx([52, 60], prompt=prompt)
    other.begin(c)
    assert other.propose(c, max_tokens=3).num_nodes == 0


def _run(drafter, c, tokens):
    """Feed ``tokens`` to a begun request as committed steps."""
    for t in tokens:
        c.tokens.append(t)
        drafter.observe(c, drafter.propose(c, max_tokens=0), Verdict((), (), t))


def test_outputs_of_running_requests_draft_across_scopes():
    outputs = OutputIndex(n_min=2)
    drafter = SuffixDrafter(None, "m", n_min=2, outputs=outputs)
    a, b = ctx(scope="a"), ctx(scope="b")
    drafter.begin(a)
    drafter.begin(b)
    # ``a`` is still running: what it generated so far is matched for ``b`` (another scope),
    # and the prompt's last tokens lead its segment, so a reply's opening matches too.
    a.tokens.append(10)
    drafter.observe(a, drafter.propose(a, max_tokens=0), Verdict((), (), 10))
    _run(drafter, a, [11, 12, 13])
    assert drafter.propose(b, max_tokens=4).token_ids[:4] == (10, 11, 12, 13)
    # The variant: without the shared outputs, ``b`` has nothing.
    alone = SuffixDrafter(None, "m", n_min=2)
    c = ctx(scope="b")
    alone.begin(c)
    assert alone.propose(c, max_tokens=4).num_nodes == 0


def test_a_request_does_not_match_its_own_segment_twice():
    outputs = OutputIndex(n_min=2)
    drafter = SuffixDrafter(None, "m", n_min=2, own_text=True, outputs=outputs)
    c = ctx()
    drafter.begin(c)
    _run(drafter, c, [20, 21, 22, 20, 21])
    draft = drafter.propose(c, max_tokens=1)
    assert draft.token_ids == (22,) and draft.support == (1,)  # its own text alone


def test_output_index_evicts_the_oldest_and_rebuilds_its_table():
    index = OutputIndex(n_min=1, n_max=2, max_tokens=10)
    first = index.open()
    index.extend(first, [1, 2, 3, 4, 5, 6])
    assert index.find((1, 2)) == [([1, 2, 3, 4, 5, 6], 2)]
    second = index.open()
    index.extend(second, [7, 1, 2, 9, 9, 9])  # 12 held: the first segment goes
    assert [stop for _, stop in index.find((1, 2))] == [3]
    assert index.find((3, 4)) == []
    third = index.open()
    index.extend(third, [1, 2, 8, 8, 8])  # the second goes too: the table is rebuilt
    assert index.find((1, 2)) == [([1, 2, 8, 8, 8], 2)]
    assert index.find((1, 2), exclude=third) == []
    with pytest.raises(ValueError, match="max_tokens"):
        OutputIndex(max_tokens=0)
