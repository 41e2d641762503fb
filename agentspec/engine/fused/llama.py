"""The fused forward of a Llama-like decoder over the engine's fixed KV.

The same computation as transformers' ``LlamaForCausalLM`` under the engine's mask, written
out over the model's weights in six kernels a layer (:mod:`.kernels`, :mod:`.attention`): the
query, key and value heads in one product (their weights concatenated once, the modules'
weights re-pointed into the concatenation, so no weight is held twice) with RMSNorm before it
and rotary embedding and the KV write after it; attention in key splits and their combination;
the output product with the residual add; gate and up in one product with RMSNorm before and
SiLU-and-multiply after; the down product with the residual add. Every product is a Triton
kernel of fixed tiles, so a row's bits do not depend on the forward's width: prompt chunks can
be wider than decoding steps and still write the rows a step would. A CUDA graph of it replays
about two hundred kernels where the module path's holds thousands.

The families beside Llama (:data:`FAMILIES`) differ in a few places, each read from the
model's own modules and config: Qwen2's query/key/value bias; Qwen3's RMSNorm of each query
and key head before the rotation; OLMo 2's norms after the products instead of before them
(:mod:`.post_norm`); Granite's embedding and residual multipliers, attention scale and logits
scaling; Phi-3's query/key/value and gate/up weights stored packed (used in place). Llama 3's
rope scaling, and any other static one, is in the rotary embedding's tables, which are the
model's own.

The module path stays the reference: the tests compare the two within bf16 rounding, and the
engine's invariance tests hold on both.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from agentspec.engine import compat
from agentspec.engine.fused import attention, kernels, post_norm
from agentspec.engine.fused.kernels import Norm
from agentspec.engine.quant.tiles import TileWeight


@dataclass(frozen=True)
class Family:
    """Where a family's decoder layer differs from Llama's (what the fused forward reads)."""

    packed: bool = False  # query/key/value and gate/up weights stored as one each (Phi-3)
    head_norm: str = ""  # "head": q/k RMSNorm over each head (Qwen3); "whole": over all (OLMo 2)
    post_norms: bool = False  # norms after attention and MLP, none before them (OLMo 2)
    multipliers: bool = False  # embedding/residual multipliers and logits scaling (Granite)


FAMILIES: dict[str, Family] = {
    "llama": Family(), "mistral": Family(), "qwen2": Family(),
    "qwen3": Family(head_norm="head"),
    "olmo2": Family(head_norm="whole", post_norms=True),
    "granite": Family(multipliers=True),
    "phi3": Family(packed=True),
}
"""The ``model_type`` values the fused forward covers: Llama's layer (rotary attention with
grouped key/value heads, a SiLU-gated MLP, RMSNorm) and what each family changes in it."""

NOT_FUSED: dict[str, str] = {
    "gemma3_text": "Gemma 3's layer has norms around each block with (1 + weight) RMSNorm, a "
                   "GELU-gated MLP, a scaled embedding and sliding-window layers",
    "gemma2": "Gemma 2's layer has norms around each block with (1 + weight) RMSNorm, a "
              "GELU-gated MLP, soft-capped attention and logits and sliding-window layers",
}
"""Families the engine loads that the fused forward does not cover, and why."""

_FUSED: weakref.WeakKeyDictionary[Any, FusedLlama] = weakref.WeakKeyDictionary()


def unsupported(model: Any) -> str | None:
    """Why ``model`` cannot run the fused forward, or None when it can."""
    if not kernels.AVAILABLE:
        return "Triton is not installed"
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    family = FAMILIES.get(str(kind))
    if family is None:
        why = NOT_FUSED.get(str(kind), "it is not one of the Llama-like layers")
        return (f"architecture {kind!r} has no fused forward: {why} (fused: "
                f"{', '.join(FAMILIES)})")
    reason = _config_problem(config) or _layers_problem(model, config, family)
    if reason is not None:
        return reason
    param = next(model.parameters())
    if param.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {param.dtype} (the fused kernels run bf16 and fp16)"
    if param.device.type != "cuda" and not kernels.INTERPRETED:
        return "Triton kernels need CUDA (or TRITON_INTERPRET=1)"
    return None


def _config_problem(config: Any) -> str | None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        return f"activation {act!r} (the fused MLP is SiLU-gated)"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    # Mistral and Phi-3 window every layer when the config names a window; Qwen2 and Qwen3
    # only the layers their layer_types call sliding.
    if window and (layer_types is None or "sliding_attention" in layer_types):
        return f"sliding-window attention (window {window}; the fused attention sees all keys)"
    heads = int(config.num_attention_heads)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if dim < 32 or dim & (dim - 1):
        return f"head_dim {dim} (the fused kernels take powers of two from 32)"
    sizes = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
             "num_attention_heads * head_dim": heads * dim}
    for name, size in sizes.items():
        if int(size) % kernels.BLOCK_K:
            return f"{name} {size} (the fused products take multiples of {kernels.BLOCK_K})"
    return None


def _layers_problem(model: Any, config: Any, family: Family) -> str | None:
    base = getattr(model, "model", None)  # compat.base_model, without its fallback
    layers = getattr(base, "layers", None)
    rotary = getattr(base, "rotary_emb", None)
    if layers is None or rotary is None:
        return "no decoder layers where a Llama keeps them"
    rope = str(getattr(rotary, "rope_type", "default"))
    if rope in ("dynamic", "longrope"):
        return f"rope scaling {rope!r} depends on the length"
    heads = int(config.num_attention_heads)
    for layer in layers:
        reason = _layer_problem(layer, family, heads)
        if reason is not None:
            return reason
    dim = int(layers[0].self_attn.head_dim)
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is not None and 2 * inv_freq.numel() != dim:
        return (f"partial rotary embedding ({2 * inv_freq.numel()} of head_dim {dim}; the "
                f"fused rotation covers whole heads)")
    return None


_PRODUCTS = {False: (("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")),
             True: (("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj"))}


def _layer_problem(layer: Any, family: Family, heads: int) -> str | None:
    """Why a decoder layer is not the family's, or None."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    linear, ffn = _PRODUCTS[family.packed]
    if attn is None or mlp is None or not all(hasattr(attn, n) for n in linear) or not all(
            hasattr(mlp, n) for n in ffn):
        return "a decoder layer unlike Llama's"
    norms = (("post_attention_layernorm", "post_feedforward_layernorm") if family.post_norms
             else ("input_layernorm", "post_attention_layernorm"))
    if not all(hasattr(layer, n) for n in norms):
        return f"a decoder layer without the norms its family places ({', '.join(norms)})"
    if family.post_norms and hasattr(layer, "input_layernorm"):
        return "a norm before attention where the family normalises after it"
    dim = int(attn.head_dim)
    if family.head_norm:
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        want = dim if family.head_norm == "head" else heads * dim
        if q_norm is None or k_norm is None or q_norm.weight.numel() != want:
            got = q_norm.weight.numel() if q_norm is not None else 0
            return f"a query norm of {got} weights where the family's has {want}"
        if q_norm.variance_epsilon != k_norm.variance_epsilon:
            return "query and key norms of different epsilons (the fused kernels take one)"
    elif hasattr(attn, "q_norm"):
        return "a query/key norm Llama's layer does not have"
    if any(getattr(mlp, n).bias is not None for n in ffn) or attn.o_proj.bias is not None:
        return "a bias on the output or MLP products"
    return None


