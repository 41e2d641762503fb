"""The cost-aware policy: never a draft whose measured cost makes it a loss."""

import json
import math
from dataclasses import replace

import pytest
import torch

from agentspec.drafters.chain import AcceptanceKey, DrafterChain, first_path, trim_to_depth
from agentspec.drafters.policy import Acceptance, CostModel, best_length, expected_tokens
from agentspec.engine.cost import COST_CACHE_VERSION, cost_points, measure_cost
from agentspec.protocols import DraftContext
from agentspec.tree import merge_chains
from agentspec.types import Draft, Verdict

CPU = CostModel.fit([(1, 0.058), (8, 0.084), (16, 0.114), (32, 0.152), (64, 0.220)])


def test_fit_recovers_a_line():
    model = CostModel.fit([(1, 0.011), (11, 0.031), (21, 0.051)])
    assert model.base == pytest.approx(0.009) and model.per_token == pytest.approx(0.002)


def test_points_are_interpolated_and_the_slope_continues():
    model = CostModel.fit([(1, 0.06), (2, 0.10), (4, 0.08), (8, 0.09)])
    assert model.seconds(0) == pytest.approx(0.06)  # 1 token scored
    assert model.seconds(2) == pytest.approx(0.09)  # 3 tokens: halfway between 2 and 4
    assert model.seconds(7) == pytest.approx(0.09)
    assert model.seconds(9) == pytest.approx(0.09 + 2 * model.per_token)
    with pytest.raises(ValueError, match="points"):
        CostModel(0.1, 0.01, ((0, 0.1),))


def test_a_curve_where_short_drafts_cost_more_picks_a_longer_one():
    # A shape measured on the 2-core CPU: 2-3 tokens scored cost more than 4-8.
    bumpy = CostModel.fit([(1, 0.0637), (2, 0.0994), (3, 0.1165), (4, 0.0889), (6, 0.0826),
                           (8, 0.0823), (12, 0.0917), (16, 0.1008), (32, 0.1361), (64, 0.2125)])
    assert bumpy.seconds(1) > bumpy.seconds(5)
    assert best_length(0.6, 64, bumpy) >= 3
    line = CostModel(bumpy.base, bumpy.per_token)  # the same data as a line misses the bump
    assert line.seconds(1) < line.seconds(5)


def test_cost_cache_is_used_and_older_versions_are_measured_again(tmp_path):
    cache = tmp_path / "cost.json"
    cache.write_text(json.dumps({"version": COST_CACHE_VERSION, "base": 0.05, "per_token": 0.001,
                                 "points": [[1, 0.05], [4, 0.06]], "probe": [0.0, 0.0]}))
    target = _FakeTarget()
    assert measure_cost(target, cache_file=cache).seconds(3) == pytest.approx(0.06)
    assert target.scored == [1, 8] * 4  # only the probe ran: a warm-up round and three
    cache.write_text(json.dumps({"base": 1.6, "per_token": 0.06, "points": [[1, 1.1]]}))  # v1
    target = _FakeTarget()
    model = measure_cost(target, sizes=(0, 3), context=16, repeats=1, cache_file=cache)
    assert target.scored[:4] == [1, 4, 1, 4] and model.base < 1.0  # rounds interleave the sizes
    data = json.loads(cache.read_text())
    assert data["version"] == COST_CACHE_VERSION and len(data["probe"]) == 2


def test_a_file_that_passed_the_probe_is_read_without_probing_again(tmp_path):
    """Another target in the same process reads the checked curve without a forward; the file
    rewritten (other bytes) is probed again."""
    cache = tmp_path / "cost.json"
    cached = {"version": COST_CACHE_VERSION, "base": 0.05, "per_token": 0.001,
              "points": [[1, 0.05], [4, 0.06]], "probe": [0.0, 0.0]}
    cache.write_text(json.dumps(cached))
    first, second = _FakeTarget(), _FakeTarget()
    assert measure_cost(first, cache_file=cache).seconds(3) == pytest.approx(0.06)
    assert first.scored  # the probe ran once
    assert measure_cost(second, cache_file=cache).seconds(3) == pytest.approx(0.06)
    assert second.scored == []
    cache.write_text(json.dumps(dict(cached, base=0.07)))
    third = _FakeTarget()
    measure_cost(third, cache_file=cache)
    assert third.scored == [1, 8] * 4


