"""One text's MiniLM vector in a few plain tensor operations, replayed as a CUDA graph on a GPU.

sentence-transformers' ``encode`` of one short text pays host work (feature dicts,
transformers' mask and attention dispatch) and ~100 small kernels launched one by one, on the
GPU or its CPU alike. A memory lookup embeds exactly one key, and beside a GPU's verification
step that was the largest cost of a request the memory serves (BENCHMARKS.md). :class:`OneTextForward` runs the same BERT
(the loaded model's own weights and tokenizer) as embedding, six encoder layers, mean pooling
and L2 normalisation written out once; on CUDA the input is padded to a bucket of 16-256 word
pieces (padded keys masked out, padded rows left out of the mean) and each bucket's forward is
captured as a graph on first use, so a key costs one replay and one copy back. On CUDA the
embedding runs on a stream of its own: a key embedded while the target prefills (a lookup
started ahead of it) neither queues behind the prefill's kernels nor waits for them to copy
its vector back.

The vectors agree with ``encode``'s to float32 rounding (a test checks ~1e-6 on the CPU); a
vector only chooses which remembered completions are drafted, never an output.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import numpy as np
import torch

BUCKETS = (16, 32, 64, 128, 256)


class OneTextForward:
    """``embed(text)``: the unit vector ``[dim]`` of one text through a loaded BertModel.

    Args:
        bert: the transformers ``BertModel`` sentence-transformers loaded (its modules' weights
            are read at each call, so packed CPU products stay in use).
        tokenizer: its tokenizer.
        max_length: the model's word-piece limit (256 for all-MiniLM-L6-v2); longer texts are
            cut there, as ``encode`` cuts them.
        cuda_graphs: capture each bucket's forward as a CUDA graph (CUDA only).
    """

    def __init__(self, bert: Any, tokenizer: Any, *, max_length: int, cuda_graphs: bool = True) -> None:
        self.bert = bert
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.device = next(bert.parameters()).device
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        cfg = bert.config
        self.heads = int(cfg.num_attention_heads)
        self.head_dim = int(cfg.hidden_size) // self.heads
        self._graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def embed(self, text: str) -> np.ndarray:
        ids = self.tokenizer(text, truncation=True, max_length=self.max_length)["input_ids"]
        with self._lock, torch.inference_mode(), _on(self._stream):
            if not self.cuda_graphs:
                x = torch.tensor(ids, dtype=torch.long, device=self.device)
                out = self._forward(x, torch.ones(len(ids), dtype=torch.bool, device=self.device))
            else:
                out = self._replay(ids)
            return out.float().cpu().numpy()

    def _replay(self, ids: list[int]) -> torch.Tensor:
        n = len(ids)
        bucket = next((b for b in BUCKETS if b >= n), n)
        entry = self._graphs.get(bucket)
        host = torch.zeros(2, bucket, dtype=torch.long)
        host[0, :n] = torch.tensor(ids, dtype=torch.long)
        host[1, :n] = 1
        if entry is None:
            staged = host.to(self.device)
            try:
                entry = self._capture(staged)
            except RuntimeError:  # the same forward, eagerly
                self.cuda_graphs = False
                return self._forward(staged[0], staged[1].bool())
            self._graphs[bucket] = entry
        graph, staged, out = entry
        staged.copy_(host, non_blocking=False)
        graph.replay()
        return out

    def _capture(self, staged: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
        from agentspec.engine.kernels import capture_graph

        graph, out = capture_graph(lambda: self._forward(staged[0], staged[1].bool()))
        return graph, staged, out

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids ``[n]``, mask ``[n]`` (True for a real word piece) -> unit vector ``[dim]``."""
        emb = self.bert.embeddings
        n = ids.shape[0]
        x = emb.word_embeddings(ids) + emb.position_embeddings.weight[:n] \
            + emb.token_type_embeddings.weight[0]
        x = emb.LayerNorm(x)  # [n, dim]
        bias = torch.zeros(n, dtype=x.dtype, device=x.device).masked_fill(~mask, float("-inf"))
        scale = 1.0 / math.sqrt(self.head_dim)
        for layer in self.bert.encoder.layer:
            att = layer.attention
            q = att.self.query(x).view(n, self.heads, self.head_dim).transpose(0, 1)
            k = att.self.key(x).view(n, self.heads, self.head_dim).transpose(0, 1)
            v = att.self.value(x).view(n, self.heads, self.head_dim).transpose(0, 1)
            scores = torch.matmul(q, k.transpose(1, 2)) * scale + bias  # [heads, n, n]
            ctx = torch.matmul(torch.softmax(scores, dim=-1), v)  # [heads, n, head_dim]
            ctx = ctx.transpose(0, 1).reshape(n, self.heads * self.head_dim)
            x = att.output.LayerNorm(att.output.dense(ctx) + x)
            h = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(x))
            x = layer.output.LayerNorm(layer.output.dense(h) + x)
        weights = mask.to(x.dtype)[:, None]  # [n, 1]
        pooled = (x * weights).sum(0) / weights.sum().clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=0)  # [dim]


def _on(stream: Any) -> Any:
    """The CUDA work of a block on ``stream`` (None: where it is, on the CPU)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