def select(model: Any, *, required: bool) -> FusedLlama | None:
    """The fused forward of ``model`` (built once per model; forks share it), or None where
    the model is not covered and the forward is not ``required``.

    Raises:
        ValueError: ``required`` and the model is not covered (the message says why,
            :func:`unsupported`).
    """
    reason = unsupported(model)
    if reason is not None:
        if required:
            raise ValueError(f"no fused forward for this model: {reason}; run it on the "
                             f"modules (fused=False)")
        return None
    fused = _FUSED.get(model)
    if fused is None:
        fused = _FUSED[model] = FusedLlama(model)
    return fused


def _concat(modules: list[Any]) -> tuple[torch.Tensor | TileWeight, torch.Tensor | None]:
    """The modules' weights (and biases) concatenated by output row, dense ones as one tensor,
    ones held quantized as one :class:`TileWeight`; each module's weight and bias becomes a
    view into the concatenation (held once, the same values: the module path is unchanged)."""
    weight: torch.Tensor | TileWeight
    if isinstance(getattr(modules[0], "qweight", None), TileWeight):
        weight = TileWeight.stacked([m.qweight for m in modules])
        like = weight.scale.new_zeros(0, dtype=weight.dtype)
    else:
        weight = like = torch.cat([m.weight.detach() for m in modules])
    bias = None
    if any(m.bias is not None for m in modules):
        bias = torch.cat([m.bias.detach() if m.bias is not None else like.new_zeros(m.out_features)
                          for m in modules])
    row = 0
    for m in modules:
        if isinstance(weight, TileWeight):
            m.qweight = weight.view_rows(row, row + m.out_features)
        else:
            m.weight.data = weight[row : row + m.out_features]
        if m.bias is not None and bias is not None:
            m.bias.data = bias[row : row + m.out_features]
        row += m.out_features
    return weight, bias


