"""The sanitiser and the guard on untrusted drafts and drafters (no model)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from agentspec.decoding.untrusted import MAX_SCAN, Guarded, sanitize
from agentspec.protocols import DraftContext
from agentspec.types import EMPTY_DRAFT, Draft


def _raw(token_ids, parents, source="m", probs=None) -> Draft:
    draft = object.__new__(Draft)
    for name, value in (("token_ids", token_ids), ("parents", parents), ("source", source),
                        ("draft_probs", probs)):
        object.__setattr__(draft, name, value)
    return draft


def clean(draft, vocab=10, room=8, nodes=63) -> Draft:
    return sanitize(draft, vocab_size=vocab, room=room, max_nodes=nodes)


def test_duplicate_siblings_merge_into_the_first_with_their_subtrees():
    # Two children 5 of the root (nodes 0 and 1); node 1's children move under node 0, where
    # its own duplicate child 6 (node 3) merges into node 2.
    tree = _raw((5, 5, 6, 6, 7, 8), (-1, -1, 0, 1, 1, 3))
    assert clean(tree) == Draft((5, 6, 8, 7), (-1, 0, 1, 0), "m")
    # Per-node sources follow the kept (first) nodes.
    tree = _raw((5, 5, 6), (-1, -1, 1), ("a", "b", "c"))
    assert clean(tree) == Draft((5, 6), (-1, 0), ("a", "c"))


def test_duplicates_no_longer_stop_the_walk():
    from agentspec.decoding.verify import walk

    draft = clean(_raw((1, 1, 2), (-1, -1, 1)))
    assert walk(draft, [1, 2, 0, 0]).accepted == (1, 2)


def test_malformed_fields_are_dropped_not_raised():
    assert clean(_raw((1, 2, 3), (-1, 0))) == Draft((1, 2), (-1, 0), "m")  # unequal lengths
    assert clean(_raw((1, 2.5, "3", None, True), (-1, 0, 0, 0, 0))) == Draft((1,), (-1,), "m")
    assert clean(_raw(np.array([1, 2]), [-1, 0])) == Draft((1, 2), (-1, 0), "m")  # numpy ids
    assert clean(_raw(torch.tensor([1, 2]), (-1, 0))) == Draft((1, 2), (-1, 0), "m")
    assert clean(_raw((1, 2), (-1, 5))) == Draft((1,), (-1,), "m")  # a forward parent
    assert clean(_raw((1, 2), (-1, -3))) == Draft((1,), (-1,), "m")  # a parent below -1
    assert clean(_raw((1, 2), (-1, 0), source=("only one",))).source == "untrusted"
    assert clean(_raw((1, 2), (-1, 0), source=None)).source == "untrusted"
    for junk in (None, "draft", [1, 2], 42, _raw(None, None), _raw(7, 8)):
        assert clean(junk) == EMPTY_DRAFT


def test_draft_probs_kept_only_in_the_right_shape_on_a_chain():
    q = torch.full((2, 10), 0.1)
    assert clean(_raw((1, 2), (-1, 0), probs=q)).draft_probs is q
    for bad in (torch.full((3, 10), 0.1), torch.full((2, 7), 0.1), torch.ones(2, 10, dtype=torch.long),
                "q", torch.ones(2)):
        assert clean(_raw((1, 2), (-1, 0), probs=bad)).draft_probs is None
    tree = clean(_raw((1, 2), (-1, -1), probs=q))  # a tree: verified as point masses
    assert tree.num_nodes == 2 and tree.draft_probs is None
    cut = clean(_raw((1, 99, 3), (-1, 0, 0), probs=torch.full((3, 10), 0.1)))  # rows follow nodes
    assert cut == Draft((1, 3), (-1, 0), "m") and cut.draft_probs.shape == (2, 10)


def test_huge_drafts_are_scanned_up_to_a_bound():
    n = MAX_SCAN + 1000
    out = sanitize(_raw(tuple(range(n)), tuple(range(-1, n - 1))), vocab_size=None, room=10**6,
                   max_nodes=10**6)
    assert out.num_nodes == MAX_SCAN


def test_guard_skips_a_drafter_for_the_rest_of_the_call_and_logs_once(caplog):
    class Flaky:
        name = "flaky"
        calls = 0

        def begin(self, context): pass

        def propose(self, context, *, max_tokens):
            self.calls += 1
            raise ValueError("bad day")

        def observe(self, context, draft, verdict):
            raise AssertionError("never called once failed")

        def end(self, context):
            raise AssertionError("never called once failed")

    caplog.set_level(logging.WARNING, logger="agentspec")
    flaky = Flaky()
    for _ in range(2):  # two calls
        ctx = DraftContext(tokens=[1, 2, 3], prompt_len=3)
        guard = Guarded(flaky)
        guard.begin(ctx)
        assert guard.propose(ctx, max_tokens=4).draft == EMPTY_DRAFT
        assert guard.propose(ctx, max_tokens=4).draft == EMPTY_DRAFT
        guard.observe(ctx, EMPTY_DRAFT, None)  # type: ignore[arg-type]
        guard.end(ctx)
    assert flaky.calls == 2  # once per call
    assert len([r for r in caplog.records if "flaky" in r.getMessage()]) == 1


def test_support_counts_follow_their_nodes_or_are_dropped():
    # A tree: the duplicate sibling (node 1) merges into node 0 and the kept nodes keep their counts.
    tree = _raw((5, 5, 6, 7), (-1, -1, 0, 1))
    object.__setattr__(tree, "support", (3, 1, 2, 1))
    assert clean(tree).token_ids == (5, 6, 7) and clean(tree).support == (3, 2, 1)
    for bad in ((3, 0), (3,), (3, "2"), [3, 2], (3, 2.0)):
        chain = _raw((1, 2), (-1, 0))
        object.__setattr__(chain, "support", bad)
        assert clean(chain) == Draft((1, 2), (-1, 0), "m") and clean(chain).support is None


def test_a_draft_refuses_support_that_does_not_fit_its_nodes():
    import pytest

    assert Draft((1, 2), (-1, 0), "m", support=(2, 1)).support == (2, 1)
    with pytest.raises(ValueError, match="support has 1 entries for 2 nodes"):
        Draft((1, 2), (-1, 0), "m", support=(2,))
    with pytest.raises(ValueError, match="support counts must be ints >= 1, got 0"):
        Draft((1, 2), (-1, 0), "m", support=(2, 0))


def test_the_guard_sanitises_every_proposal_and_keeps_a_declared_acceptance_class():
    class Raw:
        name = "raw"

        def begin(self, context):
            pass

        def propose(self, context, *, max_tokens):
            # a tree with a duplicate sibling, an id past the vocabulary and a hostile class
            bad = object.__new__(Draft)
            for field, value in (("token_ids", (5, 5, 7, 99)), ("parents", (-1, -1, 0, 0)),
                                 ("source", "raw"), ("draft_probs", None), ("support", None),
                                 ("acceptance", "raw/long")):
                object.__setattr__(bad, field, value)
            return bad

        def observe(self, context, draft, verdict):
            pass

        def end(self, context):
            pass

    ctx = DraftContext(tokens=[1, 2], prompt_len=2)
    guard = Guarded(Raw(), vocab_size=50, max_nodes=8)
    draft = guard.propose(ctx, max_tokens=4).draft
    assert draft.token_ids == (5, 7) and draft.parents == (-1, 0)
    assert draft.acceptance == "raw/long"
    assert guard.propose(ctx, max_tokens=0).draft == EMPTY_DRAFT
    hostile = object.__new__(Draft)
    for field, value in (("token_ids", (5,)), ("parents", (-1,)), ("source", "raw"),
                         ("draft_probs", None), ("support", None), ("acceptance", 3)):
        object.__setattr__(hostile, field, value)
    assert sanitize(hostile, vocab_size=50, room=4, max_nodes=8).acceptance is None
