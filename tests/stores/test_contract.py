"""One contract for every RecordStore (InMemoryStore is the reference) and every VectorIndex."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agentspec.errors import StoreError
from agentspec.protocols import RecordStore, VectorIndex
from agentspec.stores import BruteForceIndex, FaissIndex, InMemoryStore
from tests.stores.conftest import make_record


def fill(store, records):
    return [store.add(r)[0] for r in records]


def test_is_a_record_store(store):
    assert isinstance(store, RecordStore)
    assert len(store) == 0 and store.max_id() == 0


def test_add_get_roundtrip(store):
    rec = make_record(1, completion_ids=(0, 2**31 - 1, -(2**31), 7))
    rid, created = store.add(rec)
    assert created and rid >= 1
    got = store.get(rid)
    assert got is not None and got.id == rid
    assert got == replace(rec, id=rid, created_at=got.created_at, last_used_at=got.last_used_at)
    assert got.embedding is not None and got.embedding.dtype == np.float32
    np.testing.assert_array_equal(got.embedding, rec.embedding)
    assert got.created_at > 0 and got.last_used_at == got.created_at
    assert got.num_tokens == 4 and got.hits == 0
    assert len(store) == 1 and store.max_id() == rid


def test_exact_duplicate_bumps_hits(store):
    rid, _ = store.add(make_record(1))
    before = store.get(rid)
    time.sleep(0.01)
    assert store.add(make_record(1)) == (rid, False)
    after = store.get(rid)
    assert len(store) == 1 and after.hits == before.hits + 1
    assert after.last_used_at > before.last_used_at
    # same texts in another scope or for another model are different records
    assert store.add(make_record(1, scope="other"))[1]
    assert store.add(make_record(1, model="other"))[1]
    assert store.add(make_record(1, completion_text="different"))[1]
    assert len(store) == 4


def test_add_many_inserts_in_order_and_skips_duplicates(store):
    store.add(make_record(1))
    batch = [make_record(2, created_at=123.5), make_record(1), make_record(3), make_record(2)]
    assert store.add_many(batch) == 2
    assert [r.key_text for r in store.iter()] == ["key 1", "key 2", "key 3"]
    assert store.get(1).hits == 0  # a skipped duplicate leaves its row as it was
    assert [r.created_at for r in store.iter() if r.key_text == "key 2"] == [123.5]
    assert store.add_many([]) == 0
    with pytest.raises(ValueError):  # one bad record: none of the batch is inserted
        store.add_many([make_record(4), make_record(5, scope="")])
    assert len(store) == 3


def test_get_many_iter_delete(store):
    ids = fill(store, [make_record(i, scope="a" if i % 2 else "b") for i in range(1, 11)])
    assert ids == sorted(ids) and len(set(ids)) == 10
    assert store.get(10**9) is None
    got = store.get_many([ids[3], 10**9, ids[0]])
    assert [r.id for r in got] == [ids[3], ids[0]]
    assert [r.id for r in store.iter()] == ids
    assert [r.id for r in store.iter(scope="a")] == ids[0::2]
    assert [r.id for r in store.iter(after_id=ids[6])] == ids[7:]
    assert list(store.iter(model="nope")) == []
    assert store.delete([ids[0], ids[1], 10**9]) == 2
    assert store.delete([ids[0]]) == 0
    assert len(store) == 8 and store.get(ids[0]) is None
    rid, created = store.add(make_record(1, scope="a"))  # re-adding a deleted record inserts it
    assert created and rid > ids[-1]


def test_touch(store):
    rid, _ = store.add(make_record(1))
    before = store.get(rid)
    time.sleep(0.01)
    store.touch(rid, accepted_tokens=5)
    store.touch(rid)
    after = store.get(rid)
    assert (after.hits, after.accepted_tokens) == (2, 5)
    assert after.last_used_at > before.last_used_at
    store.touch(10**9)  # unknown (maybe evicted meanwhile): ignored
    with pytest.raises(ValueError, match="-1"):
        store.touch(rid, accepted_tokens=-1)
    assert store.get(rid).accepted_tokens == 5


def test_embedding_queries(store):
    fill(store, [make_record(1), make_record(2, embedder="other"), make_record(3, embedding=None),
                 make_record(4, scope="t"), make_record(5, dim=16)])
    assert store.count() == 5 and store.count(scope="s") == 4
    assert store.count(scope="s", embedder="e") == 2
    assert store.ids(scope="s", embedder="e").tolist() == [1, 5]
    rows = store.ids_after(0, scope="s", embedder="e")
    assert [i for i, _ in rows] == [1, 5] and rows[1][1].shape == (16,)
    assert [i for i, _ in store.ids_after(1, embedder="e")] == [4, 5]
    assert store.token_total() == 15 and store.token_total("t") == 3
    # Catching up: every id above a watermark (any scope), and rows among given ids.
    assert store.ids_since(2).tolist() == [3, 4, 5] and store.ids_since(5).tolist() == []
    assert [i for i, _ in store.ids_after(0, scope="s", embedder="e", among=[5, 4, 2])] == [5]
    assert [i for i, _ in store.ids_after(3, embedder="e", among=[1, 4, 5])] == [4, 5]


def test_ids_are_never_reused(store):
    """A memory catches up by id: a new row under a deleted row's id would pass for it."""
    ids = fill(store, [make_record(1), make_record(2)])
    store.delete([ids[-1]])  # the newest row
    assert store.add(make_record(3))[0] > ids[-1]