def test_a_curve_of_other_widths_is_measured_again(tmp_path):
    """A curve is a step per forward width: one cached for other widths (an older default,
    a width the probe dropped) would size drafts on steps the target does not have."""
    cache = tmp_path / "cost.json"
    cached = {"version": COST_CACHE_VERSION, "base": 1.0, "per_token": 0.0,
              "points": [[1, 1.0], [8, 1.0]], "probe": [0.0, 0.0], "widths": [2, 8]}
    cache.write_text(json.dumps(cached))
    target = _WidthsTarget((2, 4, 8))  # its probe drops 4
    assert measure_cost(target, cache_file=cache).seconds(0) == 1.0  # the same widths: kept
    assert target.settled
    target = _WidthsTarget((2, 4, 6, 8), drops=())
    model = measure_cost(target, context=16, repeats=1, cache_file=cache)
    assert model.seconds(0) < 0.5 and sorted(set(target.scored)) == [1, 2, 4, 6, 8]
    assert json.loads(cache.read_text())["widths"] == [2, 4, 6, 8]


@pytest.mark.parametrize("reprobe", [True, False])
def test_a_curve_cached_under_load_is_measured_again(tmp_path, reprobe, monkeypatch):
    import agentspec.engine.cost as cost

    if not reprobe:  # a deliberately wrong cache: it trusts whatever it holds
        monkeypatch.setattr(cost, "probe_cost", lambda target, rounds=3: [1.0, 1.0])
    cache = tmp_path / "cost.json"
    # Measured while another job held the machine: every forward took a second, the probe too.
    loaded = {"version": COST_CACHE_VERSION, "base": 1.0, "per_token": 0.0,
              "points": [[1, 1.0], [4, 1.0]], "probe": [1.0, 1.0]}
    cache.write_text(json.dumps(loaded))
    target = _FakeTarget()  # now a forward takes microseconds
    model = measure_cost(target, sizes=(0, 3), context=16, repeats=1, cache_file=cache)
    remeasured = model.seconds(0) < 0.5
    assert remeasured == reprobe
    if reprobe:
        assert json.loads(cache.read_text())["points"][0][1] < 0.5
        # A machine slower now than when the curve was cached keeps the curve.
        slow = dict(loaded, probe=[0.0, 0.0])
        cache.write_text(json.dumps(slow))
        assert measure_cost(_FakeTarget(), cache_file=cache).seconds(0) == 1.0


def test_cost_points_undo_load_bursts_and_step_by_width():
    # A curve measured while another job ran (seen on this CPU): 8 and 12 tokens took seconds.
    burst = {0: 0.15, 1: 0.14, 3: 0.12, 7: 5.4, 11: 3.4, 15: 0.16, 31: 0.2, 63: 0.28}
    points = cost_points(burst)
    assert [sec for _, sec in points] == sorted(sec for _, sec in points)  # non-decreasing
    assert dict(points)[8] == 0.16 and dict(points)[1] == 0.12
    stepped = CostModel.fit(cost_points({1: 0.10, 3: 0.11, 7: 0.12, 15: 0.15}, (2, 4, 8, 16)))
    assert stepped.seconds(0) == stepped.seconds(1) == 0.10  # one width-2 forward either way
    assert stepped.seconds(4) == stepped.seconds(7) == 0.12  # 5-8 tokens: the width-8 forward
    assert stepped.seconds(8) == 0.15
    # The raw times as points (what the curve was before) keep the burst: a wrong curve.
    raw = CostModel.fit([(n + 1, sec) for n, sec in sorted(burst.items())])
    assert raw.seconds(7) > 10 * raw.seconds(15)


class _FakeSequence:
    def commit(self, root, verdict):
        pass

    def release(self):
        pass


class _FakeTarget:
    """The engine's door as the cost measurement uses it: a forward's time is nothing."""

    vocab_size, max_context = 100, 4096

    def __init__(self):
        self.scored = []

    def new_sequence(self, *, cached=True):
        return _FakeSequence()

    def prefill(self, seq, prompt):
        pass

    def run(self, members, *, hidden=False):
        self.scored += [len(m.ids) for m in members]
        return [torch.zeros(len(m.ids), self.vocab_size) for m in members]