def _weight(module: Any) -> torch.Tensor | TileWeight:
    """A product's weight as the kernels take it: a dense one's tensor, a quantized one's
    :class:`TileWeight`."""
    held = getattr(module, "qweight", None)
    return held if isinstance(held, TileWeight) else module.weight.detach()


def _norm(module: Any) -> Norm:
    return module.weight.detach(), float(module.variance_epsilon)


@dataclass
class _Layer:
    """One decoder layer's weights as the kernels take them; a norm the family does not
    place is None."""

    qkv: torch.Tensor | TileWeight  # [(heads + 2 * kv_heads) * dim, hidden]: q, k, v stacked
    qkv_bias: torch.Tensor | None
    out: torch.Tensor | TileWeight
    gate_up: torch.Tensor | TileWeight  # [2 * intermediate, hidden]: gate, up stacked
    down: torch.Tensor | TileWeight
    norm_in: Norm | None = None  # before attention (Llama's input_layernorm)
    norm_mlp_in: Norm | None = None  # before the MLP (Llama's post_attention_layernorm)
    head_norms: tuple[Norm, Norm] | None = None  # the queries' and keys' (q_norm, k_norm)
    norm_attn_out: Norm | None = None  # after attention (OLMo 2's post_attention_layernorm)
    norm_mlp_out: Norm | None = None  # after the MLP (OLMo 2's post_feedforward_layernorm)


def _layer(layer: Any, family: Family) -> _Layer:
    a, f = layer.self_attn, layer.mlp
    if family.packed:  # used in place: stacked as the kernels take them already
        qkv, qkv_bias = a.qkv_proj.weight.detach(), a.qkv_proj.bias
        qkv_bias = qkv_bias.detach() if qkv_bias is not None else None
        gate_up = f.gate_up_proj.weight.detach()
    else:
        qkv, qkv_bias = _concat([a.q_proj, a.k_proj, a.v_proj])
        gate_up, _ = _concat([f.gate_proj, f.up_proj])
    out = _Layer(qkv, qkv_bias, _weight(a.o_proj), gate_up, _weight(f.down_proj))
    if family.head_norm:
        out.head_norms = (_norm(a.q_norm), _norm(a.k_norm))
    if family.post_norms:
        out.norm_attn_out = _norm(layer.post_attention_layernorm)
        out.norm_mlp_out = _norm(layer.post_feedforward_layernorm)
    else:
        out.norm_in = _norm(layer.input_layernorm)
        out.norm_mlp_in = _norm(layer.post_attention_layernorm)
    return out


