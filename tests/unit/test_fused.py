"""The fused forward (agentspec.engine.fused) on a tiny random bf16 Llama.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py turns it on before
Triton is imported). What is checked: the fused logits stay within bf16 rounding of the module
path; a row's logits and KV rows are bitwise the same whatever its forward's width, its draft
and the KV's capacity (and a kernel whose reduction depends on the width fails that check);
speculative decoding on the fused forward gives plain decoding's tokens; clear errors; the
fallback to the modules when a kernel fails before it ever ran.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentspec.config import SamplingParams
from agentspec.decoding.loop import NoDrafter
from agentspec.engine.fused import kernels
from agentspec.engine.target import HFTarget
from agentspec.protocols import DraftContext
from agentspec.scheduler import decode
from agentspec.types import Draft
from tests.solo import solo
from tests.tiny_model import TinyTokenizer

pytestmark = pytest.mark.skipif(
    not kernels.AVAILABLE or not (torch.cuda.is_available() or kernels.INTERPRETED),
    reason="needs Triton (on CUDA or in its interpreter)")

V = 256


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def target(model, **kw) -> HFTarget:
    # Narrow widths: the interpreter's time grows with a forward's rows.
    kw.setdefault("fused", True)
    if kw["fused"]:
        kw.setdefault("widths", (16,))
        kw.setdefault("prefill_widths", (32,))
    return HFTarget(model, TinyTokenizer(V), name="tiny", reuse_prefix=False, **kw)


PROMPT = [int(t) for t in np.random.default_rng(0).integers(1, V - 1, 70)]


def scored(t: HFTarget, prompt: list[int], draft: Draft) -> torch.Tensor:
    solo(t).start(prompt)
    return solo(t).score(prompt[-1], draft).clone()


def test_fused_logits_stay_within_bf16_rounding_of_the_modules(model):
    draft = Draft.chain(PROMPT[:12], "x")  # the modules' CPU widths score it in 16 rows too
    fused = scored(target(model), PROMPT, draft).float()
    modules = scored(target(model, fused=False), PROMPT, draft).float()
    scale = modules.abs().max().item()
    assert (fused - modules).abs().max().item() <= 0.02 * scale
    assert (fused.argmax(-1) == modules.argmax(-1)).float().mean().item() >= 0.9


def test_tree_rows_see_only_their_ancestors(model):
    # Two branches from the root: each branch's rows equal the same tokens scored as a chain.
    a, b = PROMPT[20:24], PROMPT[40:43]  # 1 + 7 rows: one 16-row forward
    tree = Draft((*a, *b), (-1, 0, 1, 2, -1, 4, 5), "x")
    rows = scored(target(model), PROMPT, tree)
    chain_a = scored(target(model), PROMPT, Draft.chain(a, "x"))
    chain_b = scored(target(model), PROMPT, Draft.chain(b, "x"))
    assert torch.equal(rows[: 1 + len(a)], chain_a)
    assert torch.equal(rows[1 + len(a) :], chain_b[1:])


def _rows_everywhere(model) -> list[torch.Tensor]:
    """A chain's logits scored after the prompt was written by forwards of other widths, with
    other drafts after it, over KVs of other capacities: all must be the same bits."""
    chain = PROMPT[50:56]
    out = []
    cases = [dict(widths=(16,), prefill_widths=()), dict(widths=(16, 32), prefill_widths=(64,)),
             dict(widths=(32,), prefill_widths=())]
    for n, kw in enumerate(cases):
        t = target(model, **kw)
        if n == 2:  # a larger pool, the sequence's blocks elsewhere in it
            others = [t.pool.allocate() for _ in range(5)]
            for block in others[::2]:
                t.pool.drop(block)
        junk = [PROMPT[n], PROMPT[n + 1]] * n
        logits = scored(t, PROMPT, Draft.chain(chain + junk, "x"))
        out.append(logits[: 1 + len(chain)])
        out.append(torch.stack(solo(t).seq.read(len(t.pool.keys) - 1, 69)))
    return out


def _assert_all_alike(rows: list[torch.Tensor]) -> None:
    logits, kv = rows[0::2], rows[1::2]
    for other in logits[1:]:
        assert torch.equal(logits[0], other)
    for other in kv[1:]:
        assert torch.equal(kv[0], other)


def test_a_row_is_the_same_bits_at_any_width_draft_and_capacity(model):
    _assert_all_alike(_rows_everywhere(model))


def test_the_invariance_check_catches_a_product_that_depends_on_the_width(model, monkeypatch):
    # A deliberately wrong fused forward: in forwards wider than 16 rows its output and down
    # products run split in two along their depth, each half rounded to bf16 before the halves
    # are added (a split-K product chosen by shape): the check must fail.
    real = kernels.matmul_add

    def split_k(a, weight, residual):
        if a.shape[0] <= 16:
            return real(a, weight, residual)
        k = a.shape[1] // 2
        halves = [(a[:, s].float() @ weight[:, s].float().T).to(a.dtype).float()
                  for s in (slice(0, k), slice(k, None))]
        out = (halves[0] + halves[1]).to(a.dtype).float()
        residual.copy_((residual.float() + out).to(residual.dtype))
        return None

    monkeypatch.setattr(kernels, "matmul_add", split_k)
    with pytest.raises(AssertionError):
        _assert_all_alike(_rows_everywhere(model))


class WrongThenRight:
    """Drafts that are partly wrong: the reference continuation with a corrupted token at a
    place that moves, and a tree whose first branch is wrong."""

    name = "wrong-then-right"

    def __init__(self, reference: list[int], prompt_len: int) -> None:
        self.reference, self.prompt_len, self.calls = reference, prompt_len, 0

    def begin(self, context: DraftContext) -> None:
        pass

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        self.calls += 1
        done = len(context.tokens) - self.prompt_len
        ahead = self.reference[done : done + min(max_tokens, 9)]
        if not ahead:
            return Draft()
        if self.calls % 3 == 0 and len(ahead) > 1:  # a tree: a wrong branch, then the right one
            wrong = (ahead[0] + 1) % (V - 1)
            return Draft((wrong, *ahead), (-1, *range(-1, len(ahead) - 1)), self.name)
        bad = list(ahead)
        bad[self.calls % len(bad)] = (bad[self.calls % len(bad)] + 7) % (V - 1)
        return Draft.chain(bad, self.name)

    def observe(self, context: DraftContext, draft: Draft, verdict) -> None:
        pass

    def end(self, context: DraftContext) -> None:
        pass


def _generate(t: HFTarget, drafter, prompt: list[int], n: int) -> list[int]:
    context = DraftContext(tokens=list(prompt), prompt_len=len(prompt))
    out: list[int] = []
    for step in decode(t, drafter, context, sampling=SamplingParams(), max_new_tokens=n,
                       stop_token_ids=frozenset()):
        out.extend(step.new_tokens)
    return out


def test_speculative_decoding_on_the_fused_forward_gives_plain_decodings_tokens(model):
    prompt = PROMPT[:30]
    plain = _generate(target(model), NoDrafter(), prompt, 16)
    drafter = WrongThenRight(plain, len(prompt))
    assert _generate(target(model), drafter, prompt, 16) == plain
    assert drafter.calls < 16  # drafts were accepted: fewer steps than tokens


def test_clear_errors_for_what_the_fused_forward_does_not_cover(model):
    with pytest.raises(ValueError, match="dtype"):
        target(tiny_llama(dtype=torch.float32))
    with pytest.raises(ValueError, match="multiples of 16"):
        target(model, widths=(8, 16))
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=64, n_layer=1, n_head=2)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="'gpt2'"):
        target(gpt2)


def test_a_fused_forward_that_fails_before_it_ever_ran_falls_back_to_the_modules(model, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this device")

    t = target(model)
    t.forward._fused_optional = True  # as a default target (fused=None) on CUDA is
    monkeypatch.setattr(kernels, "qkv_rope", broken)
    draft = Draft.chain(PROMPT[:5], "x")
    with pytest.warns(UserWarning, match="fused forward failed"):
        got = scored(t, PROMPT[:40], draft)
    assert t.forward.fused is None
    assert torch.equal(got, scored(target(model, fused=False), PROMPT[:40], draft))
    monkeypatch.undo()
    with pytest.raises(RuntimeError):  # asked for explicitly: no silent fallback
        monkeypatch.setattr(kernels, "qkv_rope", broken)
        scored(target(model), PROMPT[:40], draft)


def _three_sequences(t: HFTarget) -> list:
    """Members of three sequences of ``t``'s pool: a tree after a prompt past a block, a
    chain after a short prompt, and a prompt chunk of a new sequence (makers: a member is
    used once)."""
    from agentspec.engine.plan import Member, causal, draft_member

    seqs = [t.new_sequence() for _ in range(3)]
    for seq, prompt in zip(seqs, (PROMPT * 4, PROMPT[:30], []), strict=True):
        t.prefill(seq, [*prompt, 1])
    return [lambda: draft_member(seqs[0], 3, Draft((5, 6, 7, 8), (-1, 0, 0, 2), "x")),
            lambda: draft_member(seqs[1], 4, Draft.chain([9, 10, 11], "x")),
            lambda: Member(seqs[2], PROMPT[:20], list(range(20)), causal(20))]


def test_a_fused_forward_of_several_sequences_gives_each_its_rows_alone(model):
    """Each row tile holds one sequence's rows and reads only its blocks: three sequences'
    rows in one fused forward are the bits each gives alone."""
    t = target(model, widths=(16, 32, 64), prefill_widths=())
    makes = _three_sequences(t)
    alone = [t.run([make()])[0] for make in makes]
    together = t.run([make() for make in reversed(makes)])[::-1]
    for a, b in zip(alone, together, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)


def test_a_tile_that_reads_another_sequences_blocks_fails_that_check(model, monkeypatch):
    """The deliberately wrong staging: every row tile reads the first sequence's block table
    (as a kernel indexing tables by forward rather than by tile would)."""
    real = kernels.staging

    def first_table(ids, positions, slots, tiles, splits):
        tables = [t[3] for t in tiles if t[2]]
        wrong = [(kv, row0, n, tables[0] if n else table) for kv, row0, n, table in tiles]
        return real(ids, positions, slots, wrong, splits)

    t = target(model, widths=(16, 32, 64), prefill_widths=())
    makes = _three_sequences(t)
    alone = [t.run([make()])[0] for make in makes]
    monkeypatch.setattr(kernels, "staging", first_table)
    together = t.run([make() for make in reversed(makes)])[::-1]
    assert not all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
