"""Completion-memory latency on a large SQLite store: lookups, and a request's whole memory work.

    python -m agentspec.bench.memory_lookup --rows 100000
    python -m agentspec.bench.memory_lookup --rows 50000 --requests 200

Fills a fresh SQLite store with synthetic rows (random unit embeddings of dim 384, so no model
runs), then times ``CompletionMemory.lookup`` — sync check, faiss search, SQL fetch, model
filter — and prints p50/p99 in milliseconds and the process RSS. The embedder is a fake that
returns precomputed vectors: embedding time is not part of the figure (MiniLM adds its own few
milliseconds per query on CPU). Target: p99 < 5 ms at 100k rows.

``--requests N`` then times what one generation asks of the memory: a lookup that catches up
with the store (as every request longer than ``sync_interval_s`` does), recording a
64-token completion, and crediting a record. Two memories on the same file take turns,
request by request: ``current``, and ``per-write checks``, which reads the scope's row count
and the caps' token totals on every write and catches up through the scope's index (reading
every row id of the scope), as the memory did before. Caps are set far above the store.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from agentspec.memory.completion import CompletionMemory
from agentspec.stores import SQLStore
from agentspec.types import Record


class PrecomputedEmbedder:
    """Returns the vector registered for a text (tests and benchmarks only)."""

    name = "bench-precomputed"

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.vectors: dict[str, np.ndarray] = {}

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return np.stack([self.vectors[t] for t in texts]).astype(np.float32)  # [n, dim]


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def fill(store: SQLStore, *, rows: int, dim: int, scopes: int, models: int, seed: int) -> np.ndarray:
    """Insert ``rows`` synthetic records; returns their embeddings ``[rows, dim]``."""
    rng = np.random.default_rng(seed)
    vectors = _unit(rng, rows, dim)
    batch = 5000
    for start in range(0, rows, batch):
        records = []
        for i in range(start, min(rows, start + batch)):
            n = int(rng.integers(20, 200))
            records.append(Record(
                scope=f"scope-{i % scopes}", model=f"model-{i % models}",
                request_text=f"request {i}: " + "lorem ipsum " * 20, key_text=f"key {i}",
                completion_text=f"completion {i}: " + "dolor sit amet " * 10,
                completion_ids=tuple(rng.integers(0, 50000, n).tolist()),
                embedding=vectors[i], embedder=PrecomputedEmbedder.name))
        store.add_many(records)
    return vectors


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize() / 2**20, peak
    except OSError:
        return float("nan"), peak


def time_lookups(memory: CompletionMemory, targets: np.ndarray,
                 args: argparse.Namespace) -> tuple[np.ndarray, int]:
    """Milliseconds per lookup, and how often the top hit was the row the query came from."""
    times, found = [], 0
    for j, i in enumerate(targets):
        scope, model = f"scope-{i % args.scopes}", f"model-{i % args.models}"
        t = time.perf_counter()
        hits = memory.lookup(f"query {j}", scope=scope, model=model, k=args.k)
        times.append(time.perf_counter() - t)
        found += bool(hits) and hits[0][0].key_text == f"key {i}"
    return np.asarray(times) * 1e3, found


class ScopeIndexedStore(SQLStore):
    """The store as it was: catching up reads the new rows through the scope's index."""

    def catches_up_by_key(self, after_id: int, among: Sequence[int] | None) -> bool:
        return False


