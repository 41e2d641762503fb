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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentspec.errors import MemoryFaultWarning, StoreError
from agentspec.stores.faiss_index import FaissIndex


@dataclass
class ScopeIndex:
    """The in-process index of one (scope, embedder): mutable, owned by the memory."""

    index: FaissIndex
    watermark: int = 0  # every store id <= watermark has been seen
    synced_at: float = float("-inf")  # time.monotonic() of the last sync
    checked_at: float = float("-inf")  # ... of the last row count (rows deleted elsewhere)
    # Ids below the watermark that were missing when it passed them, and since when: a
    # transaction of another process may still commit them (see CompletionMemory._sync).
    holes: dict[int, float] = field(default_factory=dict)


def index_paths(folder: Path, scope: str, embedder: str) -> tuple[Path, Path]:
    """The ``.faiss`` and ``.json`` files of ``scope`` and ``embedder`` under ``folder``."""
    digest = hashlib.sha256(scope.encode("utf-8")).hexdigest()[:16]
    stem = f"{digest}-{re.sub(r'[^A-Za-z0-9._-]', '_', embedder)}"
    return folder / f"{stem}.faiss", folder / f"{stem}.json"


def load_index(folder: Path | None, scope: str, embedder: str, dim: int,
               store_id: str) -> ScopeIndex:
    """The saved index of ``scope`` when there is a sound one, else an empty index."""
    if folder is None:
        return ScopeIndex(FaissIndex(dim))
    index_path, meta_path = index_paths(folder, scope, embedder)
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
                      f"store", MemoryFaultWarning, stacklevel=5)
        return ScopeIndex(FaissIndex(dim))


def save_index(folder: Path, scope: str, embedder: str, store_id: str,
               state: ScopeIndex) -> None:
    """Write ``state`` (index first, then its note, each atomically)."""
    folder.mkdir(parents=True, exist_ok=True)
    index_path, meta_path = index_paths(folder, scope, embedder)
    state.index.save(index_path)
    meta = {"scope": scope, "embedder": embedder, "store": store_id,
            "watermark": state.watermark}
    tmp = meta_path.with_name(f".{meta_path.name}.tmp")
    tmp.write_text(json.dumps(meta))
    tmp.replace(meta_path)
