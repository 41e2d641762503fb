"""The native forward over a GGUF's weights as stored (``forward.cpp``): one call a forward.

:class:`~agentspec.engine.forward.Forward` hands its members here when the model's weights are
held as the file stores them and its layers are Llama's (:func:`unsupported` says where not);
the modules' path runs every other model. The members' rows are not padded to a width: every
operation computes a row alone (see ``forward.cpp``), so any number of rows gives a row the
same bits, and the forward runs exactly its rows. The KV pool holds float16 keys and values
where the build has the attention for them (:func:`kv_dtype`), the keys in transposed runs of
16 positions (``KVPool.define_layers``' ``key_lanes``), as that attention reads them.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from agentspec.engine import compat
from agentspec.engine.plan import Member
from agentspec.engine.pool import BLOCK, KVPool
from agentspec.engine.quant import native
from agentspec.engine.quant.formats import QuantWeight
from agentspec.engine.quant.model import QuantEmbedding, QuantLinear

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""The ``model_type`` values the native forward runs: Llama's layer (Qwen2's with its query,
key and value biases, Qwen3's with an RMSNorm over each query and key head before the rotary
embedding)."""

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _QW(ctypes.Structure):
    _fields_ = [("q", _ptr), ("scale", _ptr), ("offset", _ptr), ("bias", _ptr), ("n", _i64),
                ("k", _i64), ("bits", ctypes.c_int32), ("gs", ctypes.c_int32),
                ("params", ctypes.c_int32), ("pad", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [*((name, _QW) for name in ("q", "k", "v", "o", "gate", "up", "down")),
                ("norm_in", _ptr), ("norm_mlp", _ptr), ("norm_q", _ptr), ("norm_k", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("dim", _i64), ("inter", _i64), ("vocab", _i64), ("block", _i64),
                ("kv_half", _i64),
                ("eps", _f32), ("scale", _f32), ("layer", _ptr), ("norm", _ptr), ("head", _ptr),
                ("embed", _ptr), ("cos", _ptr), ("sin", _ptr)]


class _Batch(ctypes.Structure):
    _fields_ = [("rows", _i64), ("ids", _ptr), ("pos", _ptr), ("member", _ptr),
                ("index", _ptr), ("kv", _ptr), ("nrows", _ptr), ("table_at", _ptr),
                ("tables", _ptr), ("anc_at", _ptr), ("anc", _ptr), ("logit_count", _i64),
                ("logit_rows", _ptr), ("keys", _ptr), ("values", _ptr)]


def unsupported(model: Any, *, held: bool = True) -> str | None:
    """Why ``model`` cannot run the native forward, or None when it can; with ``held`` False,
    whether its layers could once its weights are held (quantized or bfloat16 tables)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"architecture {kind!r} (native: {', '.join(FAMILIES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window and (layer_types is None or "sliding_attention" in layer_types) and (
            kind not in ("qwen2", "qwen3") or getattr(config, "use_sliding_window", False)):
        return f"sliding-window attention (window {window})"
    base = compat.base_model(model)
    if held and not isinstance(base.embed_tokens, QuantEmbedding):
        return "an embedding not held as stored"
    if held and not isinstance(model.get_output_embeddings(), QuantLinear):
        return "an output layer not held as stored"
    if not held and type(base.embed_tokens) is not torch.nn.Embedding:
        return "an embedding that is more than a lookup"
    for layer in base.layers:
        a, f = layer.self_attn, layer.mlp
        products = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, f.gate_proj, f.up_proj, f.down_proj)
        if held and not all(isinstance(p, QuantLinear) and isinstance(p.qweight, QuantWeight)
                            for p in products):
            return "a product not held as stored for the CPU's products"
        if any(p.bias is not None for p in products[3:]):
            return "a bias on the output or MLP products"
        if hasattr(a, "q_norm") != (kind == "qwen3"):
            return "a head norm where Qwen3's layer has none, or none where it has one"
    heads = int(config.num_attention_heads)
    if heads // int(getattr(config, "num_key_value_heads", None) or heads) > 16:
        return "more than 16 query heads a key/value head"
    dim = int(base.layers[0].self_attn.head_dim)
    if dim > 256:
        return f"head_dim {dim} (at most 256)"
    if dim % 16 or int(config.hidden_size) % 16:
        return f"head_dim {dim} / hidden {config.hidden_size} (multiples of 16)"
    return None


def kv_dtype(model: Any) -> torch.dtype:
    """The KV pool's dtype under the native forward: float16 where this machine's build has
    the key-lane attention for the model's head size (half the bytes a step reads; a row's keys
    and values rounded once, as they are written), else float32."""
    dim = int(compat.base_model(model).layers[0].self_attn.head_dim)
    return torch.float16 if native.library().as_kv_half(dim) else torch.float32


def _qw(weight: QuantWeight, bias: torch.Tensor | None = None) -> _QW:
    return _QW(weight.q.data_ptr(), weight.scale.data_ptr(), weight.offset_ptr,
               None if bias is None else bias.data_ptr(), weight.n, weight.k, weight.bits,
               weight.group, weight.params, 0)


def _linear(module: QuantLinear) -> _QW:
    assert isinstance(module.qweight, QuantWeight)  # unsupported() says where not
    return _qw(module.qweight, None if module.bias is None else module.bias.detach())


class NativeForward:
    """The native forward of one model over ``pool``."""

    def __init__(self, model: Any, pool: KVPool) -> None:
        config, base = model.config, compat.base_model(model)
        self.model, self.pool, self.base = model, pool, base
        attn0 = base.layers[0].self_attn
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.dim, self.hidden = int(attn0.head_dim), int(config.hidden_size)
        self.vocab = int(model.get_output_embeddings().out_features)
        self.max_positions = int(getattr(config, "max_position_embeddings", 2048))
        self.kv_dtype = kv_dtype(model)
        # The key-lane attention reads its keys as the pool keeps them: runs of 16 transposed.
        self.key_lanes = 16 if self.kv_dtype == torch.float16 else 0
        layers = []
        for layer in base.layers:
            a, f = layer.self_attn, layer.mlp
            layers.append(_Layer(*(_linear(p) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                                          f.gate_proj, f.up_proj, f.down_proj)),
                                 layer.input_layernorm.weight.data_ptr(),
                                 layer.post_attention_layernorm.weight.data_ptr(),
                                 *(n.weight.data_ptr() if n is not None else None
                                   for n in (getattr(a, "q_norm", None),
                                             getattr(a, "k_norm", None)))))
        self._layers = (_Layer * len(layers))(*layers)
        self._head = _linear(model.get_output_embeddings())
        self._embed = _qw(base.embed_tokens.qweight)
        eps = float(base.layers[0].input_layernorm.variance_epsilon)
        self._model = _Model(len(layers), self.hidden, self.heads, self.kv_heads, self.dim,
                             int(config.intermediate_size), self.vocab, BLOCK,
                             int(self.kv_dtype == torch.float16), eps,
                             float(attn0.scaling), ctypes.addressof(self._layers),
                             base.norm.weight.data_ptr(), ctypes.addressof(self._head),
                             ctypes.addressof(self._embed), None, None)
        self._positions = 0
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pool_at: tuple[int, Any, Any] = (-1, None, None)

    def _rotary(self, needed: int) -> None:
        """The rotary embedding's own tables (cos, sin) for positions up to ``needed``."""
        if needed <= self._positions:
            return
        count = min(max(needed, 2 * self._positions, 1024), self.max_positions)
        if needed > count:
            raise ValueError(f"position {needed - 1} is past the model's "
                             f"{self.max_positions} positions")
        positions = torch.arange(count)[None]
        with torch.inference_mode():
            cos, sin = self.base.rotary_emb(torch.zeros(1), positions)
        self._tables = (cos[0].float().contiguous(), sin[0].float().contiguous())
        self._positions = count
        self._model.cos, self._model.sin = (t.data_ptr() for t in self._tables)

    def _pool_pointers(self) -> tuple[Any, Any]:
        if self._pool_at[0] != self.pool.generation or self._pool_at[1] is None:
            keys = (_ptr * len(self.pool.keys))(*(k.data_ptr() for k in self.pool.keys))
            values = (_ptr * len(self.pool.values))(*(v.data_ptr() for v in self.pool.values))
            self._pool_at = (self.pool.generation, keys, values)
        return self._pool_at[1], self._pool_at[2]

    def run(self, members: list[Member], hidden: bool) -> tuple[list[torch.Tensor | None],
                                                               list[torch.Tensor | None]]:
        """Each member's logits (None where it wants none) and, with ``hidden``, its final
        hidden rows; the rows' keys and values written at ``kv_len + row`` of each sequence."""
        ids: list[int] = []
        pos: list[int] = []
        member: list[int] = []
        index: list[int] = []
        kv: list[int] = []
        nrows: list[int] = []
        table_at: list[int] = []
        tables: list[int] = []
        anc_at: list[int] = []
        logit_rows: list[int] = []
        anc_parts: list[np.ndarray] = []
        at_anc = 0
        for i, m in enumerate(members):
            n, start = len(m.ids), m.seq.kv_len
            m.seq.reserve(start + n)
            m.row0, m.kv_len = len(ids), start
            if m.logits:
                logit_rows += range(len(ids), len(ids) + n)
            ids += m.ids
            pos += [start + d for d in m.depth]
            member += [i] * n
            index += range(n)
            kv.append(start)
            nrows.append(n)
            table_at.append(len(tables))
            tables += m.seq.table
            anc_at.append(at_anc)
            anc_parts.append(np.ascontiguousarray(m.anc, dtype=np.uint8).reshape(-1))
            at_anc += n * n
        self._rotary(max(pos) + 1)
        arrays = [np.asarray(a, dtype=np.int64) for a in
                  (ids, pos, member, index, kv, nrows, table_at, tables, anc_at, logit_rows)]
        anc = np.concatenate(anc_parts) if anc_parts else np.zeros(1, dtype=np.uint8)
        keys, values = self._pool_pointers()
        batch = _Batch(len(ids), *(a.ctypes.data for a in arrays[:9]), anc.ctypes.data,
                       len(logit_rows), arrays[9].ctypes.data, ctypes.addressof(keys),
                       ctypes.addressof(values))
        logits = torch.empty((len(logit_rows), self.vocab), dtype=torch.float32)
        rows_out = torch.empty((len(logit_rows), self.hidden)) if hidden else None
        native.library().as_forward(ctypes.addressof(self._model), ctypes.addressof(batch),
                                    logits.data_ptr(),
                                    None if rows_out is None else rows_out.data_ptr(),
                                    native.threads())
        out: list[torch.Tensor | None] = []
        kept: list[torch.Tensor | None] = []
        at = 0
        for m in members:
            n = len(m.ids)
            if not m.logits:
                out.append(None)
                kept.append(None)
                continue
            out.append(logits[at : at + n])
            kept.append(None if rows_out is None else rows_out[at : at + n])
            at += n
        return out, kept