def test_stats_match_the_reference(store):
    ref = InMemoryStore()
    recs = [make_record(i, scope=f"s{i % 3}", model=f"m{i % 2}", n=i) for i in range(1, 13)]
    for r in recs + recs[:4]:
        store.add(r)
        ref.add(r)
    store.touch(1, accepted_tokens=3)
    ref.touch(1, accepted_tokens=3)
    stats = store.stats()
    assert stats == ref.stats()
    assert stats["rows"] == 12 and stats["tokens"] == sum(range(1, 13)) and stats["hits"] == 5
    assert stats["accepted_tokens"] == 3 and set(stats["scopes"]) == {"s0", "s1", "s2"}
    assert sum(v["rows"] for v in stats["models"].values()) == 12


def test_list_records(store):
    ids = fill(store, [make_record(i, n=i) for i in range(1, 6)])
    store.touch(ids[1], accepted_tokens=9)
    store.touch(ids[2])
    store.touch(ids[2])
    assert [r.id for r in store.list_records()][:1] == [ids[2]]
    assert [r.id for r in store.list_records(sort="hits", limit=2)] == [ids[2], ids[1]]
    assert [r.id for r in store.list_records(sort="size", limit=3)] == [ids[4], ids[3], ids[2]]
    assert store.list_records(sort="accepted", limit=1)[0].id == ids[1]
    assert store.list_records(scope="nope") == [] and store.list_records(limit=0) == []


@pytest.mark.parametrize("kwargs", [{"sort": "best"}, {"limit": -1}])
def test_list_records_rejects_bad_input(store, kwargs):
    store.add(make_record(1))
    with pytest.raises(ValueError, match=str(next(iter(kwargs.values())))):
        store.list_records(**kwargs)


def test_drop_scope(store):
    fill(store, [make_record(i, scope="a" if i < 4 else "b") for i in range(1, 7)])
    assert store.drop_scope("a") == 3 and store.drop_scope("a") == 0
    assert {r.scope for r in store.iter()} == {"b"}


def test_prune(store):
    now = time.time()
    ids = fill(store, [make_record(i, n=10, last_used_at=now - 1000 + i, created_at=now - 2000)
                       for i in range(1, 6)] + [make_record(6, n=10), make_record(7, scope="t")])
    assert store.prune(500, dry_run=True) == ids[:5] and len(store) == 7
    assert store.prune(500, scope="t") == []
    assert sorted(store.prune(None, scope="s", max_tokens=35)) == ids[:3]
    assert sorted(store.prune(995.5)) == ids[3:4]
    assert store.prune(None) == [] and len(store) == 3


@pytest.mark.parametrize("kwargs", [{"older_than_s": -1}, {"older_than_s": None, "max_tokens": -5}])
def test_prune_rejects_bad_input(store, kwargs):
    store.add(make_record(1, last_used_at=1.0))
    with pytest.raises(ValueError, match="-"):
        store.prune(**kwargs)
    assert len(store) == 1


def test_evict_to_caps_is_lru(store):
    t0 = time.time() - 100
    ids = fill(store, [make_record(i, scope="a" if i <= 4 else "b", n=10, last_used_at=t0 + i)
                       for i in range(1, 9)])
    store.touch(ids[0])  # the oldest "a" record is used now: it survives
    assert store.evict_to_caps(None, None) == []
    assert sorted(store.evict_to_caps(25, None)) == [ids[1], ids[2], ids[4], ids[5]]
    assert sorted(r.id for r in store.iter()) == [ids[0], ids[3], ids[6], ids[7]]
    assert sorted(store.evict_to_caps(25, 30)) == [ids[3]]  # globally least recently used
    assert store.token_total() == 30
    assert store.evict_to_caps(0, None, scope="b") == [ids[6], ids[7]]
    with pytest.raises(ValueError, match="max_tokens_total"):
        store.evict_to_caps(None, -1)
    assert len(store) == 1