class _WidthsTarget(_FakeTarget):
    """A target with forward widths, of which its first forward's probe may drop some."""

    def __init__(self, widths, drops=(4,)):
        super().__init__()
        self.widths, self.drops, self.settled = tuple(widths), drops, False

    def check_widths(self):
        if not self.settled:
            self.settled = True
            self.widths = tuple(w for w in self.widths if w not in self.drops)
        return self.widths


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize("alpha", [0.0, 0.01, 0.02])
def test_no_draft_when_acceptance_cannot_pay_for_it(alpha):
    assert best_length(alpha, 64, CPU) == 0


def test_no_draft_when_every_draft_token_is_expensive():
    # A synthetic device where each extra token costs as much as the whole base pass.
    steep = CostModel(base=0.001, per_token=0.01)
    assert best_length(0.9, 64, steep) == 0


def test_lengths_grow_with_acceptance():
    lengths = [best_length(a, 64, CPU) for a in (0.3, 0.6, 0.8, 0.95, 0.999)]
    assert lengths == sorted(lengths) and lengths[0] >= 1 and lengths[-1] == 64


def test_chosen_length_really_maximises_the_rate():
    for alpha in (0.4, 0.7, 0.9):
        best = best_length(alpha, 64, CPU)
        rates = [expected_tokens(alpha, n) / CPU.seconds(n) for n in range(1, 65)]
        rate_best = expected_tokens(alpha, best) / CPU.seconds(best) if best else 1 / CPU.seconds(0)
        assert rate_best >= max(rates) - 1e-12


def test_acceptance_estimate_moves_with_evidence():
    acc = Acceptance(prior=0.5)
    for _ in range(10):
        acc.update(8, 8)
    assert acc.alpha > 0.9
    for _ in range(40):
        acc.update(8, 0)
    assert acc.alpha < 0.2


def test_merge_chains_shares_prefixes_and_respects_budget():
    ids, parents, sources = merge_chains([([1, 2, 3], "a"), ([1, 2, 4], "b"), ([5], "c")], max_nodes=4)
    assert ids == [1, 2, 3, 4] and parents == [-1, 0, 1, 1] and sources == ["a", "a", "a", "b"]


def test_trim_and_first_path():
    tree = Draft((1, 2, 3, 4, 5), (-1, 0, 1, 0, -1), "m")
    assert trim_to_depth(tree, 2) == Draft((1, 2, 4, 5), (-1, 0, 0, -1), "m")
    assert first_path(tree) == Draft.chain([1, 2, 3], "m")


class FixedDrafter:
    def __init__(self, name, tokens):
        self.name, self.tokens = name, tokens

    def begin(self, context):
        pass

    def propose(self, context, *, max_tokens):
        return Draft.chain(self.tokens[:max_tokens], self.name)

    def observe(self, context, draft, verdict):
        pass

    def end(self, context):
        pass


def test_chain_stops_drafting_a_source_that_is_always_wrong():
    chain = DrafterChain([FixedDrafter("prompt_lookup", list(range(10, 40)))], cost=CPU)
    ctx = DraftContext(tokens=[1, 2], prompt_len=2)
    chain.begin(ctx)
    sizes = []
    for _ in range(30):
        draft = chain.propose(ctx, max_tokens=30)
        sizes.append(draft.num_nodes)
        chain.observe(ctx, draft, Verdict((), (), 0))
    assert sizes[0] > 0 and sizes[-1] == 0


def test_chain_prefers_the_reliable_source():
    chain = DrafterChain([FixedDrafter("suffix", [1] * 30), FixedDrafter("memory", [2] * 30)], cost=CPU)
    ctx = DraftContext(tokens=[1, 2], prompt_len=2)
    for _ in range(5):
        chain.acceptance[AcceptanceKey("suffix")].update(8, 0)
        chain.acceptance[AcceptanceKey("memory")].update(8, 8)
    assert chain.propose(ctx, max_tokens=30).source == "memory"


class CountingDrafter(FixedDrafter):
    def __init__(self, name, tokens):
        super().__init__(name, tokens)
        self.asked = 0

    def propose(self, context, *, max_tokens):
        self.asked += 1
        return super().propose(context, max_tokens=max_tokens)


