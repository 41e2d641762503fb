import pytest

from agentspec.config import SpecConfig
from agentspec.drafters.ngram import NgramIndex
from agentspec.drafters.prompt_lookup import PromptLookupDrafter
from agentspec.protocols import DraftContext


@pytest.mark.parametrize(
    ("tokens", "n_min", "n_max", "expected"),
    [
        ([1, 2, 3, 9, 1, 2], 2, 4, (2, 2)),  # "1 2" seen before, continuation at index 2
        ([1, 2, 3, 9, 8, 1, 2, 3], 2, 4, (3, 3)),  # the longest n wins
        ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, 3, (2, 6)),  # the most recent occurrence wins
        ([1, 2, 3, 4], 2, 4, (0, -1)),  # no repeat
        ([7, 7], 2, 4, (0, -1)),  # the suffix never matches itself
        ([7, 7, 7], 2, 4, (2, 2)),
        ([1], 1, 3, (0, -1)),
        ([4, 1, 4], 1, 3, (1, 1)),
    ],
)
def test_match_table(tokens, n_min, n_max, expected):
    assert NgramIndex(n_min, n_max).match(tokens) == expected


def test_incremental_growth_equals_fresh_index():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3]
    grown = NgramIndex(1, 3)
    for end in range(1, len(tokens) + 1):
        assert grown.match(tokens[:end]) == NgramIndex(1, 3).match(tokens[:end]), end


def reference_table(tokens, n_min, n_max):
    """Every n-gram with a continuation, mapped to the stop of its latest occurrence, one tuple
    at a time: what the index's table must hold."""
    table = {}
    for stop in range(n_min, len(tokens)):
        for n in range(n_min, min(n_max, stop) + 1):
            table[tuple(tokens[stop - n : stop])] = stop
    return table


@pytest.mark.parametrize(("n_min", "n_max"), [(1, 4), (2, 8), (3, 3)])
def test_the_table_grown_in_random_steps_holds_every_ngram_at_its_latest_stop(n_min, n_max):
    import random

    rng = random.Random(n_min * 10 + n_max)
    tokens = [rng.randrange(6) for _ in range(400)]  # a small alphabet: many repeats
    grown, end = NgramIndex(n_min, n_max), 0
    while end < len(tokens):
        end = min(len(tokens), end + rng.randrange(1, 40))
        grown.match(tokens[:end])
        assert grown._table == reference_table(tokens[:end], n_min, n_max), end


def test_a_table_keeping_the_first_stop_fails_the_reference():
    """The check above can fail: an index that kept each n-gram's first occurrence instead of
    its latest differs from the reference on a sequence with repeats."""
    tokens = [1, 2, 1, 2, 1, 2, 3]
    earliest = {}
    for stop in range(2, len(tokens)):
        for n in range(2, min(3, stop) + 1):
            earliest.setdefault(tuple(tokens[stop - n : stop]), stop)
    assert earliest != reference_table(tokens, 2, 3)


def test_query_over_another_sequence():
    src = [10, 11, 12, 13, 14]
    assert NgramIndex(2, 3).match(src, [0, 11, 12]) == (2, 3)


def test_bad_bounds():
    with pytest.raises(ValueError, match="n_min"):
        NgramIndex(3, 2)


def test_prompt_lookup_drafts_the_continuation_up_to_the_budget():
    drafter = PromptLookupDrafter(SpecConfig(max_draft_tokens=12))
    ctx = DraftContext(tokens=[1, 2, 3, 4, 5, 6, 7, 8, 1, 2], prompt_len=10)
    drafter.begin(ctx)
    draft = drafter.propose(ctx, max_tokens=4)
    assert draft.token_ids == (3, 4, 5, 6) and draft.is_chain and draft.source == "prompt_lookup"
    assert drafter.propose(ctx, max_tokens=0).num_nodes == 0


def test_prompt_lookup_uses_extra_sources():
    drafter = PromptLookupDrafter()
    ctx = DraftContext(tokens=[50, 60, 70], prompt_len=3, extra_sources=([1, 60, 70, 80, 90],))
    drafter.begin(ctx)
    assert drafter.propose(ctx, max_tokens=5).token_ids == (80, 90)


def test_one_token_matches_only_where_nothing_longer_does_and_each_length_in_its_own_class():
    drafter = PromptLookupDrafter()
    longer = DraftContext(tokens=[1, 2, 3, 9, 2, 4, 1, 2], prompt_len=8)
    drafter.begin(longer)
    draft = drafter.propose(longer, max_tokens=3)
    assert draft.token_ids == (3, 9, 2) and draft.acceptance == "prompt_lookup/2"  # "1 2", not "2"
    four = DraftContext(tokens=[1, 2, 3, 4, 5, 6, 1, 2, 3, 4], prompt_len=10)
    drafter.begin(four)
    draft = drafter.propose(four, max_tokens=2)
    assert draft.token_ids == (5, 6) and draft.acceptance == "prompt_lookup/4"  # its own class
    single = DraftContext(tokens=[5, 6, 7, 8, 6], prompt_len=5)
    drafter.begin(single)
    draft = drafter.propose(single, max_tokens=2)
    assert draft.token_ids == (7, 8) and draft.acceptance == "prompt_lookup/1"
    strict = PromptLookupDrafter(SpecConfig(ngram_min=2))
    strict.begin(single)
    assert strict.propose(single, max_tokens=2).num_nodes == 0
