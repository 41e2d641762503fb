"""The fused forward (agentspec.engine.fused) on the Llama-like families beside Llama.

Tiny random bf16 checkpoints of each family, built from transformers' configs
(:mod:`agentspec.bench.families`: two layers, hidden size 64, every norm weight and bias drawn
at random). Without CUDA the kernels run in Triton's interpreter (tests/conftest.py turns it
on). For each family, as tests/unit/test_fused.py does for Llama: the fused logits stay within
bf16 rounding of the modules and so does every layer's KV; a row's logits and KV are bitwise
the same whatever its forward's width; speculative decoding on the fused forward gives plain
decoding's tokens. Each family's difference from Llama left out of the fused forward (its
bias, its q/k norms, its norm placement, its multipliers, its packed weights' order, its rope
scaling) fails the first check; a product whose reduction depends on the width, in the
kernels OLMo 2's placement adds, fails the second. A family the fused forward does not cover
is refused with the reason and runs on the modules.
"""

from __future__ import annotations

import copy
import dataclasses
from functools import cache

import numpy as np
import pytest
import torch

from agentspec.bench.families import tiny_config, tiny_model
from agentspec.decoding.loop import NoDrafter
from agentspec.engine.fused import kernels
from agentspec.engine.fused.llama import FAMILIES, FusedLlama, select, unsupported
from agentspec.engine.target import HFTarget
from agentspec.types import Draft
from tests.solo import solo
from tests.tiny_model import TinyTokenizer
from tests.unit.test_fused import WrongThenRight, _generate

pytestmark = [
    pytest.mark.skipif(not kernels.AVAILABLE or not (torch.cuda.is_available() or kernels.INTERPRETED),
                       reason="needs Triton (on CUDA or in its interpreter)"),
    pytest.mark.usefixtures("one_thread"),
]

V = 256
FAMILY_NAMES = ["llama3", "qwen2", "qwen3", "mistral", "phi3", "granite", "olmo2"]
DIFFERING = [f for f in FAMILY_NAMES if f != "mistral"]
"""The families whose fused forward differs from Llama's (Mistral's layer is Llama's, its
sliding window refused: it is compared with its modules only; tests/unit/test_fused.py runs
the rest on Llama)."""
PROMPT = [int(t) for t in np.random.default_rng(1).integers(1, V - 1, 40)]
CHAIN = PROMPT[24:32]

LOGITS_TOLERANCE = 0.02
"""Largest logit difference from the modules, as a share of the largest logit: bf16 rounding
(one unit in the last place is 0.4 %) through two layers stays under it; each family's
difference left out lands well above it, or above the KV's."""

KV_TOLERANCE = 0.04
"""Largest key or value difference from the modules in a layer, as a share of its largest."""


@cache
def model(family: str):
    return tiny_model(family)


def target(m, **kw) -> HFTarget:
    # One decode width and no prompt widths by default: the target skips its width probes,
    # which would triple the interpreter's forwards.
    kw.setdefault("fused", True)
    if kw["fused"]:
        kw.setdefault("widths", (16,))
        kw.setdefault("prefill_widths", ())
    return HFTarget(m, TinyTokenizer(V), name="tiny", reuse_prefix=False, **kw)


