"""Memory and suffix drafters on a real CompletionMemory (in-memory store, hash embedder)."""

from __future__ import annotations

import pytest

from agentspec.drafters.memory import MemoryDrafter
from agentspec.drafters.suffix import SuffixDrafter
from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.protocols import DraftContext
from agentspec.stores import InMemoryStore
from agentspec.types import Finished, Record, Verdict

KEY = "system: tools ls, cd\nuser: list the files in my home folder"


@pytest.fixture()
def memory():
    return CompletionMemory(InMemoryStore(), embedder=HashEmbedder())


def remember(memory, ids, *, scope="s", model="m", key=KEY):
    return memory.record(scope=scope, model=model, request_text=key, key_text=key,
                         completion_text=" ".join(map(str, ids)), completion_ids=ids)


def ctx(generated=(), scope="s", key=KEY):
    prompt = [900, 901, 902]
    return DraftContext(tokens=prompt + list(generated), prompt_len=3, scope=scope, key_text=key)


def test_opening_of_the_best_neighbour(memory):
    remember(memory, [10, 11, 12, 13, 14])
    drafter = MemoryDrafter(memory, "m")
    c = ctx()
    drafter.begin(c)
    assert drafter.propose(c, max_tokens=3).token_ids == (10, 11, 12)


def test_follows_then_realigns_after_a_different_argument(memory):
    remember(memory, [10, 11, 12, 50, 51, 13, 14, 15, 16])
    drafter = MemoryDrafter(memory, "m")
    c = ctx()
    drafter.begin(c)
    draft = drafter.propose(c, max_tokens=8)
    # The target accepted 10, 11, 12 and then produced 60 (another argument) instead of 50.
    c.tokens += [10, 11, 12, 60]
    drafter.observe(c, draft, Verdict((0, 1, 2), (10, 11, 12), 60))
    c.tokens += [61, 13, 14]
    assert drafter.propose(c, max_tokens=4).token_ids == (15, 16)


def test_several_neighbours_merge_into_a_tree(memory):
    remember(memory, [10, 11, 12, 13], key=KEY)
    remember(memory, [10, 11, 20, 21], key=KEY + " please")
    drafter = MemoryDrafter(memory, "m")
    c = ctx()
    drafter.begin(c)
    draft = drafter.propose(c, max_tokens=4)
    assert not draft.is_chain and sorted(draft.token_ids) == [10, 11, 12, 13, 20, 21]


@pytest.mark.parametrize(("scope", "model"), [("other-scope", "m"), ("s", "other-model")])
def test_other_scopes_and_models_never_draft(memory, scope, model):
    remember(memory, [10, 11, 12], scope="s", model="m")
    drafter = MemoryDrafter(memory, model)
    c = ctx(scope=scope)
    drafter.begin(c)
    assert drafter.propose(c, max_tokens=3).num_nodes == 0


def test_accepted_tokens_are_credited_to_their_record(memory):
    rid = remember(memory, [10, 11, 12, 13])
    drafter = MemoryDrafter(memory, "m")
    c = ctx()
    drafter.begin(c)
    draft = drafter.propose(c, max_tokens=4)
    c.tokens += [10, 11, 99]
    drafter.observe(c, draft, Verdict((0, 1), (10, 11), 99))
    drafter.end(c)
    assert drafter.credits(c) == {(drafter.memory, rid): 2}  # the request's credits, for its end
    assert memory.store.get(rid).accepted_tokens == 0
    memory.finish(Finished(Record("s", "m", "r", KEY, "", ()), remember=False, credits=((rid, 2),)))
    assert memory.store.get(rid).accepted_tokens == 2


def test_suffix_drafter_prefers_the_frequent_continuation_and_counts_its_occurrences(memory):
    for ids in ([1, 2, 3, 4, 7, 7], [5, 2, 3, 4, 8, 8], [6, 2, 3, 4, 8, 8]):
        remember(memory, ids, key=f"k{ids[0]}")
    drafter = SuffixDrafter(memory, "m", n_min=2)
    c = ctx(generated=[9, 2, 3, 4])
    drafter.begin(c)
    draft = drafter.propose(c, max_tokens=2)
    assert draft.token_ids == (8, 8, 7, 7)  # both, the frequent first
    assert draft.support == (2, 2, 1, 1)  # how many past occurrences continue each way


def test_suffix_drafter_is_scope_isolated(memory):
    remember(memory, [1, 2, 3, 4, 5], scope="a")
    drafter = SuffixDrafter(memory, "m", n_min=2)
    c = ctx(generated=[2, 3], scope="b")
    drafter.begin(c)
    assert drafter.propose(c, max_tokens=2).num_nodes == 0


def test_a_neighbour_is_a_follower_only_once_it_matched_a_token(memory):
    """Before the first token every candidate 'follows': only the request's own repeat is
    drafted in the high-acceptance class then; a neighbour joins it after a matched token."""
    remember(memory, [10, 11, 12, 13], key=KEY + " and sort them")
    drafter = MemoryDrafter(memory, "m")
    c = ctx()
    drafter.begin(c)
    draft = drafter.propose(c, max_tokens=4)
    assert draft.token_ids == (10, 11, 12, 13) and draft.acceptance is None  # the source's class
    c.tokens += [10]
    drafter.observe(c, draft, Verdict((), (), 10))
    following = drafter.propose(c, max_tokens=4)
    assert following.token_ids == (11, 12, 13) and following.acceptance == "memory/follow"
    remember(memory, [20, 21], key=KEY)  # the very same request
    same = ctx()
    drafter.begin(same)
    repeat = drafter.propose(same, max_tokens=2)
    assert repeat.token_ids[:2] == (20, 21) and repeat.acceptance == "memory/follow"  # spine first


def test_each_node_of_the_memory_tree_counts_the_neighbours_that_back_it(memory):
    remember(memory, [10, 11, 12, 13], key=KEY)
    remember(memory, [10, 11, 20, 21], key=KEY + " please")
    remember(memory, [10, 11, 12, 30], key=KEY + " now")
    drafter = MemoryDrafter(memory, "m")
    c = ctx()
    drafter.begin(c)
    draft = drafter.propose(c, max_tokens=4)
    support = dict(zip(draft.token_ids, draft.support, strict=True))
    assert support == {10: 3, 11: 3, 12: 2, 13: 1, 30: 1, 20: 1, 21: 1}



def test_the_speculator_drafts_from_as_many_neighbours_as_its_config_names(memory):
    from agentspec import SpecConfig
    from agentspec.speculator import Speculator

    class Target:  # only what building the drafters reads
        fingerprint = "m"

    spec = object.__new__(Speculator)
    spec.memory = spec._memory = memory
    spec.target, spec.draft_model = Target(), None
    spec.config = SpecConfig(memory_neighbours=3, draft_head=False)
    drafters = Speculator._default_drafters(spec)
    assert [d.k for d in drafters if isinstance(d, MemoryDrafter)] == [3]
    assert SpecConfig().memory_neighbours == 8