def time_requests(url: str, embedder: PrecomputedEmbedder, vectors: np.ndarray,
                  args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Milliseconds of each request's memory work (lookup, record, credit) per variant."""
    def memory(store: SQLStore, check_interval_s: float) -> CompletionMemory:
        return CompletionMemory(store, embedder=embedder, max_tokens_per_scope=10**12,
                                max_tokens_total=10**12, sync_interval_s=0.0,
                                check_interval_s=check_interval_s)

    memories = {"current": memory(SQLStore(url), 30.0),
                "per-write checks": memory(ScopeIndexedStore(url), 0.0)}
    rng = np.random.default_rng(args.seed + 2)
    out: dict[str, list[float]] = {name: [] for name in memories}
    for each in memories.values():  # load each index before timing
        each.lookup("query 0", scope="scope-0", model="model-0", k=args.k)
    for j in range(args.requests):
        i = int(rng.integers(0, args.rows))
        scope, model = f"scope-{i % args.scopes}", f"model-{i % args.models}"
        for name, each in memories.items():
            key = f"request {j} {name}"
            embedder.vectors[key] = vectors[i]
            t = time.perf_counter()
            hits = each.lookup(key, scope=scope, model=model, k=args.k)
            each.record(scope=scope, model=model, request_text=key, key_text=key,
                        completion_text=f"answer {j}", completion_ids=list(range(j, j + 64)))
            if hits and hits[0][0].id is not None:
                each.credit(hits[0][0].id, 8)
            out[name].append(time.perf_counter() - t)
    for each in memories.values():
        each.store.close()  # type: ignore[attr-defined]
    return {name: np.asarray(v) * 1e3 for name, v in out.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--lookups", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--scopes", type=int, default=1, help="rows are spread over this many")
    parser.add_argument("--models", type=int, default=1, help="model fingerprints per scope")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="faiss OpenMP threads outside a search (adds, the IVF's "
                             "training); 0 keeps faiss's default (all cores). A search runs "
                             "one thread per query whatever this says (FaissIndex.search)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=0,
                        help="then time this many requests' whole memory work (lookup, record, "
                             "credit), against the per-write checks of before, interleaved")
    args = parser.parse_args(argv)
    if args.rows <= 0 or args.lookups <= 0 or args.requests < 0:
        parser.error(f"--rows and --lookups must be > 0 and --requests >= 0, got {args.rows}, "
                     f"{args.lookups} and {args.requests}")
    if args.threads:
        import faiss

        faiss.omp_set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLStore(f"sqlite:///{tmp}/bench.db")
        t0 = time.perf_counter()
        vectors = fill(store, rows=args.rows, dim=args.dim, scopes=args.scopes,
                       models=args.models, seed=args.seed)
        fill_s = time.perf_counter() - t0
        embedder = PrecomputedEmbedder(args.dim)
        rng = np.random.default_rng(args.seed + 1)
        noise = _unit(rng, args.lookups, args.dim) * 0.3
        targets = rng.integers(0, args.rows, args.lookups)
        for j, i in enumerate(targets):
            q = vectors[i] + noise[j]
            embedder.vectors[f"query {j}"] = q / np.linalg.norm(q)
        memory = CompletionMemory(store, embedder=embedder, max_tokens_per_scope=None,
                                  max_tokens_total=None)
        t0 = time.perf_counter()
        for s in range(args.scopes):
            memory.lookup("query 0", scope=f"scope-{s}", model="model-0", k=args.k)
        build_s = time.perf_counter() - t0
        ms, found = time_lookups(memory, targets, args)
        rss, peak = rss_mib()
        print(f"rows={args.rows} scopes={args.scopes} models={args.models} dim={args.dim} "
              f"k={args.k} lookups={args.lookups}")
        print(f"fill {fill_s:.1f} s, index build {build_s:.2f} s")
        print(f"lookup p50 {np.percentile(ms, 50):.2f} ms  p99 {np.percentile(ms, 99):.2f} ms  "
              f"mean {ms.mean():.2f} ms  (top-1 = target {found}/{args.lookups})")
        print(f"RSS {rss:.0f} MiB (peak {peak:.0f} MiB)")
        store.close()
        if args.requests:
            per = time_requests(f"sqlite:///{tmp}/bench.db", embedder, vectors, args)
            base = per["per-write checks"]
            for name, ms in per.items():
                print(f"request ({name}): p50 {np.percentile(ms, 50):.2f} ms  "
                      f"p99 {np.percentile(ms, 99):.2f} ms  mean {ms.mean():.2f} ms  "
                      f"({np.median(base) / np.median(ms):.2f}x per-write checks' median)")


if __name__ == "__main__":
    main()