def scored(t: HFTarget, junk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain's logits after the prompt's first 24 tokens, and every layer's prompt KV
    ``[layers, 2, kv_heads, 23, dim]``; ``junk``: more draft rows after the chain's (a wider
    forward)."""
    prompt = PROMPT[:24]
    solo(t).start(prompt)
    draft = Draft.chain(CHAIN + [PROMPT[0], PROMPT[1]] * (junk // 2), "x")
    logits = solo(t).score(prompt[-1], draft)[: 1 + len(CHAIN)].clone()
    kv = torch.stack([torch.stack(solo(t).seq.read(layer, len(prompt) - 1))
                      for layer in range(len(t.pool.keys))])
    return logits, kv


@cache
def modules_rows(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    return scored(target(model(family), fused=False))


@cache
def fused_rows(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    return scored(target(model(family)))


def assert_close_to_modules(rows: tuple[torch.Tensor, torch.Tensor], family: str) -> None:
    logits, kv = (r.float() for r in rows)
    want_logits, want_kv = (r.float() for r in modules_rows(family))
    scale = want_logits.abs().max().item()
    assert (logits - want_logits).abs().max().item() <= LOGITS_TOLERANCE * scale
    assert (logits.argmax(-1) == want_logits.argmax(-1)).float().mean().item() >= 0.9
    for layer, (got, want) in enumerate(zip(kv, want_kv, strict=True)):
        error = (got - want).abs().max().item() / want.abs().max().item()
        assert error <= KV_TOLERANCE, f"layer {layer}'s KV is {error:.3f} off the modules'"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_fused_forward_stays_within_bf16_rounding_of_the_modules(family):
    m = model(family)
    assert unsupported(m) is None
    assert select(m, required=True).family == FAMILIES[m.config.model_type]
    assert_close_to_modules(fused_rows(family), family)


def _default_rope(fused: FusedLlama, m) -> dict:
    """Rotary tables without Llama 3's scaling (the default rope of the same base)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = copy.deepcopy(m.config)
    config.rope_parameters = {"rope_type": "default",
                              "rope_theta": m.config.rope_parameters["rope_theta"]}
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=fused.dtype),
                                            torch.arange(fused.cos.shape[0])[None])
    return {"cos": cos[0].contiguous(), "sin": sin[0].contiguous()}


def _left_out(family: str, fused: FusedLlama, m) -> dict:
    """The fused forward's attributes with the family's difference from Llama left out."""
    def layers(**change) -> list:
        return [dataclasses.replace(layer, **{k: f(layer) for k, f in change.items()})
                for layer in fused.layers]

    def swapped(w: torch.Tensor) -> torch.Tensor:
        n = w.shape[0] // 2
        return torch.cat([w[n:], w[:n]])

    return {
        "llama3": lambda: _default_rope(fused, m),
        "qwen2": lambda: {"layers": layers(qkv_bias=lambda _: None)},
        "qwen3": lambda: {"layers": layers(head_norms=lambda _: None)},
        # Llama's placement with OLMo 2's norms: before the products, no q/k norm.
        "olmo2": lambda: {"family": FAMILIES["llama"],
                          "layers": layers(norm_in=lambda la: la.norm_attn_out,
                                           norm_mlp_in=lambda la: la.norm_mlp_out,
                                           head_norms=lambda _: None)},
        "granite": lambda: {"embed_scale": 1.0, "residual_scale": 1.0, "logits_divisor": 1.0,
                            "scale": fused.dim ** -0.5},
        "phi3": lambda: {"layers": layers(gate_up=lambda la: swapped(la.gate_up))},
    }[family]()


@pytest.mark.parametrize("family", DIFFERING)
def test_the_check_fails_a_fused_forward_that_leaves_the_familys_difference_out(family):
    m = model(family)
    t = target(m)
    wrong = copy.copy(t.forward.fused.fused)
    for name, value in _left_out(family, t.forward.fused.fused, m).items():
        setattr(wrong, name, value)
    t.forward.fused.fused = wrong
    with pytest.raises(AssertionError):
        assert_close_to_modules(scored(t), family)