def test_a_costly_drafter_is_not_asked_when_a_cheap_draft_is_as_good():
    lookup = CountingDrafter("prompt_lookup", [3] * 30)
    model = CountingDrafter("model", [4] * 30)
    chain = DrafterChain([lookup, model], cost=CPU)
    ctx = DraftContext(tokens=[1, 2], prompt_len=2)
    for _ in range(5):
        chain.acceptance[AcceptanceKey("prompt_lookup")].update(8, 8)
    chain.propose_seconds["model"] = 0.5  # as measured: a draft-model pass costs 0.5 s
    assert chain.propose(ctx, max_tokens=30).source == "prompt_lookup"
    assert lookup.asked == 1 and model.asked == 0
    # Its own time counts against it even when it is the only source.
    alone = DrafterChain([model], cost=CPU)
    alone.propose_seconds["model"] = 0.5
    assert alone.propose(ctx, max_tokens=30).num_nodes == 0 and model.asked == 0
    # A fresh chain asks it once, to measure it.
    fresh = DrafterChain([model], cost=CPU)
    assert fresh.propose(ctx, max_tokens=30).num_nodes > 0 and model.asked == 1
    assert fresh.propose_seconds["model"] > 0


def test_max_depth_bounds_every_draft():
    chain = DrafterChain([FixedDrafter("memory", list(range(10, 60)))], cost=CPU, max_depth=5)
    for _ in range(5):
        chain.acceptance[AcceptanceKey("memory")].update(8, 8)
    assert chain.propose(DraftContext(tokens=[1, 2], prompt_len=2), max_tokens=40).num_nodes == 5
    with pytest.raises(ValueError, match="max_depth"):
        DrafterChain([], max_depth=0)


def test_node_probabilities_rank_siblings_and_reduce_to_a_chain():
    from agentspec.drafters.policy import node_probabilities

    assert node_probabilities([-1, 0, 1], 0.5) == pytest.approx([0.5, 0.25, 0.125])
    # root children: best candidate 0.6, the alternative 0.6 * 0.4; a child of the alternative
    probs = node_probabilities([-1, -1, 1], 0.6)
    assert probs == pytest.approx([0.6, 0.24, 0.144])
    assert sum(probs[:2]) <= 1.0


def test_best_subtree_keeps_probable_nodes_and_matches_best_length_on_chains():
    from agentspec.drafters.policy import best_subtree

    for alpha in (0.3, 0.6, 0.9):
        keep, _ = best_subtree(list(range(-1, 39)), alpha, CPU)
        assert keep == list(range(best_length(alpha, 40, CPU)))
    # A tree: two strong candidates at the root, long tails; the kept set is a subtree.
    parents = [-1, 0, 1, 2, -1, 4, 5, 6]
    keep, rate = best_subtree(parents, 0.5, CPU)
    assert keep and all(parents[i] < 0 or parents[i] in keep for i in keep)
    assert rate > 1 / CPU.seconds(0)
    assert best_subtree(parents, 0.01, CPU)[0] == []  # nothing pays


def test_alternatives_tried_counts_where_the_first_branch_failed():
    from agentspec.drafters.chain import alternatives_tried

    parents = (-1, 0, -1, 2, 0)  # root: 0 (first), 2 (alternative); node 0: 1 (first), 4 (alt)
    assert alternatives_tried(parents, (0, 1)) == (0, 0)  # first branches all the way
    assert alternatives_tried(parents, (2, 3)) == (1, 1)  # the root's alternative was right
    assert alternatives_tried(parents, (0, 4)) == (1, 1)
    assert alternatives_tried(parents, ()) == (1, 0)  # all root branches wrong
    assert alternatives_tried((-1, 0), ()) == (0, 0)  # a chain has no alternatives


