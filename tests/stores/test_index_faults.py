"""Corrupt, foreign or unsavable index files: rebuilt from SQL (or warned about), never fatal."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores import FaissIndex
from tests.stores.faults import catching, fault_warnings, rec


def _truncate(faiss: Path, meta: Path) -> None:
    faiss.write_bytes(faiss.read_bytes()[:100])


def _empty(faiss: Path, meta: Path) -> None:
    faiss.write_bytes(b"")


def _garbage(faiss: Path, meta: Path) -> None:
    faiss.write_bytes(np.random.default_rng(0).bytes(len(faiss.read_bytes())))


def _huge_count(faiss: Path, meta: Path) -> None:
    data = bytearray(faiss.read_bytes())
    data[8:16] = (2**40).to_bytes(8, "little")  # ntotal in the IndexIDMap2 header
    faiss.write_bytes(bytes(data))


def _bad_meta(faiss: Path, meta: Path) -> None:
    meta.write_text("{not json")


def _other_dim(faiss: Path, meta: Path) -> None:
    FaissIndex(8).save(faiss)


def _watermark_ahead(faiss: Path, meta: Path) -> None:
    FaissIndex(HashEmbedder().dim).save(faiss)  # empty, but the note claims every id was seen
    note = json.loads(meta.read_text())
    meta.write_text(json.dumps({**note, "watermark": 10**9}))


@pytest.mark.parametrize("damage", [_truncate, _empty, _garbage, _huge_count, _bad_meta,
                                    _other_dim, _watermark_ahead], ids=lambda f: f.__name__[1:])
def test_corrupt_index_file_is_rebuilt_from_sql(tmp_path: Path, damage: Callable) -> None:
    url, index_dir = f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "index"
    with CompletionMemory.open(url, embedder=HashEmbedder(), index_dir=index_dir) as memory:
        ids = [rec(memory, f"key {i}") for i in range(6)]
    damage(next(index_dir.glob("*.faiss")), next(index_dir.glob("*.json")))
    with catching() as caught:
        memory = CompletionMemory.open(url, embedder=HashEmbedder(), index_dir=index_dir)
        hits = memory.lookup("key 4", scope="s", model="m", k=1)
    assert hits[0][0].id == ids[4] and memory.stats()["indexes"] == {"s": 6}
    said = fault_warnings(caught)
    if damage is _watermark_ahead:  # a sound file that disagrees with SQL: reconciled quietly
        assert said == []
    else:
        assert len(said) == 1 and "rebuilding it from the store" in said[0]
    memory.close()
    with catching() as caught:  # the rebuilt index was saved: no warning the next time
        with CompletionMemory.open(url, embedder=HashEmbedder(), index_dir=index_dir) as again:
            assert again.lookup("key 2", scope="s", model="m", k=1)[0][0].id == ids[2]
    assert fault_warnings(caught) == []


def test_two_databases_keep_apart_index_files_of_one_scope(tmp_path: Path, monkeypatch) -> None:
    index_dir = tmp_path / "index"

    def reopen_each() -> list[str]:
        for name in ("a", "b"):
            url = f"sqlite:///{tmp_path / name}.db"
            with CompletionMemory.open(url, embedder=HashEmbedder(), index_dir=index_dir) as m:
                if not m.lookup(f"{name} key", scope="s", model="m", k=1):
                    rec(m, f"{name} key")
        with catching() as caught:
            for name in ("a", "b"):
                url = f"sqlite:///{tmp_path / name}.db"
                with CompletionMemory.open(url, embedder=HashEmbedder(),
                                           index_dir=index_dir) as m:
                    assert m.lookup(f"{name} key", scope="s", model="m", k=1)
        return fault_warnings(caught)

    assert reopen_each() == [] and len(list(index_dir.glob("*.faiss"))) == 2
    # The variant that must be caught: files named by scope alone, each database rebuilds
    # the index the other one saved.
    from agentspec.memory import index as index_module

    named = index_module.index_paths
    monkeypatch.setattr(index_module, "index_paths",
                        lambda folder, scope, embedder, store_id: named(folder, scope, embedder, ""))
    index_dir = tmp_path / "shared"
    assert len(reopen_each()) == 2


def test_index_files_that_cannot_be_saved_are_warned_about(tmp_path: Path) -> None:
    blocker = tmp_path / "index"
    blocker.write_text("a file where the index folder should be")
    memory = CompletionMemory.open(f"sqlite:///{tmp_path / 'm.db'}", embedder=HashEmbedder(),
                                   index_dir=blocker)
    rec(memory, "key")
    with catching() as caught:
        memory.close()
    said = fault_warnings(caught)
    assert len(said) == 1 and "not saved" in said[0]
