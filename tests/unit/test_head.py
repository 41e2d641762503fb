"""The recurrent draft head: beam search, the merged tree, files, the target's hidden rows,
and distillation on a tiny random model (no hub)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from agentspec.drafters.head import (
    HeadDrafter,
    beam_search,
    head_path,
    load_head,
    merge_beams,
    read_meta,
    save_head,
)
from agentspec.drafters.head_train import (
    TrainConfig,
    acceptance_by_depth,
    replay,
    split_held_out,
    train_head,
    vocabulary,
)
from agentspec.engine.target import HFTarget
from agentspec.protocols import DraftContext
from agentspec.types import Draft, Record
from tests.solo import solo
from tests.tiny_model import (
    OPENING_A,
    OPENING_B,
    V,
    cycle_records,
    random_head,
    tiny_target,
    turn_records,
)


@pytest.fixture(scope="module")
def target() -> HFTarget:
    return tiny_target()


def test_merge_beams_puts_the_best_beam_on_the_spine():
    tree = merge_beams([[5, 6, 7], [5, 6, 8], [5, 9, 7], [4, 6, 7]],
                       [[0.5, 0.5, 0.5]] * 4)
    assert tree.token_ids == (5, 6, 7, 8, 9, 7, 4, 6, 7)
    assert tree.parents == (-1, 0, 1, 1, 0, 4, -1, 6, 7)
    assert tree.spine == 3
    draft = Draft(tree.token_ids, tree.parents, "head")  # valid: parents before children
    assert draft.num_nodes == 9


def test_beam_search_finds_the_most_probable_sequences(target):
    head = random_head(target, list(range(V)))
    h = torch.randn(16)
    tree = beam_search(head, h, 3, width=V * V, depth=2)  # wide enough to be exhaustive
    # The spine is the argmax over all V^2 sequences of log q(a) + log q(b | a).
    best, best_score = None, -float("inf")
    with torch.no_grad():
        s1, l1 = head.step(torch.zeros(1, 16), torch.tensor([3]), h[None])
        lq1 = torch.log_softmax(l1, -1)[0]
        for a, b in itertools.product(range(V), repeat=2):
            _, l2 = head.step(s1, torch.tensor([a]), h[None])
            score = float(lq1[a] + torch.log_softmax(l2, -1)[0, b])
            if score > best_score:
                best, best_score = (a, b), score
    assert tree.token_ids[: tree.spine] == best
    narrow = beam_search(head, h, 3, width=1, depth=4)
    assert narrow.spine == 4 and len(narrow.token_ids) == 4  # width 1: greedy chain
    assert all(0 < q <= 1 for q in narrow.q)


def test_head_file_round_trip_and_fingerprint(target, tmp_path):
    head = random_head(target, [1, 4, 7])
    path = head_path(target.fingerprint, "tenant/a b", tmp_path)
    assert path.parent.parent == tmp_path / "heads" and "/" not in path.name
    save_head(path, head, {"fingerprint": target.fingerprint, "stats": {"records": 3}})
    assert read_meta(path)["stats"] == {"records": 3}
    loaded = load_head(path, target.model, fingerprint=target.fingerprint)
    assert loaded is not None and loaded.vocab.tolist() == [1, 4, 7]
    h = torch.randn(16)
    assert beam_search(loaded, h, 2, width=3, depth=3) == beam_search(head, h, 2, width=3, depth=3)
    assert load_head(path, target.model, fingerprint="other:123") is None  # another model
    path.write_bytes(b"not a safetensors file")
    assert load_head(path, target.model) is None


def test_score_keeps_the_hidden_rows_the_logits_come_from(target):
    draft = Draft.chain([2, 3, 4], "t")
    solo(target).start([1, 5, 6, 7])
    plain = solo(target).score(7, draft).clone()
    assert solo(target).hidden is None
    twin = target.fork()
    solo(twin).start([1, 5, 6, 7])
    logits = solo(twin).score(7, draft, keep_hidden=True)
    assert torch.equal(logits, plain)  # reading the hidden rows changes no logit
    assert solo(twin).hidden is not None and solo(twin).hidden.shape == (4, 16)
    assert solo(twin).hidden_position == 3  # the root (7) sits at position 3
    with torch.no_grad():
        w = target.model.get_output_embeddings().weight
        assert torch.allclose(solo(twin).hidden @ w.T, logits[:4], atol=1e-5)


def test_hidden_rows_stay_the_targets_own_when_a_fork_runs_in_another_thread(target):
    """The output embedding is shared by every fork: another thread's forward through it,
    after this target's forward and before its read of the rows, must not hand this target
    the other's rows (the hook kept any forward's input before)."""
    import threading

    draft = Draft.chain([2, 3, 4], "t")
    twin, other = target.fork(), target.fork()
    solo(other).start([1, 9, 9, 9, 9, 8])
    solo(twin).start([1, 5, 6, 7])
    solo(twin).score(7, draft, keep_hidden=True)
    own = solo(twin).hidden.clone()
    forward = twin.forward._modules

    workers: list[threading.Thread] = []

    def then_another(*args: object, **kwargs: object) -> torch.Tensor:
        out = forward(*args, **kwargs)
        # Another fork's forward from another thread, before this one's rows are read (on the
        # CPU it queues for the torch thread this forward runs on: it cannot be joined here).
        worker = threading.Thread(target=lambda: solo(other).score(8, Draft.chain([2], "t"),
                                                             keep_hidden=True))
        worker.start()
        workers.append(worker)
        return out

    twin.forward._modules = then_another  # type: ignore[method-assign]
    solo(twin).start([1, 5, 6, 7])
    solo(twin).score(7, draft, keep_hidden=True)
    for worker in workers:
        worker.join()
    assert workers and torch.equal(solo(twin).hidden, own)


def test_forks_in_two_threads_take_turns_forward_by_forward(target):
    """Forks share the model whose kernels each engine forward swaps in and out. A fork's
    forward started in another thread while this one's runs must wait for it: run inside it,
    its exit took the kernels from under this forward (AttributeError), or mixed them."""
    import threading

    draft = Draft.chain([2, 3, 4], "t")
    first, second = target.fork(), target.fork()
    solo(first).start([1, 5, 6, 7])
    solo(second).start([1, 9, 9, 8])
    alone = (solo(first).score(7, draft).clone(), solo(second).score(8, draft).clone())
    got: list[torch.Tensor] = []
    started: list[threading.Thread] = []
    waiting: list[bool] = []

    def meanwhile(module: object, args: object, output: object) -> None:
        if not started:  # once, inside the first fork's forward
            worker = threading.Thread(target=lambda: got.append(solo(second).score(8, draft).clone()))
            started.append(worker)
            worker.start()
            worker.join(timeout=0.5)  # it cannot finish while this forward holds the model
            waiting.append(worker.is_alive())  # read here: once this forward ends it may run

    hook = target.model.model.layers[0].register_forward_hook(meanwhile)
    try:
        solo(first).start([1, 5, 6, 7])
        mine = solo(first).score(7, draft).clone()
    finally:
        hook.remove()
    assert waiting == [True]  # it waited: nothing came back during the first forward
    started[0].join()
    assert torch.equal(mine, alone[0]) and torch.equal(got[0], alone[1])


def test_drafter_is_absent_without_a_head_and_drafts_with_one(target, tmp_path):
    twin = target.fork()
    none = HeadDrafter(twin, home=tmp_path)
    ctx = DraftContext(tokens=[1, 5, 6, 7], prompt_len=4, scope="s")
    none.begin(ctx)
    assert none.propose(ctx, max_tokens=5).num_nodes == 0  # no head file: absent
    drafter = HeadDrafter(twin, {"s": random_head(target, list(range(V)))}, width=3, depth=4)
    drafter.begin(ctx)
    assert drafter.propose(ctx, max_tokens=5).num_nodes == 0  # no hidden row yet
    solo(twin).start(ctx.tokens)
    from agentspec.types import Verdict

    draft = Draft.chain([2, 3], "t")
    assert drafter.wants_hidden  # the drafter asks the loop for the hidden rows
    solo(twin).score(7, draft, keep_hidden=True)
    ctx.hidden, ctx.hidden_position = solo(twin).hidden, solo(twin).hidden_position  # as the loop hands them
    verdict = Verdict((0,), (2,), 9)  # node 0 accepted, 9 recovered: the hidden row is row 1
    solo(twin).commit(draft, verdict)
    ctx.tokens.extend([2, 9])
    drafter.observe(ctx, draft, verdict)
    assert torch.equal(drafter._state(ctx).h, solo(twin).hidden[1].float())
    out = drafter.propose(ctx, max_tokens=5)
    assert out.is_chain and out.num_nodes == 4 and out.source == "head"
    assert drafter.propose(ctx, max_tokens=2).num_nodes == 2
    branching = HeadDrafter(twin, {"s": drafter.head_for("s")}, width=3, depth=4, branches=True)
    branching._state(ctx).h, branching._state(ctx).position = drafter._state(ctx).h, 4
    tree = branching.propose(ctx, max_tokens=5)
    assert tree.token_ids[:4] == out.token_ids and tree.num_nodes > 4


def test_replay_gives_the_full_forwards_hidden_rows_and_restricted_distributions(target):
    """Replays reuse the shared prefix's KV and score only the head's vocabulary rows; each
    record's rows must still be a whole forward's, its distributions the full logits'
    restricted to the vocabulary and renormalised. A replay over the wrong rows fails."""
    records = cycle_records(6)
    vocab = vocabulary(records, target.tokenizer)
    data = replay(target.model, target.tokenizer, records, vocab)
    assert len(data) == 6
    for record, item in zip(records, data, strict=True):
        ids = [int(t) for t in record.request_text.split()] + list(record.completion_ids)
        with torch.no_grad():
            full = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        n_prompt = len(ids) - len(record.completion_ids)
        hidden = full.hidden_states[-1][0, n_prompt - 2 : -1]
        logp = torch.log_softmax(full.logits[0, n_prompt - 1 :, vocab].float(), dim=-1)
        assert item.tokens.tolist() == ids[n_prompt - 1 :]
        torch.testing.assert_close(item.hidden, hidden.float(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(item.logp.float(), logp, atol=2e-3, rtol=2e-3)
        wrong = torch.log_softmax(full.logits[0, n_prompt - 1 :, vocab.flip(0)].float(), -1)
        assert not torch.allclose(item.logp.float(), wrong, atol=2e-3)


def test_replay_runs_interleaved_conversations_once_per_distinct_prefix(target):
    """Two conversations whose turns interleave in the store (A1 B1 A2 B2 A3): replayed in
    the store's order each turn shares only the opening with the turn before and runs its
    whole history again; sorted by tokens, a turn continues its own conversation's KV. The
    tokens run must be the prefix trie's (the sorted order's), fewer than the store order's,
    and each record's rows still its own whole forward's."""
    a, b = OPENING_A, OPENING_B
    turns = [a, b, a + [6, 3, 4, 5, 6, 3], b + [6, 3, 4, 5, 3, 4], a + [6, 3, 4, 5, 6, 3, 6, 5, 4]]
    records = turn_records(turns)
    vocab = vocabulary(records, target.tokenizer)
    ran: list[int] = []
    hook = target.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: ran.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        data = replay(target.model, target.tokenizer, records, vocab)
    finally:
        hook.remove()

    def run_tokens(order: list[list[int]]) -> int:
        total, held = 0, []
        for p in order:
            ids = p + [3, 4, 5, 6]
            shared = 0
            while shared < min(len(held), len(p) - 2) and held[shared] == ids[shared]:
                shared += 1
            total, held = total + len(ids) - shared, ids
        return total

    assert sum(ran) == run_tokens(sorted(turns)) < run_tokens(turns)
    assert [d.tokens.tolist() for d in data] == [[p[-1], 3, 4, 5, 6] for p in turns]
    for p, item in zip(turns, data, strict=True):
        with torch.no_grad():
            full = target.model(input_ids=torch.tensor([p + [3, 4, 5, 6]]), output_hidden_states=True)
        torch.testing.assert_close(item.hidden, full.hidden_states[-1][0, len(p) - 2 : -1].float(),
                                   atol=1e-4, rtol=1e-4)


def test_training_distils_the_target_and_beats_an_untrained_head(target, tmp_path):
    records = cycle_records(20)
    ticks: list[str] = []
    config = TrainConfig(depth=3, epochs=30, batch_starts=64, held_out=0.2, lr=1e-2)
    result = train_head(target.model, target.tokenizer, records, config=config,
                        progress=lambda done, total, label: ticks.append(label))
    stats = result.stats
    assert stats["records"] == 20 and stats["held_out_records"] == 4
    assert stats["vocab"] == 5  # 3, 4, 5, 6 and the eos id
    assert len(stats["held_out_acceptance"]["rate"]) == 3
    assert any("replaying" in t for t in ticks) and any("distilling" in t for t in ticks)
    json.dumps(stats)  # stored as file metadata
    untrained = train_head(target.model, target.tokenizer, records,
                           config=TrainConfig(depth=3, epochs=1, batch_starts=64, held_out=0.2,
                                              lr=1e-9)).stats
    assert stats["final_kl"] < untrained["final_kl"] / 2
    assert (stats["held_out_acceptance"]["mean_accepted"]
            >= untrained["held_out_acceptance"]["mean_accepted"])
    # Retraining starts from the old weights, keeps the old vocabulary first, and replays
    # only records it has not seen.
    replayed: dict = {}
    again = train_head(target.model, target.tokenizer, records[:5], init=result.head,
                       config=TrainConfig(depth=3, epochs=1, held_out=0.0), replayed=replayed)
    assert again.head.vocab.tolist()[:5] == result.head.vocab.tolist()
    assert sorted(replayed) == [1, 2, 3, 4, 5]
    seen = replayed[1]
    train_head(target.model, target.tokenizer, records[:6], init=again.head,
               config=TrainConfig(depth=3, epochs=1, held_out=0.0), replayed=replayed)
    assert replayed[1] is seen and sorted(replayed) == [1, 2, 3, 4, 5, 6]


def test_speculator_adds_the_head_only_where_one_is_trained(target, tmp_path, monkeypatch):
    from agentspec import SpecConfig, Speculator
    from agentspec.drafters.policy import CostModel

    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    cost = CostModel(base=0.05, per_token=0.001)

    def names(**kw):
        return [d.name for d in Speculator(target.fork(), cost=cost, **kw).drafters]

    assert "head" not in names()
    save_head(head_path(target.fingerprint, "s"), random_head(target, [1, 2]),
              {"fingerprint": target.fingerprint})
    assert "head" in names()
    assert "head" not in names(config=SpecConfig(draft_head=False))


def test_held_out_records_share_no_completion_with_the_training_records():
    """An agent repeats itself under other requests; a record-level split puts copies on both
    sides (shown for this seed) and measures the head on what it was trained on."""
    records = [Record(scope="s", model="m", request_text=f"r{i}", key_text=f"r{i}",
                      completion_text="", completion_ids=(3, 4, i % 10), id=i + 1)
               for i in range(30)]
    train, held = split_held_out(records, 0.2, random.Random(0))
    assert len(train) + len(held) == 30 and len(held) >= 6
    assert not {r.completion_ids for r in train} & {r.completion_ids for r in held}
    naive = set(random.Random(0).sample(range(30), 6))
    assert {records[i].completion_ids for i in naive} & {
        r.completion_ids for i, r in enumerate(records) if i not in naive}
    same = records[0::10]  # one completion thrice: nothing can be held out
    assert split_held_out(same, 0.5, random.Random(0)) == (same, [])
    assert split_held_out(records, 0.0, random.Random(0)) == (records, [])


def test_held_out_acceptance_is_against_the_targets_own_greedy_tokens(target):
    """A head that can only draft one token is accepted only where the target's greedy token
    over its whole vocabulary is that token; the argmax over the head's own vocabulary (the
    measure before) would accept it everywhere."""
    records = cycle_records(4)
    data = replay(target.model, target.tokenizer, records, vocabulary(records, target.tokenizer))
    with torch.no_grad():
        greedy = {t for d in data
                  for t in (d.hidden[1:] @ target.model.lm_head.weight.T).argmax(-1).tolist()}
    never = next(t for t in range(V) if t not in greedy)
    head = random_head(target, [never])
    acc = acceptance_by_depth(head, data, width=1, depth=3)
    assert acc["steps"] > 0 and acc["mean_accepted"] == 0.0
    always = random_head(target, [next(iter(greedy))])
    assert acceptance_by_depth(always, data, width=1, depth=3)["rate"][0] > 0.0
    # The old measure compared the beam with the argmax over the head's vocabulary, which a
    # one-token vocabulary always "agrees" with: it would have called this head perfect.
    only = replay(target.model, target.tokenizer, records, torch.tensor([never]))
    old = [int(head.vocab[int(i)]) for d in only for i in d.logp.float().argmax(-1)]
    assert old and set(old) == {never}


def test_whole_tree_acceptance_walks_every_beam(target):
    """A two-token head of width 2 holds both tokens at every depth of its tree, so the whole
    tree is accepted wherever the target's greedy tokens are those two, and its best beam only
    where they are the beam's; width 1 is a chain, the same as the spine. A walk of the best
    beam only (the spine measure) would miss every step where the target takes the other."""
    from collections import Counter

    records = cycle_records(6)
    data = replay(target.model, target.tokenizer, records, vocabulary(records, target.tokenizer))
    with torch.no_grad():
        greedy = [(d.hidden[1:] @ target.model.lm_head.weight.T).argmax(-1).tolist() for d in data]
    two = [t for t, _ in Counter(t for g in greedy for t in g).most_common(2)]
    assert len(two) == 2
    head = random_head(target, two)
    one = acceptance_by_depth(head, data, width=1, depth=1)
    assert one["tree_accepted"] == one["mean_accepted"]
    both = acceptance_by_depth(head, data, width=2, depth=1)
    # depth 1: the tree takes a step's token when it is either of the two
    steps = sum(len(g) for g in greedy)
    assert both["steps"] == steps
    assert both["tree_accepted"] == pytest.approx(sum(t in two for g in greedy for t in g) / steps)
    assert both["tree_accepted"] > both["mean_accepted"]
    deep = acceptance_by_depth(head, data, width=4, depth=3)
    assert deep["mean_accepted"] <= deep["tree_accepted"] <= 3