def test_trees_shrink_to_chains_when_alternatives_are_never_right():
    from agentspec.drafters.policy import node_probabilities

    tree = [FixedDrafter("memory", [])]
    chain = DrafterChain(tree, cost=CPU)
    two = Draft((5, 6, 7, 8, 9, 10), (-1, 0, 1, -1, 3, 4), "memory")
    tree[0].propose = lambda context, *, max_tokens: two
    ctx = DraftContext(tokens=[1], prompt_len=1)
    chain.acceptance[AcceptanceKey("memory")] = Acceptance(0.6)
    assert chain.propose(ctx, max_tokens=8).num_nodes > 3  # the alternative is worth a try
    for _ in range(30):  # alternatives tried and always wrong
        chain.observe(ctx, two, Verdict((), (), 0))
    chain.acceptance[AcceptanceKey("memory")] = Acceptance(0.6)
    assert chain.propose(ctx, max_tokens=8).token_ids == (5, 6, 7)  # the first branch only
    assert node_probabilities([-1, -1], 0.6, 0.0) == pytest.approx([0.6, 0.0])


def test_first_proposal_of_a_request_is_not_timed_and_skipped_drafters_are_probed_again():
    import time as _time

    class SlowFirst(CountingDrafter):
        def propose(self, context, *, max_tokens):
            if self.asked == 0:
                _time.sleep(0.3)  # lazy per-request work, e.g. indexing the prompt
            return super().propose(context, max_tokens=max_tokens)

    lookup = SlowFirst("prompt_lookup", [3] * 30)
    chain = DrafterChain([lookup], cost=CPU)
    ctx = DraftContext(tokens=[1, 2], prompt_len=2)
    chain.begin(ctx)
    chain.propose(ctx, max_tokens=30)
    assert chain.propose_seconds["prompt_lookup"] < 0.01  # the slow first call did not count
    # An inflated estimate makes it skipped; it is probed again once the skipped steps took
    # PROBE_RATIO times that estimate, and the fast re-measurement replaces it.
    chain.propose_seconds["prompt_lookup"] = 0.2
    asked = lookup.asked
    chain.propose(ctx, max_tokens=30)
    assert lookup.asked == asked  # skipped
    skipped = 1
    while lookup.asked == asked and skipped < 1000:
        chain.propose(ctx, max_tokens=30)
        skipped += 1
    assert skipped == pytest.approx(30 * 0.2 / CPU.seconds(0), abs=2)
    assert chain.propose_seconds["prompt_lookup"] < 0.01  # the fast re-measurement replaced it


def test_a_drafter_can_name_a_finer_acceptance_class():
    class Keyed(FixedDrafter):
        def propose(self, context, *, max_tokens):
            return replace(super().propose(context, max_tokens=max_tokens), acceptance="memory/follow")

    chain = DrafterChain([Keyed("memory", list(range(10, 60)))], cost=CPU)
    ctx = DraftContext(tokens=[1, 2], prompt_len=2)
    plain = DrafterChain([FixedDrafter("memory", list(range(10, 60)))], cost=CPU)
    # The class's prior (0.97) drafts deeper than the source's (0.85).
    assert chain.propose(ctx, max_tokens=50).num_nodes > plain.propose(ctx, max_tokens=50).num_nodes
    draft = chain.propose(ctx, max_tokens=50)
    chain.observe(ctx, draft, Verdict((), (), 0))  # a miss is booked on the class, not the source
    assert chain.acceptance[AcceptanceKey("memory/follow")].alpha < 0.97
    assert chain.acceptance[AcceptanceKey("memory")].alpha == pytest.approx(0.85)


class ScriptedDrafter(FixedDrafter):
    """Proposes the next ``right`` tokens of ``truth`` after the context, then wrong ones."""

    def __init__(self, name, truth, right):
        super().__init__(name, [])
        self.truth, self.right = truth, right

    def propose(self, context, *, max_tokens):
        done = len(context.tokens) - context.prompt_len
        good = self.truth[done : done + self.right]
        return Draft.chain([*good, *[999] * (max_tokens - len(good))][:max_tokens], self.name)


def _run(chain, truth, steps, ctx=None):
    """Greedy steps against a known output: the path is the spine's match with ``truth``.
    ``ctx``: the request (default an empty one); the steps' sources come back."""
    ctx = ctx or DraftContext(tokens=[1], prompt_len=1)
    chain.begin(ctx)
    sources = []
    for _ in range(steps):
        done = len(ctx.tokens) - ctx.prompt_len
        draft = chain.propose(ctx, max_tokens=30)
        n = 0
        while n < draft.num_nodes and draft.token_ids[n] == truth[done + n]:
            n += 1
        verdict = Verdict(tuple(range(n)), tuple(truth[done : done + n]), truth[done + n])
        ctx.tokens.extend(verdict.new_tokens)
        sources.append(draft.source if draft.num_nodes else "")
        chain.observe(ctx, draft, verdict)
    return sources


