"""Past its threshold the faiss index turns into an IVF: still finds near duplicates, removes,
lists ids, and survives a save/load round trip."""

from __future__ import annotations

import numpy as np

from agentspec.stores import FaissIndex


def unit(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_ivf_finds_near_duplicates_and_removes(tmp_path):
    rng = np.random.default_rng(0)
    vecs = unit(rng.standard_normal((3000, 32)))
    index = FaissIndex(32, ivf_threshold=2000, nprobe=8)
    index.add(list(range(1, 2001)), vecs[:2000])
    assert index.is_ivf
    index.add(list(range(2001, 3001)), vecs[2000:])  # adds after the switch
    queries = unit(vecs[::100] + 0.05 * rng.standard_normal((30, 32)))
    found = [index.search(q, 1)[0][0] for q in queries]
    assert found == list(range(1, 3001, 100))
    assert index.remove([1, 101, 999_999]) == 2 and len(index) == 2998
    assert index.search(queries[0], 1)[0][0] != 1
    assert index.ids().tolist() == [i for i in range(1, 3001) if i not in (1, 101)]
    index.save(tmp_path / "ivf.faiss")
    loaded = FaissIndex.load(tmp_path / "ivf.faiss")
    assert loaded.is_ivf and len(loaded) == 2998
    assert [loaded.search(q, 1)[0][0] for q in queries[2:]] == found[2:]


def test_one_query_runs_on_one_thread_and_the_callers_setting_comes_back():
    import faiss

    rng = np.random.default_rng(1)
    vecs = unit(rng.standard_normal((200, 16)))
    index = FaissIndex(16)
    index.add(list(range(1, 201)), vecs)
    seen = []
    inner = index._index

    class Spy:  # the faiss index, noting the OpenMP threads its search runs with
        ntotal = inner.ntotal

        def search(self, q, k):
            seen.append(faiss.omp_get_max_threads())
            return inner.search(q, k)

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(2)
    try:
        index._index = Spy()
        assert index.search(vecs[7], 3)[0][0] == 8
        assert seen == [1] and faiss.omp_get_max_threads() == 2
    finally:
        index._index = inner
        faiss.omp_set_num_threads(before)
