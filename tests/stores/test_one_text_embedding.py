"""MiniLM's one-text forward (agentspec.memory.minilm): the vector sentence-transformers' encode gives,
unpadded on the CPU and padded to a CUDA bucket, and on a GPU as a CUDA graph replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentspec.memory.embedder import MiniLMEmbedder
from agentspec.memory.minilm import BUCKETS, OneTextForward

TEXTS = [
    "hi",
    "user: What's the weather like in Paris today? Please use celsius.",
    '{"name": "ls", "arguments": {"path": "/home/user/documents"}} tool: ["a.txt"] user: open a.txt',
    "a;" * 200,  # 300 word pieces in the last 300 characters: cut at 256, as encode cuts
]


@pytest.fixture(scope="module")
def minilm():
    e = MiniLMEmbedder(device="cpu")
    e._load()
    return e


def encode(e, text):
    return e._model.encode([text[-e.max_chars:]], normalize_embeddings=True, convert_to_numpy=True,
                           show_progress_bar=False)[0]


def padded(forward, text, *, bucket=256, mask_padding=True):
    """The forward a CUDA bucket runs, on the CPU: ``text`` padded to ``bucket`` word pieces."""
    ids = forward.tokenizer(text, truncation=True, max_length=forward.max_length)["input_ids"]
    x = torch.zeros(bucket, dtype=torch.long)
    x[: len(ids)] = torch.tensor(ids)
    mask = torch.zeros(bucket, dtype=torch.bool)
    mask[: len(ids) if mask_padding else bucket] = True
    with torch.inference_mode():
        return forward._forward(x, mask).numpy()


@pytest.mark.slow
def test_one_text_gives_encodes_vector_unpadded_and_padded(minilm):
    for text in TEXTS:
        want = encode(minilm, text)
        got = minilm.embed([text])[0]  # one text: the forward written out, not encode
        assert got.shape == (384,) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=2e-6)
        np.testing.assert_allclose(padded(minilm._one, text[-minilm.max_chars:]), want, atol=2e-6)


@pytest.mark.slow
def test_a_bucket_that_lets_the_padding_in_fails_the_check(minilm):
    # The deliberately wrong forward: padded word pieces attended to and averaged in.
    text = TEXTS[1]
    wrong = padded(minilm._one, text, mask_padding=False)
    assert np.abs(wrong - encode(minilm, text)).max() > 1e-2


@pytest.mark.slow
def test_the_embedder_runs_where_asked_and_on_a_gpu_by_default(minilm):
    assert minilm.resolved_device == "cpu" and not minilm._one.cuda_graphs
    auto = MiniLMEmbedder()
    assert auto.resolved_device == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_text_replays_a_cuda_graph_with_encodes_vector(minilm):
    import time

    gpu = MiniLMEmbedder(device="cuda")
    gpu.warmup()  # every bucket captured
    forward: OneTextForward = gpu._one
    assert forward.cuda_graphs and sorted(forward._graphs) == list(BUCKETS)
    for text in TEXTS:
        np.testing.assert_allclose(gpu.embed([text])[0], encode(minilm, text), atol=1e-5)
    times = []
    for _ in range(50):
        start = time.perf_counter()
        gpu.embed([TEXTS[2]])
        times.append(time.perf_counter() - start)
    assert float(np.median(times)) < 2e-3  # encode took ~9 ms a key on an H100