def test_a_source_never_chosen_still_learns_from_what_the_steps_commit():
    # The memory (higher prior) is right for 2 tokens then wrong: ~0.67 per token, which a
    # chain learning only from its choice keeps above prompt lookup's untouched prior (0.5),
    # so prompt lookup, right every time, would never be tried.
    truth = list(range(100, 2000))
    chain = DrafterChain([ScriptedDrafter("memory", truth, 2),
                          ScriptedDrafter("prompt_lookup", truth, 30)], cost=CPU)
    sources = _run(chain, truth, 20)
    assert sources[0] == "memory"
    assert sources[-5:] == ["prompt_lookup"] * 5
    lookup, memory = chain.acceptance[AcceptanceKey("prompt_lookup")], chain.acceptance[AcceptanceKey("memory")]
    assert lookup.alpha > 0.9 > memory.alpha


def test_a_prefix_that_reaches_past_the_committed_tokens_is_no_rejection():
    chain = DrafterChain([FixedDrafter("suffix", [5, 6, 7, 8])], cost=CPU)
    ctx = DraftContext(tokens=[1], prompt_len=1)
    draft = chain.propose(ctx, max_tokens=4)
    before = chain.acceptance[AcceptanceKey("suffix")].misses
    chain.observe(ctx, draft, Verdict((0,), (5,), 6))  # 2 of 4 matched, the rest unseen
    assert chain.acceptance[AcceptanceKey("suffix")].misses == pytest.approx(0.9 * before)
    draft = chain.propose(ctx, max_tokens=4)
    chain.observe(ctx, draft, Verdict((0,), (5,), 9))  # rejected at the second token
    assert chain.acceptance[AcceptanceKey("suffix")].misses == pytest.approx(0.81 * before + 1)


def _random_tree(rng, nodes):
    """Parents of a random tree, each node after its parent."""
    return [rng.randrange(-1, i) for i in range(nodes)]


def _chain_bound(alpha, cost, spent, *, max_depth, alternative=None, max_nodes=64):
    """A deliberately wrong bound: the best chain, blind to a tree's alternatives."""
    length = best_length(alpha, max_depth, cost, spent)
    return expected_tokens(alpha, length) / (cost.seconds(length) + spent)


@pytest.mark.parametrize("bound_name", ["best_tree_rate", "chain_only"])
def test_the_skip_bound_is_above_every_draft_a_source_could_make(bound_name):
    import random

    from agentspec.drafters.policy import best_subtree, best_tree_rate

    bound = best_tree_rate if bound_name == "best_tree_rate" else _chain_bound
    rng = random.Random(7)
    violated = 0
    for _ in range(300):
        alpha, beta = rng.uniform(0.05, 0.99), rng.uniform(0.0, 0.9)
        spent = rng.choice([0.0, 0.001, 0.01])
        parents = _random_tree(rng, rng.randint(1, 40))
        depth = max(depths_of(parents))
        _, rate = best_subtree(parents, alpha, CPU, spent, beta)
        if rate > bound(alpha, CPU, spent, max_depth=depth, alternative=beta) * (1 + 1e-9):
            violated += 1
    if bound_name == "best_tree_rate":
        assert violated == 0
        # Without alternatives it is the best chain's rate.
        for alpha in (0.3, 0.6, 0.9):
            assert best_tree_rate(alpha, CPU, 0.002, max_depth=30, alternative=0.0) == \
                pytest.approx(_chain_bound(alpha, CPU, 0.002, max_depth=30))
    else:  # a chain's bound is beaten by trees: it would skip a source that could win
        assert violated > 10


