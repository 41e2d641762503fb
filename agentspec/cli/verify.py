"""``agentspec cache reindex`` and ``agentspec cache verify``: rebuild and check the memory.

``reindex`` embeds rows stored without an embedding (loading the embedder, MiniLM by default)
and rebuilds every faiss index file of the store from SQL; ``verify`` decodes every row and
checks token ids, embedding dimensions and the index files against SQL.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

import numpy as np
import typer

from agentspec.cli.common import (
    EXIT_FAIL,
    cache_command,
    confirm,
    console,
    embedder_by_name,
    err_console,
    index_dir,
    index_files,
    open_store,
    print_json,
    progress,
    report,
    want_json,
)
from agentspec.types import Record

_CHUNK = 500


class _IndexOnly:
    """Stands in for an embedder when only rebuilding an index: the rows are already embedded."""

    def __init__(self, name: str, dim: int) -> None:
        self.name, self.dim = name, dim

    def embed(self, texts: Any) -> np.ndarray:  # pragma: no cover - never called by a rebuild
        raise RuntimeError(f"{self.name}: index rebuild only, no embedding")


def _embed_missing(store: Any, name: str | None, yes: bool) -> int:
    """Embed the key text of every row stored without an embedding; returns how many."""
    missing = store.unembedded_ids()
    if not missing:
        confirm(f"Rebuild the index files of {store.url}?", yes)
        return 0
    embedder = embedder_by_name(name or "all-MiniLM-L6-v2")
    confirm(f"Embed {len(missing)} row(s) with {embedder.name} and rebuild the index files of "
            f"{store.url}?", yes)
    with progress() as bar:
        task = bar.add_task("embed", total=len(missing))
        for i in range(0, len(missing), _CHUNK):
            rows = store.get_many(missing[i : i + _CHUNK])
            vectors = embedder.embed([r.key_text for r in rows])  # [n, dim]
            store.set_embeddings([(r.id, v) for r, v in zip(rows, vectors, strict=True)],
                                 embedder.name)
            bar.advance(task, len(rows))
    return len(missing)


@cache_command
def reindex(ctx: typer.Context,
            embedder: Annotated[str | None, typer.Option(
                "--embedder", hidden=True, help="Embedder for rows without embeddings.")] = None,
            yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False) -> None:
    """Rebuild the faiss index files from SQL; embed rows that lack embeddings first.

    Example: agentspec cache reindex --yes
    """
    from agentspec.memory.completion import CompletionMemory

    with open_store(ctx) as store:
        embedded = _embed_missing(store, embedder, yes)
        for f in index_files(store.url):
            f.path.unlink(missing_ok=True)
            f.path.with_suffix(".json").unlink(missing_ok=True)
        groups = store.embedding_groups()
        with progress() as bar:
            task = bar.add_task("index", total=sum(groups.values()))
            for (scope, name, dim), n in sorted(groups.items()):
                memory = CompletionMemory(store, embedder=_IndexOnly(name, dim),
                                          index_dir=index_dir(), max_tokens_per_scope=None,
                                          max_tokens_total=None)
                memory.rebuild(scope)
                memory.save()
                bar.advance(task, n)
    vectors = sum(groups.values())
    report(ctx, {"embedded": embedded, "index_files": len(groups), "vectors": vectors,
                 "index_dir": str(index_dir())},
           f"embedded {embedded} row(s); rebuilt {len(groups)} index file(s) with {vectors} "
           f"vector(s) in {index_dir()}")


def _model_vocab(model: str, fallback: int | None) -> int:
    """Vocabulary size of a model fingerprint ``name:hash`` from its converted files."""
    from agentspec.home import model_dir

    folder = model_dir() / model.split(":", 1)[0]
    try:
        size = json.loads((folder / "config.json").read_text()).get("vocab_size")
        if isinstance(size, int) and size > 0:
            return size
    except (OSError, ValueError, AttributeError):
        pass
    return fallback if fallback is not None else 2**31


def _expected_dim(name: str, seen: dict[str, int], dim: int) -> int:
    from agentspec.memory.embedder import MiniLMEmbedder

    if name == MiniLMEmbedder.name:
        return MiniLMEmbedder.dim
    if name.startswith("hash-trigram-") and name[13:].isdigit():
        return int(name[13:])
    return seen.setdefault(name, dim)


def check_row(r: Record, vocab: int, seen_dims: dict[str, int]) -> list[str]:
    """What is wrong with one decoded row (empty when nothing)."""
    out = []
    ids = np.asarray(r.completion_ids, np.int64)
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.size:
        out.append(f"row {r.id}: token id {int(bad[0])} outside [0, {vocab}) "
                   f"({bad.size} such) for model {r.model}")
    if r.embedding is not None:
        dim = int(r.embedding.size)
        want = _expected_dim(r.embedder, seen_dims, dim)
        norm = float(np.linalg.norm(r.embedding))
        if dim != want:
            out.append(f"row {r.id}: embedding has dim {dim}, {r.embedder} gives {want}")
        elif not np.isfinite(norm) or abs(norm - 1.0) > 1e-3:
            out.append(f"row {r.id}: embedding norm is {norm:.4g}, not 1")
    return out


def _decode(store: Any, chunk: list[int], problems: list[str]) -> list[Record]:
    """Records of ``chunk``; rows that do not decode become problems."""
    try:
        return list(store.get_many(chunk))
    except (ValueError, TypeError, OverflowError, UnicodeDecodeError):
        pass
    out = []
    for i in chunk:
        try:
            r = store.get(i)
        except (ValueError, TypeError, OverflowError, UnicodeDecodeError) as e:
            problems.append(f"row {i}: does not decode ({e})")
            continue
        if r is not None:
            out.append(r)
    return out


def _check_indexes(store: Any, problems: list[str]) -> int:
    """Compare each index file's ids with the rows SQL holds for it; returns files checked."""
    from agentspec.errors import StoreError
    from agentspec.stores.faiss_index import FaissIndex

    files = index_files(store.url)
    for f in files:
        try:
            in_index = FaissIndex.load(f.path).ids()
        except StoreError as e:
            problems.append(f"index {f.path.name} ({f.scope}, {f.embedder}): {e}")
            continue
        in_sql = store.ids(scope=f.scope, embedder=f.embedder)
        extra, missing = np.setdiff1d(in_index, in_sql), np.setdiff1d(in_sql, in_index)
        if extra.size or missing.size:
            problems.append(f"index {f.path.name} ({f.scope}, {f.embedder}): {missing.size} "
                            f"row(s) missing, {extra.size} deleted row(s) still indexed; run "
                            f"agentspec cache reindex")
    return len(files)


