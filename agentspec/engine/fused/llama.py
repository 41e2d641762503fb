"""The fused forward of a Llama-family decoder over the engine's fixed KV.

The same computation as transformers' ``LlamaForCausalLM`` under the engine's mask, written
out over the model's weights in six kernels a layer (:mod:`.kernels`): the query, key and value
heads in one product (their weights concatenated once, the modules' weights re-pointed into
the concatenation, so no weight is held twice) with RMSNorm before it and rotary embedding and
the KV write after it; attention in key splits and their combination; the output product with
the residual add; gate and up in one product with RMSNorm before and SiLU-and-multiply after;
the down product with the residual add. Every product is a Triton kernel of fixed tiles, so a
row's bits do not depend on the forward's width: prompt chunks can be wider than decoding
steps and still write the rows a step would. A CUDA graph of it replays under two hundred
kernels where the module path's holds thousands.

The module path stays the reference: the tests compare the two within bf16 rounding, and the
engine's invariance tests hold on both.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from agentspec.engine import compat
from agentspec.engine.fused import kernels

FAMILIES = tuple(a.model_type for a in compat.ARCHITECTURES.values() if a.fused)
"""The ``model_type`` values the fused forward covers (the Llama layer: pre-norm RMSNorm,
rotary attention with grouped key/value heads, a SiLU-gated MLP)."""

_FUSED: weakref.WeakKeyDictionary[Any, FusedLlama] = weakref.WeakKeyDictionary()


def unsupported(model: Any) -> str | None:
    """Why ``model`` cannot run the fused forward, or None when it can."""
    if not kernels.AVAILABLE:
        return "Triton is not installed"
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"architecture {kind!r} has no fused forward (fused: {', '.join(FAMILIES)})"
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        return f"activation {act!r} (the fused MLP is SiLU-gated)"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", kind == "mistral"):
        return "sliding-window attention"
    scaling = getattr(config, "rope_scaling", None) or {}
    if scaling.get("rope_type", scaling.get("type", "default")) in ("dynamic", "longrope"):
        return f"rope scaling {scaling.get('rope_type', scaling.get('type'))!r} depends on the length"
    param = next(model.parameters())
    if param.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {param.dtype} (the fused kernels run bf16 and fp16)"
    base = getattr(model, "model", None)  # compat.base_model, without its fallback
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(base, "rotary_emb"):
        return "no decoder layers where a Llama keeps them"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or hasattr(attn, "q_norm") or not all(
                hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or not all(
                hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "a decoder layer unlike Llama's"
        if any(m.bias is not None for m in (attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                             mlp.down_proj)):
            return "a bias on the output or MLP products"
    if param.device.type != "cuda" and not kernels.INTERPRETED:
        return "Triton kernels need CUDA (or TRITON_INTERPRET=1)"
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
            raise ValueError(f"no fused forward for this model: {reason}")
        return None
    fused = _FUSED.get(model)
    if fused is None:
        fused = _FUSED[model] = FusedLlama(model)
    return fused


def _concat(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The modules' weights (and biases) concatenated by output row; each module's weight
    becomes a view into the concatenation (the same values: the module path is unchanged)."""
    weight = torch.cat([m.weight.detach() for m in modules])
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(m.out_features)
                          for b, m in zip(biases, modules, strict=True)])
    row = 0
    for m in modules:
        m.weight.data = weight[row : row + m.out_features]
        if m.bias is not None and bias is not None:
            m.bias.data = bias[row : row + m.out_features]
        row += m.out_features
    return weight, bias


@dataclass
class _Layer:
    norm_in: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    out: torch.Tensor
    norm_post: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    eps_in: float
    eps_post: float


class FusedLlama:
    """The fused forward over one model's weights (see the module's docstring)."""

    def __init__(self, model: Any) -> None:
        config = model.config
        base = compat.base_model(model)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        attn0 = base.layers[0].self_attn
        self.dim = int(attn0.head_dim)
        self.scale = float(attn0.scaling)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.layers: list[_Layer] = []
        with torch.no_grad():
            for layer in base.layers:
                a, f = layer.self_attn, layer.mlp
                qkv, qkv_bias = _concat([a.q_proj, a.k_proj, a.v_proj])
                gate_up, _ = _concat([f.gate_proj, f.up_proj])
                self.layers.append(_Layer(
                    layer.input_layernorm.weight.detach(), qkv, qkv_bias,
                    a.o_proj.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                    gate_up, f.down_proj.weight.detach(),
                    float(layer.input_layernorm.variance_epsilon),
                    float(layer.post_attention_layernorm.variance_epsilon)))
            self.norm = base.norm.weight.detach()
            self.norm_eps = float(base.norm.variance_epsilon)
            positions = torch.arange(int(config.max_position_embeddings), device=self.device)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = base.rotary_emb(probe, positions[None])
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [positions, dim]
        self.embed = base.embed_tokens
        self.head = model.get_output_embeddings().weight.detach()

    def scratch(self, width: int, splits: int) -> tuple[torch.Tensor, ...]:
        """Attention's split state for forwards of ``width`` rows over sequences of up to
        ``splits`` pool blocks."""
        return kernels.attention_scratch(width, self.heads, self.dim, splits, self.device)

    def forward(self, ins: torch.Tensor, anc: torch.Tensor, width: int, pool: Any,
                scratch: tuple[torch.Tensor, ...], first_logits: int | None = None) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one forward: ``ins`` is the staging of its ``width``
        rows (:func:`~agentspec.engine.fused.kernels.staging`: ids, positions, pool slots, the
        row tiles' sequences and block tables), ``anc`` ``[width, width]`` which of the
        forward's rows each row sees. Rows are written into ``pool`` (a
        :class:`~agentspec.engine.pool.KVPool`) at their slots. ``first_logits``: only the
        first rows' tiles' logits (the rest are prompt chunks)."""
        h, kvh = self.heads, self.kv_heads
        residual = self.embed(ins[:width])  # [width, hidden]: the residual stream, in place
        for i, layer in enumerate(self.layers):
            keys, values = pool.keys[i], pool.values[i]
            q = kernels.qkv_rope(residual, layer.norm_in, layer.eps_in, layer.qkv,
                                 layer.qkv_bias, ins, self.cos, self.sin, keys, values, h, kvh)
            att = kernels.attention(q, keys, values, anc, ins, self.scale, scratch)
            kernels.matmul_add(att, layer.out, residual)
            act = kernels.norm_gate_up(residual, layer.norm_post, layer.eps_post, layer.gate_up)
            kernels.matmul_add(act, layer.down, residual)
        return kernels.norm_matmul(residual, self.norm, self.norm_eps, self.head, first_logits)