def _wide_rows(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain's rows with the prompt written by one 32-row forward (its last rows in
    another row tile) and the chain scored in another beside 16 junk rows, against 16-row
    forwards for both in :func:`fused_rows`."""
    return scored(target(model(family), widths=(32,)), junk=16)


@pytest.mark.parametrize("family", DIFFERING)
def test_a_row_is_the_same_bits_at_any_width(family):
    narrow, wide = fused_rows(family), _wide_rows(family)
    assert torch.equal(narrow[0], wide[0])
    assert torch.equal(narrow[1], wide[1])


def test_the_width_check_catches_a_post_norm_product_that_depends_on_the_width(monkeypatch):
    # A deliberately wrong plain product (OLMo 2's query/key/value, output and down products):
    # in forwards wider than 16 rows it runs split in two along its depth, each half rounded
    # to bf16 before the halves are added. The rows then differ with the width.
    real = kernels.norm_matmul

    def split_k(x, norm, weight, first=None, **kw):
        if norm is not None or x.shape[0] <= 16:
            return real(x, norm, weight, first, **kw)
        k = x.shape[1] // 2
        halves = [(x[:, s].float() @ weight[:, s].float().T).to(x.dtype).float()
                  for s in (slice(0, k), slice(k, None))]
        out = halves[0] + halves[1]
        if kw.get("bias") is not None:
            out = out + kw["bias"].float()
        return out.to(x.dtype)

    narrow = fused_rows("olmo2")
    monkeypatch.setattr(kernels, "norm_matmul", split_k)
    wide = _wide_rows("olmo2")
    assert not (torch.equal(narrow[0], wide[0]) and torch.equal(narrow[1], wide[1]))


@pytest.mark.parametrize("family", DIFFERING)
def test_speculative_decoding_on_the_fused_forward_gives_plain_decodings_tokens(family):
    prompt = PROMPT[:14]  # one 16-row forward
    plain = _generate(target(model(family)), NoDrafter(), prompt, 6)
    drafter = WrongThenRight(plain, len(prompt))
    assert _generate(target(model(family)), drafter, prompt, 6) == plain
    assert drafter.calls < 6  # drafts were accepted: fewer steps than tokens


def _variant(family: str, **changes) -> object:
    """A one-layer bf16 model of ``family`` with config fields changed (never run)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, layers=1)
    for name, value in changes.items():
        setattr(config, name, value)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


@pytest.mark.parametrize(("family", "changes", "reason"), [
    ("mistral", {"sliding_window": 32}, "sliding-window attention"),
    ("phi3", {"sliding_window": 2047}, "sliding-window attention"),
    ("granite", {"hidden_act": "gelu"}, "activation 'gelu'"),
    ("phi3", {"hidden_size": 192, "intermediate_size": 192}, "head_dim 96"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope scaling 'dynamic'"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.5}}, "partial rotary"),
    ("qwen3", {"attention_bias": True}, "bias on the output"),
])
def test_unsupported_names_why_a_family_member_runs_on_the_modules(family, changes, reason):
    m = _variant(family, **changes)
    assert reason in (unsupported(m) or "")
    assert select(m, required=False) is None
    with pytest.raises(ValueError, match="fused=False"):
        select(m, required=True)


def test_a_family_without_a_fused_forward_is_refused_with_its_reason_and_runs_the_modules():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=32, max_position_embeddings=256, pad_token_id=0)
    gemma = Gemma3ForCausalLM(config).to(torch.bfloat16).eval()
    assert "Gemma 3's layer" in (unsupported(gemma) or "")
    with pytest.raises(ValueError, match="gemma3_text"):
        target(gemma)
    t = target(gemma, fused=False)
    assert t.forward.fused is None
    solo(t).start(PROMPT[:10])
    assert solo(t).score(PROMPT[9], Draft.chain(PROMPT[10:12], "x")).shape == (3, V)


def test_the_checkpoints_differ_where_the_families_do():
    # The left-out checks above mean something only if each tiny checkpoint carries its
    # family's difference with values that matter.
    assert all(model(f).config.model_type in FAMILIES for f in FAMILY_NAMES)
    assert model("llama3").config.rope_parameters["rope_type"] == "llama3"
    qwen2 = model("qwen2").model.layers[0].self_attn
    assert qwen2.q_proj.bias is not None and qwen2.q_proj.bias.abs().max() > 0
    granite = model("granite").config
    assert granite.embedding_multiplier != 1 and granite.residual_multiplier != 1
    assert granite.logits_scaling != 1 and granite.attention_multiplier != 32 ** -0.5
    for family in ("qwen3", "olmo2"):
        q_norm = model(family).model.layers[0].self_attn.q_norm.weight
        assert (q_norm != 1).any()


def test_the_architecture_table_marks_fused_exactly_the_families_covered():
    from agentspec.engine import compat

    marked = {a.model_type for a in compat.ARCHITECTURES.values() if a.fused}
    assert marked == set(FAMILIES) & set(compat.ARCHITECTURES)