def depths_of(parents):
    out = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def test_a_cheap_tree_source_that_cannot_win_is_asked_rarely_and_a_free_one_every_step(monkeypatch):
    import agentspec.drafters.chain as chain_module

    now = [0.0]
    monkeypatch.setattr(chain_module.time, "perf_counter", lambda: now[0])

    class Timed(CountingDrafter):  # takes ``seconds`` of the fake clock to propose
        def __init__(self, name, tokens, seconds):
            super().__init__(name, tokens)
            self.seconds = seconds

        def propose(self, context, *, max_tokens):
            now[0] += self.seconds
            return super().propose(context, max_tokens=max_tokens)

    # Lookups take ~0.1 ms; a head's beam search a few ms, under a tenth of a forward here.
    memory = Timed("memory", list(range(10, 40)), 1e-4)
    lookup = Timed("prompt_lookup", [3] * 30, 1e-4)
    head = Timed("head", [4] * 30, 0.005)
    chain = DrafterChain([memory, lookup, head], cost=CPU)
    ctx = DraftContext(tokens=[1, 2], prompt_len=2)
    chain.acceptance[AcceptanceKey("memory")] = Acceptance(0.99, strength=1000)
    steps = 300
    for _ in range(steps):
        assert chain.propose(ctx, max_tokens=30).source == "memory"
    assert lookup.asked == steps  # below 1/PROBE_RATIO of a forward: always asked
    # The head is asked again each time the skipped steps cost PROBE_RATIO times its own
    # time: one step in three here, where it was asked every step before.
    cycle = math.ceil(30 * 0.005 / CPU.seconds(0))
    assert cycle == 3 and head.asked == math.ceil(steps / cycle)
    # Where it could win, it is asked every step.
    chain.acceptance[AcceptanceKey("memory")] = Acceptance(0.05, strength=1000)
    chain.acceptance[AcceptanceKey("head")] = Acceptance(0.9, strength=1000)
    asked = head.asked
    for _ in range(10):
        chain.propose(ctx, max_tokens=30)
    assert head.asked == asked + 10


def test_node_probabilities_take_a_rate_per_node():
    from agentspec.drafters.policy import best_subtree, node_probabilities

    assert node_probabilities([-1, 0, 1], [0.9, 0.5, 0.8]) == pytest.approx([0.9, 0.45, 0.36])
    # An alternative is tried where its first sibling failed, at that sibling's rate.
    assert node_probabilities([-1, -1], [0.75, 0.1], 0.5) == pytest.approx([0.75, 0.125])
    # One rate for every node is the single-rate tree.
    parents = [-1, 0, 0, 1, -1]
    assert node_probabilities(parents, [0.7] * 5, 0.3) == pytest.approx(
        node_probabilities(parents, 0.7, 0.3))
    with pytest.raises(ValueError, match="2 acceptance rates for 3 nodes"):
        node_probabilities([-1, 0, 1], [0.5, 0.5])
    # A node that is likely wrong ends the draft before it; one rate drafts past it.
    keep, _ = best_subtree([-1, 0, 1, 2, 3, 4, 5], [0.99, 0.99, 0.99, 0.05, 0.99, 0.99, 0.99], CPU)
    assert len(keep) <= 4 < len(best_subtree([-1, 0, 1, 2, 3, 4, 5], 0.95, CPU)[0])


def test_a_refined_class_starts_at_its_coarser_rate_and_learns_its_own():
    refined = Acceptance.refining()
    assert refined.alpha_over(0.8) == pytest.approx(0.8)
    assert refined.alpha_over(0.3) == pytest.approx(0.3)  # follows its coarser class
    refined.add(0, 3)
    assert refined.alpha_over(0.8) == pytest.approx(3.2 / 7)  # (0 + 4 * 0.8) / (3 + 4)
    refined.add(20, 0)
    assert refined.alpha_over(0.3) > 0.75  # its own evidence outweighs the prior


class PairedDrafter(FixedDrafter):
    """Copies the truth for ``right`` tokens; the next one, the copy's own, is never right and
    never follows the token before it anywhere in the context (an argument value from another
    request)."""

    def __init__(self, truth, right):
        super().__init__("memory", [])
        self.truth, self.right = truth, right

    def propose(self, context, *, max_tokens):
        done = len(context.tokens) - context.prompt_len
        good = self.truth[done : done + self.right]
        return Draft.chain([*good, 900 + done, *self.truth[done + self.right + 1 :]][:max_tokens],
                           self.name)


