"""FaissIndex: inner-product search keyed by SQL ids.

Small indexes are exact (``IndexIDMap2(IndexFlatIP)``). Past ``ivf_threshold`` vectors a flat scan
reads too much memory per query (100k x 384 floats = 147 MiB a query), so the
index moves to an inverted file (``IndexIVFFlat``, ``nlist`` ~ 4 sqrt(n), ``nprobe`` lists
searched), trained on the vectors it holds. IVF search is approximate, which suits drafts: a
missed neighbour costs speed, never correctness, and the near-duplicate keys that matter sit in
the query's own list.

The index is derived data: the SQL store is the source of truth, and an index file that cannot
be read is rebuilt from it. faiss is imported on first use, with the command that installs it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agentspec.errors import ModelNotAvailableError, StoreError
from agentspec.stores.memory_store import check_query, check_vectors


def _faiss() -> Any:
    try:
        import faiss
    except ImportError as e:  # pragma: no cover - faiss-cpu is a core dependency
        raise ModelNotAvailableError(
            f"faiss is not installed ({e}); run: pip install 'faiss-cpu>=1.9'") from e
    return faiss


class FaissIndex:
    """A VectorIndex on faiss: ``IndexIDMap2(IndexFlatIP(dim))``, ids = SQL record ids.

    Vectors must be L2-normalised so that inner product is cosine similarity. Adding an id that
    is already present replaces its vector.

    Args:
        dim: vector dimension.
    """

    def __init__(self, dim: int, *, ivf_threshold: int = 20_000, nprobe: int = 16,
                 _index: Any = None) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be > 0, got {dim}")
        if ivf_threshold < 1 or nprobe < 1:
            raise ValueError(f"ivf_threshold and nprobe must be >= 1, got {ivf_threshold}, {nprobe}")
        self.dim = int(dim)
        self.ivf_threshold, self.nprobe = ivf_threshold, nprobe
        faiss = _faiss()
        self._index = _index if _index is not None else faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
        if self.is_ivf:
            faiss.extract_index_ivf(self._index).nprobe = nprobe

    @property
    def is_ivf(self) -> bool:
        return not isinstance(self._index, _faiss().IndexIDMap2)

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        """Add ``vectors`` ``[n, dim]`` under ``ids``."""
        ids_arr, vecs = check_vectors(ids, vectors, self.dim)
        if not len(ids_arr):
            return
        self.remove(ids_arr.tolist())
        self._index.add_with_ids(vecs, ids_arr)
        if not self.is_ivf and self._index.ntotal >= self.ivf_threshold:
            self._to_ivf()

    def _to_ivf(self) -> None:
        """Retrain as an inverted file over every vector held (flat -> IVF, once)."""
        faiss = _faiss()
        n = self._index.ntotal
        vecs = self._index.index.reconstruct_n(0, n)  # [n, dim]
        ids = faiss.vector_to_array(self._index.id_map).astype(np.int64)
        nlist = int(min(4096, max(16, 4 * np.sqrt(n))))
        ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist,
                                 faiss.METRIC_INNER_PRODUCT)
        ivf.train(vecs)
        ivf.add_with_ids(vecs, ids)
        ivf.nprobe = self.nprobe
        self._index = ivf

    def search(self, vector: np.ndarray, k: int) -> list[tuple[int, float]]:
        """Up to ``k`` ``(id, inner product)`` pairs, best first.

        One query runs on one OpenMP thread (the caller's setting is restored after): faiss's
        default of every core made a flat scan of some thousands of vectors several times
        slower on a small CPU, and more under load, where one thread is never slower
        (BENCHMARKS.md)."""
        q = check_query(vector, k, self.dim)
        if k == 0 or self._index.ntotal == 0:
            return []
        faiss = _faiss()
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)  # one query: more threads only add their start and sync
        try:
            scores, ids = self._index.search(q[None, :], min(k, self._index.ntotal))
        finally:
            faiss.omp_set_num_threads(threads)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]

    def remove(self, ids: Iterable[int]) -> int:
        """Remove ``ids`` (absent ones are ignored); returns how many were removed."""
        arr = np.fromiter((int(i) for i in ids), np.int64)
        if not len(arr) or self._index.ntotal == 0:
            return 0
        return int(self._index.remove_ids(_faiss().IDSelectorBatch(arr)))

    def ids(self) -> np.ndarray:
        """Every id in the index, sorted (int64)."""
        faiss = _faiss()
        if not self.is_ivf:
            return np.sort(faiss.vector_to_array(self._index.id_map).astype(np.int64))
        invlists = self._index.invlists
        parts = [faiss.rev_swig_ptr(invlists.get_ids(i), invlists.list_size(i)).copy()
                 for i in range(invlists.nlist) if invlists.list_size(i)]
        return np.sort(np.concatenate(parts).astype(np.int64)) if parts else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def save(self, path: str | Path) -> None:
        """Write the index to ``path`` atomically (a temporary file, then a rename)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        _faiss().write_index(self._index, str(tmp))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> FaissIndex:
        """Read an index written by ``save``.

        Raises:
            StoreError: the file is missing, truncated, corrupt, or not an ID-mapped flat
                inner-product index.
        """
        faiss = _faiss()
        try:
            index = faiss.read_index(str(path))
        except (RuntimeError, OSError) as e:
            raise StoreError(f"cannot read the faiss index {path}: {e}") from e
        if index.metric_type != faiss.METRIC_INNER_PRODUCT or not isinstance(
                index, (faiss.IndexIDMap2, faiss.IndexIVFFlat)):
            raise StoreError(f"{path} is not an ID-mapped flat or IVF inner-product index")
        if isinstance(index, faiss.IndexIDMap2) and index.ntotal != index.id_map.size():
            raise StoreError(f"{path} is inconsistent: {index.ntotal} vectors, {index.id_map.size()} ids")
        return cls(index.d, _index=index)
