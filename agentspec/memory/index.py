"""The completion memory's index files: derived data, rebuilt from the store when unusable.

Under ``index_dir`` each (scope, embedder) has ``<scope-hash>-<embedder>.faiss`` beside a
``.json`` note of what it was built from (scope, embedder, store) and its id watermark. A file
that cannot be read, is truncated or corrupt, or was built for another scope, embedder,
dimension or store is replaced by an empty index (with a warning); the memory's next sync
fills it from the store.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentspec.errors import MemoryFaultWarning, StoreError
from agentspec.protocols import MemoryStore
from agentspec.stores.faiss_index import FaissIndex

# Missing ids an index follows while catching up (beyond: it counts and reconciles instead).
MAX_HOLES = 1024


@dataclass
class ScopeIndex:
    """The in-process index of one (scope, embedder): mutable, owned by the memory."""

    index: FaissIndex
    watermark: int = 0  # every store id <= watermark has been seen
    synced_at: float = float("-inf")  # time.monotonic() of the last sync
    checked_at: float = float("-inf")  # ... of the last row count (rows deleted elsewhere)
    # Ids below the watermark that were missing when it passed them, and since when: a
    # transaction of another process may still commit them (see :meth:`catch_up`).
    holes: dict[int, float] = field(default_factory=dict)

    def catch_up(self, store: MemoryStore, scope: str, embedder: str, now: float,
                 check_interval_s: float) -> None:
        """Add the scope's rows written since the watermark, reading only those (by key).

        PostgreSQL hands out ids before commits, which can land out of order: an id missing
        below the newest one may still commit. So the ids above the watermark (any scope) are
        read first, the missing ones kept as holes and looked for again at each sync until
        ``check_interval_s`` has passed (then the memory's row count check finds a late one);
        and the watermark moves only as far as that first read saw.
        """
        present = store.ids_since(self.watermark)  # [n] int64, sorted
        top = int(present[-1]) if len(present) else self.watermark
        if top - self.watermark - len(present) > MAX_HOLES - len(self.holes):
            self.holes.clear()  # too many to follow: count and reconcile at once instead
            self.checked_at = float("-inf")
        else:
            missing = np.setdiff1d(np.arange(self.watermark + 1, top + 1), present)
            self.holes.update((int(i), now) for i in missing)
        rows = store.ids_after(self.watermark, scope=scope, embedder=embedder)
        if self.holes:
            found = store.ids_after(0, scope=scope, embedder=embedder, among=list(self.holes))
            for i, _ in found:
                del self.holes[i]
            for i in [i for i, t in self.holes.items() if now - t >= check_interval_s]:
                del self.holes[i]
            rows = list({i: v for i, v in found + rows}.items())  # a hole filled just now: in both
        if rows:
            self.add_rows(rows)
        self.watermark = top  # rows above it read now are read again next time: adding is idempotent

    def add_rows(self, rows: Iterable[tuple[int, np.ndarray]]) -> None:
        """Add ``(id, vector)`` rows of this index's dimension; the watermark follows."""
        dim = self.index.dim
        rows = [(i, v) for i, v in rows if v.shape == (dim,)]
        if rows:
            ids = [i for i, _ in rows]
            self.index.add(ids, np.stack([v for _, v in rows]))  # [n, dim]
            self.watermark = max(self.watermark, max(ids))

    def reconcile(self, store: MemoryStore, scope: str, embedder: str) -> None:
        """Make the index hold exactly the store's embedded ids of ``scope``."""
        in_store = store.ids(scope=scope, embedder=embedder)
        in_index = self.index.ids()
        self.index.remove(np.setdiff1d(in_index, in_store).tolist())
        missing = np.setdiff1d(in_store, in_index).tolist()
        if missing:
            self.add_rows([(int(r.id), r.embedding) for r in store.get_many(missing)  # type: ignore[arg-type]
                           if r.embedding is not None])


def index_paths(folder: Path, scope: str, embedder: str, store_id: str) -> tuple[Path, Path]:
    """The ``.faiss`` and ``.json`` files of ``scope`` and ``embedder`` under ``folder``, for
    the database ``store_id``: two databases with a scope of the same name (one folder under
    ``$AGENTSPEC_HOME`` serves them all) keep files apart, not rebuilding each other's."""
    digest = hashlib.sha256(f"{store_id}\0{scope}".encode()).hexdigest()[:16]
    stem = f"{digest}-{re.sub(r'[^A-Za-z0-9._-]', '_', embedder)}"
    return folder / f"{stem}.faiss", folder / f"{stem}.json"


def load_index(folder: Path | None, scope: str, embedder: str, dim: int,
               store_id: str) -> ScopeIndex:
    """The saved index of ``scope`` when there is a sound one, else an empty index."""
    if folder is None:
        return ScopeIndex(FaissIndex(dim))
    index_path, meta_path = index_paths(folder, scope, embedder, store_id)
    if not index_path.exists():
        return ScopeIndex(FaissIndex(dim))
    try:
        meta: Mapping[str, Any] = json.loads(meta_path.read_text())
        index = FaissIndex.load(index_path)
        expected = (scope, embedder, dim, store_id)
        found = (meta["scope"], meta["embedder"], index.dim, meta["store"])
        if found != expected:
            raise StoreError(f"{index_path} was built for {found}, not {expected}")
        return ScopeIndex(index, watermark=int(meta["watermark"]))
    except (StoreError, OSError, ValueError, KeyError, TypeError, MemoryError) as e:
        warnings.warn(f"memory index {index_path} is unusable ({e}); rebuilding it from the "
                      f"store", MemoryFaultWarning, stacklevel=6)
        return ScopeIndex(FaissIndex(dim))


def save_index(folder: Path, scope: str, embedder: str, store_id: str,
               state: ScopeIndex) -> None:
    """Write ``state`` (index first, then its note, each atomically)."""
    folder.mkdir(parents=True, exist_ok=True)
    index_path, meta_path = index_paths(folder, scope, embedder, store_id)
    state.index.save(index_path)
    meta = {"scope": scope, "embedder": embedder, "store": store_id,
            "watermark": state.watermark}
    tmp = meta_path.with_name(f".{meta_path.name}.tmp")
    tmp.write_text(json.dumps(meta))
    tmp.replace(meta_path)