def test_the_chain_learns_that_copies_break_at_a_pair_the_context_never_showed():
    # The context repeats the output's text, so every right token follows its parent there.
    truth = [10 + i % 40 for i in range(400)]
    chain = DrafterChain([PairedDrafter(truth, 3)], cost=CPU)
    ctx = DraftContext(tokens=[1, *truth[:80]], prompt_len=81)
    _run(chain, truth, 25, ctx)
    memory = AcceptanceKey("memory")
    seen, new = AcceptanceKey("memory", seen=True), AcceptanceKey("memory", seen=False)
    assert chain.rate(seen) > 0.9 > 0.25 > chain.rate(new)
    assert chain.rate(new) < chain.rate(memory) < chain.rate(seen)
    # Sized by its nodes' own classes the draft stops at the unseen pair (or just after it,
    # where that node costs nothing more): one rate for every node would draft on past it.
    assert chain.propose(ctx, max_tokens=30).num_nodes <= 4
    from agentspec.drafters.policy import best_subtree

    assert len(best_subtree([-1, *range(29)], chain.rate(AcceptanceKey("memory")), CPU)[0]) > 4


def test_each_step_books_its_nodes_on_their_classes_and_the_classes_they_refine():
    chain = DrafterChain([FixedDrafter("memory", [2, 3, 9, 9])], cost=CPU)
    ctx = DraftContext(tokens=[1, 2, 3, 1], prompt_len=4)  # holds the pairs 1-2 and 2-3
    draft = chain.propose(ctx, max_tokens=4)
    memory = AcceptanceKey("memory")
    seen, new = AcceptanceKey("memory", seen=True), AcceptanceKey("memory", seen=False)
    coarse = chain.acceptance[memory].hits, chain.acceptance[memory].misses
    chain.observe(ctx, draft, Verdict((0, 1), (2, 3), 5))  # 2 and 3 accepted, 9 rejected
    assert (chain.acceptance[seen].hits, chain.acceptance[seen].misses) == (2, 0)
    assert (chain.acceptance[new].hits, chain.acceptance[new].misses) == (0, 1)
    assert chain.acceptance[memory].hits == pytest.approx(0.9 * coarse[0] + 2)
    assert chain.acceptance[memory].misses == pytest.approx(0.9 * coarse[1] + 1)


class BackedDrafter(FixedDrafter):
    """Copies the truth for ``right`` tokens that four of its candidates back; the next token,
    which one candidate alone holds, is never right. Every pair it drafts is one the context
    shows, so only the support tells the wrong token apart. ``support=False``: the same draft
    without its counts (a chain that cannot see them)."""

    def __init__(self, truth, right, support=True):
        super().__init__("memory", [])
        self.truth, self.right, self.support = truth, right, support

    def propose(self, context, *, max_tokens):
        done = len(context.tokens) - context.prompt_len
        tokens = [*self.truth[done : done + self.right], 5, *self.truth[done + self.right + 1 :]]
        tokens = tokens[:max_tokens]
        support = tuple(4 if i < self.right else 1 for i in range(len(tokens)))
        return Draft.chain(tokens, self.name, support=support if self.support else None)


@pytest.mark.parametrize("support", [True, False])
def test_the_chain_learns_that_a_token_one_candidate_alone_holds_is_a_weaker_bet(support):
    truth = [10 + i % 40 for i in range(400)]
    # The prompt shows every pair: the truth's, and 5 after and before each of its tokens.
    prompt = [1, *truth[:80], *[x for t in range(10, 50) for x in (t, 5)]]
    chain = DrafterChain([BackedDrafter(truth, 3, support)], cost=CPU)
    ctx = DraftContext(tokens=prompt, prompt_len=len(prompt))
    _run(chain, truth, 25, ctx)
    size = chain.propose(ctx, max_tokens=30).num_nodes
    if support:
        four, one = (AcceptanceKey("memory", seen=True, support=s) for s in ("s4", "s1"))
        assert chain.rate(four) > 0.9 > 0.25 > chain.rate(one)
        assert size <= 4  # stops at (or just past) the token one candidate holds
    else:  # the deliberately blind chain: one rate for every seen node drafts on past it
        assert AcceptanceKey("memory", seen=True, support="s1") not in chain.acceptance
        assert size > 4