class FusedLlama:
    """The fused forward over one model's weights (see the module's docstring)."""

    def __init__(self, model: Any) -> None:
        config = model.config
        base = compat.base_model(model)
        self.family = FAMILIES[config.model_type]
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        attn0 = base.layers[0].self_attn
        self.dim = int(attn0.head_dim)
        self.scale = float(attn0.scaling)  # Granite's: its attention_multiplier
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        with torch.no_grad():
            self.layers = [_layer(layer, self.family) for layer in base.layers]
            self.norm = _norm(base.norm)
            # The rotary embedding's own tables (its inv_freq and attention scaling: Llama 3's
            # and any other static scaling included), one row a position.
            positions = torch.arange(int(config.max_position_embeddings), device=self.device)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = base.rotary_emb(probe, positions[None])
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [positions, dim]
        multipliers = self.family.multipliers
        self.embed_scale = float(config.embedding_multiplier) if multipliers else 1.0
        self.residual_scale = float(config.residual_multiplier) if multipliers else 1.0
        self.logits_divisor = float(config.logits_scaling) if multipliers else 1.0
        self.embed = base.embed_tokens
        self.head = _weight(model.get_output_embeddings())

    def scratch(self, width: int, splits: int) -> tuple[torch.Tensor, ...]:
        """Attention's split state for forwards of ``width`` rows over sequences of up to
        ``splits`` pool blocks."""
        return attention.attention_scratch(width, self.heads, self.dim, splits, self.device)

    def forward(self, ins: torch.Tensor, anc: torch.Tensor, width: int, pool: Any,
                scratch: tuple[torch.Tensor, ...], first_logits: int | None = None) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one forward: ``ins`` is the staging of its ``width``
        rows (:func:`~agentspec.engine.fused.kernels.staging`: ids, positions, pool slots, the
        row tiles' sequences and block tables), ``anc`` ``[width, width]`` which of the
        forward's rows each row sees. Rows are written into ``pool`` (a
        :class:`~agentspec.engine.pool.KVPool`) at their slots. ``first_logits``: only the
        first rows' tiles' logits (the rest are prompt chunks)."""
        residual = self.embed(ins[:width])  # [width, hidden]: the residual stream, in place
        if self.embed_scale != 1.0:
            residual = residual * self.embed_scale
        layer_forward = self._post_norm_layer if self.family.post_norms else self._layer
        for i, layer in enumerate(self.layers):
            layer_forward(layer, residual, ins, anc, pool.keys[i], pool.values[i], scratch)
        return kernels.norm_matmul(residual, self.norm, self.head, first_logits,
                                   one_rounding=self.family.post_norms,
                                   divisor=self.logits_divisor)

    def _layer(self, layer: _Layer, residual: torch.Tensor, ins: torch.Tensor,
               anc: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scratch: tuple[torch.Tensor, ...]) -> None:
        # Llama's placement: norms before attention and before the MLP.
        assert layer.norm_in is not None
        q = kernels.qkv_rope(residual, *layer.norm_in, layer.qkv, layer.qkv_bias, ins,
                             self.cos, self.sin, keys, values, self.heads, self.kv_heads,
                             head_norms=layer.head_norms)
        att = attention.attention(q, keys, values, anc, ins, self.scale, scratch)
        self._add(att, layer.out, residual)
        act = kernels.norm_gate_up(residual, layer.norm_mlp_in, layer.gate_up)
        self._add(act, layer.down, residual)

    def _add(self, a: torch.Tensor, weight: torch.Tensor | TileWeight,
             residual: torch.Tensor) -> None:
        if self.residual_scale == 1.0:
            kernels.matmul_add(a, weight, residual)
        else:
            kernels.matmul_add(a, weight, residual, scale=self.residual_scale)

    def _post_norm_layer(self, layer: _Layer, residual: torch.Tensor, ins: torch.Tensor,
                         anc: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         scratch: tuple[torch.Tensor, ...]) -> None:
        # OLMo 2's placement: the products take the residual stream as it is; the queries and
        # keys are normalised over their whole projections, each block's output before its add.
        assert layer.head_norms is not None
        assert layer.norm_attn_out is not None and layer.norm_mlp_out is not None
        qkv = kernels.norm_matmul(residual, None, layer.qkv, bias=layer.qkv_bias)
        q = post_norm.qk_norm_rope(qkv, *layer.head_norms, ins, self.cos, self.sin, keys,
                                   values, self.heads, self.kv_heads)
        att = attention.attention(q, keys, values, anc, ins, self.scale, scratch)
        post_norm.norm_add(kernels.norm_matmul(att, None, layer.out), layer.norm_attn_out,
                           residual)
        act = kernels.norm_gate_up(residual, None, layer.gate_up)
        post_norm.norm_add(kernels.norm_matmul(act, None, layer.down), layer.norm_mlp_out,
                           residual)
