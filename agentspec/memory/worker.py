"""The memory's one worker thread, and the vectors of the latest keys.

Three kinds of work leave a call for the worker, in order: a lookup started ahead of the
call's own (``CompletionMemory.prefetch``), a key embedded ahead of its lookup
(:meth:`KeyVectors.prefetch`) and writes handed over behind a call (a record, its credits).
Every later read of the memory first waits for the writes handed over before it
(:meth:`Worker.settle`), so a call still drafts from every completion recorded before it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from agentspec.protocols import Embedder

# Keys whose vectors a memory keeps (384 float32 each for MiniLM: 1.5 KiB).
EMBED_CACHE = 256


class Worker:
    """One thread (started on first use) that runs what is handed to it in order."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._writes: list[Future[Any]] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def started(self) -> bool:
        return self._pool is not None

    @property
    def on_worker(self) -> bool:
        """Whether the calling thread is the worker."""
        return bool(getattr(self._local, "is_worker", False))

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn`` on the worker after what was handed over before it."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="agentspec-embed",
                                                initializer=self._mark)
            return self._pool.submit(fn, *args, **kwargs)

    def _mark(self) -> None:
        self._local.is_worker = True

    def behind(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """A write handed over behind a call: :meth:`settle` waits for it."""
        done = self.submit(fn, *args, **kwargs)
        with self._lock:
            self._writes = [w for w in self._writes if not w.done()]
            self._writes.append(done)
        return done

    def settle(self) -> None:
        """Wait for the writes handed over so far (on the worker itself: nothing to wait for,
        they run in order)."""
        if not self._writes or self.on_worker:
            return
        with self._lock:
            writes = list(self._writes)  # kept: a reader on another thread waits for them too
        wait(writes)
        with self._lock:
            self._writes = [w for w in self._writes if not w.done()]

    def shutdown(self) -> None:
        """Run what was handed over, then stop the thread (a later submit starts another)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._writes = []


class KeyVectors:
    """The unit vectors of the latest :data:`EMBED_CACHE` keys, by embedder name and text:
    a generation's lookup and its record embed the same key, and agents repeat requests."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._vectors: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._embedding: dict[tuple[str, str], Future[np.ndarray]] = {}  # prefetched keys
        self._lock = threading.Lock()

    def prefetch(self, embedder: Embedder, text: str) -> None:
        """Start embedding ``text`` on the worker and return at once."""
        key = (embedder.name, text)
        with self._lock:
            if key in self._vectors or key in self._embedding:
                return
            self._embedding[key] = self.worker.submit(self._embed_now, embedder, key)

    def get(self, embedder: Embedder, text: str) -> np.ndarray:
        """``text``'s unit vector ``[dim]`` (read only): cached, prefetched, or embedded now."""
        key = (embedder.name, text)
        with self._lock:
            hit = self._vectors.get(key)
            if hit is not None:
                self._vectors.move_to_end(key)
                return hit
            pending = self._embedding.get(key)
        # On the worker, a prefetch of this key may be queued behind the running task: it is
        # embedded here, not waited for (the queued prefetch then finds the vector).
        if pending is not None and (pending.done() or not self.worker.on_worker):
            try:
                return pending.result()
            except Exception:  # embedded again here, where the error is raised to the caller
                with self._lock:
                    self._embedding.pop(key, None)
        return self._embed_now(embedder, key)

    def _embed_now(self, embedder: Embedder, key: tuple[str, str]) -> np.ndarray:
        with self._lock:
            hit = self._vectors.get(key)
            if hit is not None:  # a prefetch of a key embedded meanwhile
                self._embedding.pop(key, None)
                return hit
        vector = np.ascontiguousarray(embedder.embed([key[1]])[0], np.float32)  # [dim]
        vector.setflags(write=False)  # shared by every caller of this key
        with self._lock:
            self._vectors[key] = vector
            self._embedding.pop(key, None)
            while len(self._vectors) > EMBED_CACHE:
                self._vectors.popitem(last=False)
        return vector