def _scan(store: Any, vocab_of: Callable[[str], int], problems: list[str]) -> int:
    ids = store.ids().tolist()
    seen_dims: dict[str, int] = {}
    with progress() as bar:
        task = bar.add_task("verify", total=len(ids))
        for i in range(0, len(ids), _CHUNK):
            for r in _decode(store, ids[i : i + _CHUNK], problems):
                problems += check_row(r, vocab_of(r.model), seen_dims)
            bar.advance(task, len(ids[i : i + _CHUNK]))
    return len(ids)


@cache_command
def verify(ctx: typer.Context,
           vocab_size: Annotated[int | None, typer.Option(
               "--vocab-size", min=1, help="Token ids must be below this when the model's "
               "files are not at hand (default 2**31).")] = None) -> None:
    """Check rows (decode, token ids, embeddings) and index files against SQL; exit 1 if bad.

    Every row must decode, its token ids lie in the model's vocabulary, its embedding have the
    embedder's dimension and unit norm; every index file must hold exactly the SQL rows.

    Example: agentspec cache verify --vocab-size 49152
    """
    problems: list[str] = []
    vocabs: dict[str, int] = {}

    def vocab_of(model: str) -> int:
        if model not in vocabs:
            vocabs[model] = _model_vocab(model, vocab_size)
        return vocabs[model]

    with open_store(ctx) as store:
        rows = _scan(store, vocab_of, problems)
        n_index = _check_indexes(store, problems)
        url = store.url
    if want_json(ctx):
        print_json({"database": url, "rows": rows, "index_files": n_index, "vocab_sizes": vocabs,
                    "ok": not problems, "problems": problems})
    else:
        for p in problems[:50]:
            console.print(p, markup=False)
        if len(problems) > 50:
            console.print(f"... and {len(problems) - 50} more")
        status = "OK" if not problems else f"{len(problems)} problem(s)"
        err_console.print(f"verify {url}: {rows} row(s), {n_index} index file(s): {status}")
    if problems:
        raise typer.Exit(EXIT_FAIL)