@pytest.mark.parametrize("bad, match", [
    ({"scope": ""}, "scope"),
    ({"completion_ids": (1, 2**31)}, "int32"),
    ({"embedding": np.zeros((2, 2), np.float32)}, "1-D"),
    ({"hits": -1}, "hits"),
])
def test_add_rejects_bad_records(store, bad, match):
    store.add(make_record(1))
    with pytest.raises(ValueError, match=match):
        store.add(make_record(2, **bad))
    assert len(store) == 1 and store.get(1).hits == 0


# --- VectorIndex contract ------------------------------------------------------------------------

def unit(rng, n, dim):
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(params=[BruteForceIndex, FaissIndex])
def index(request):
    return request.param(16)


def test_index_contract(index):
    assert isinstance(index, VectorIndex) and len(index) == 0
    assert index.search(np.ones(16), 3) == []
    x = unit(np.random.default_rng(0), 5, 16)
    index.add([10, 11, 12, 13, 14], x)
    assert len(index) == 5
    top = index.search(x[2], 3)
    assert top[0][0] == 12 and top[0][1] == pytest.approx(1.0, abs=1e-5)
    assert [s for _, s in top] == sorted((s for _, s in top), reverse=True)
    assert len(index.search(x[0], 50)) == 5 and index.search(x[0], 0) == []
    index.add([12], x[4:5])  # re-adding an id replaces its vector
    assert len(index) == 5 and index.search(x[4], 2)[1][1] == pytest.approx(1.0, abs=1e-5)
    assert index.remove([10, 12, 99]) == 2 and len(index) == 3
    assert index.ids().tolist() == [11, 13, 14]
    assert 10 not in [i for i, _ in index.search(x[0], 5)]


def test_index_rejects_bad_input(index):
    with pytest.raises(ValueError, match="16"):
        index.add([1], np.ones((1, 8), np.float32))
    with pytest.raises(ValueError, match="2 ids"):
        index.add([1, 2], np.ones((1, 16), np.float32))
    with pytest.raises(ValueError, match="-1"):
        index.search(np.ones(16), -1)
    assert len(index) == 0


def test_indexes_agree_on_random_vectors():
    rng = np.random.default_rng(1)
    x, queries = unit(rng, 2000, 32), unit(rng, 20, 32)
    ids = rng.permutation(10**6)[:2000]
    brute, faiss_ = BruteForceIndex(32), FaissIndex(32)
    for ix in (brute, faiss_):
        ix.add(ids, x)
        ix.remove(ids[:100].tolist())
    for q in queries:
        a, b = brute.search(q, 10), faiss_.search(q, 10)
        assert [i for i, _ in a] == [i for i, _ in b]
        np.testing.assert_allclose([s for _, s in a], [s for _, s in b], atol=1e-5)


def test_faiss_save_load(tmp_path: Path):
    x = unit(np.random.default_rng(2), 50, 16)
    ix = FaissIndex(16)
    ix.add(range(100, 150), x)
    ix.save(tmp_path / "a.faiss")
    back = FaissIndex.load(tmp_path / "a.faiss")
    assert len(back) == 50 and back.dim == 16 and back.search(x[7], 1)[0][0] == 107
    data = (tmp_path / "a.faiss").read_bytes()
    (tmp_path / "short.faiss").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.faiss").write_bytes(b"not an index at all" * 10)
    for name in ("short.faiss", "junk.faiss", "missing.faiss"):
        with pytest.raises(StoreError, match=name):
            FaissIndex.load(tmp_path / name)


def test_relabel_model_moves_rows_and_merges_twins(store):
    old, new = "tiny:0ld0ld0ld0ld0ld0", "tiny:new0new0new0new"
    a, b, c = fill(store, [make_record(1, model=old, hits=2, accepted_tokens=5, last_used_at=10.0),
                           make_record(2, model=old),
                           make_record(3, model="other")])
    # The same request and completion already recorded under the new fingerprint.
    twin = fill(store, [make_record(1, model=new, hits=1, accepted_tokens=1, last_used_at=20.0)])[0]
    assert store.relabel_model(old, new) == (1, 1)
    assert store.count(model=old) == 0 and store.count(model=new) == 2
    merged = store.get(twin)
    assert merged.hits == 3 and merged.accepted_tokens == 6 and merged.last_used_at == 20.0
    assert store.get(a) is None and store.get(b).model == new and store.get(c).model == "other"
    # Moved rows are duplicates under their new fingerprint: adding one again bumps it.
    assert store.add(make_record(2, model=new)) == (b, False)
    assert store.relabel_model(old, new) == (0, 0)
    with pytest.raises(ValueError, match="different"):
        store.relabel_model(new, new)
