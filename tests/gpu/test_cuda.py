"""The CUDA path: bf16 on the GPU, greedy output equal to plain decoding through the same loop.

Marked ``gpu``; skipped where CUDA is not available (CI has no GPU).
"""

from __future__ import annotations

import pytest
import torch

from agentspec import Speculator
from tests.prompts import GROUNDED
from tests.solo import solo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def gpu_spec():
    return Speculator.from_pretrained("smollm2-135m-instruct", memory=None, device="cuda")


def test_loads_in_bf16_on_cuda(gpu_spec):
    param = next(gpu_spec.target.model.parameters())
    assert param.device.type == "cuda" and param.dtype == torch.bfloat16


def test_greedy_speculation_matches_plain_decoding_on_cuda(gpu_spec):
    plain = Speculator(gpu_spec.target, speculate=False, memory=None)
    for prompt in GROUNDED[:4]:
        assert gpu_spec.generate(prompt, 64).token_ids == plain.generate(prompt, 64).token_ids


def _scored(spec, prompt, tail: int, **target_kw) -> torch.Tensor:
    """The logits of a chain of the prompt's last ``tail`` tokens, scored after the prompt by a
    fresh target on ``spec``'s model (``target_kw``: HFTarget's options)."""
    from agentspec.engine.target import HFTarget
    from agentspec.types import Draft

    target = HFTarget(spec.target.model, spec.target.tokenizer, **target_kw)
    solo(target).start(prompt)
    return solo(target).score(prompt[-1], Draft.chain(prompt[-tail:], "x")).clone()


def test_cuda_graph_replays_bitwise_as_the_eager_forward(gpu_spec):
    prompt = gpu_spec.encode(GROUNDED[0])
    rows = [_scored(gpu_spec, prompt, 8, cuda_graphs=graphs) for graphs in (True, False)]
    assert torch.equal(rows[0], rows[1])


def test_drafts_and_prefix_reuse_leave_bf16_outputs_unchanged_on_cuda(gpu_spec):
    from agentspec.engine.target import HFTarget
    from tests.prompts import ALL_PROMPTS

    base = gpu_spec.target
    plain = Speculator(HFTarget(base.model, base.tokenizer, reuse_prefix=False), speculate=False, memory=None)
    spec = Speculator(HFTarget(base.model, base.tokenizer), memory=None)
    for prompt in ALL_PROMPTS:
        assert spec.generate(prompt, 48).token_ids == plain.generate(prompt, 48).token_ids


def test_prefix_cache_restores_the_rows_a_prefill_computes_on_cuda(gpu_spec):
    # Interleaved prompts of two long openings: each call after the first two finds its
    # opening among the pool's cached blocks (read in place by the captured graphs) and must
    # score the rows a fresh prefill does, bitwise.
    from agentspec.engine.target import HFTarget
    from agentspec.types import Draft
    from tests.prompts import ALL_PROMPTS

    base = gpu_spec.target
    cached = HFTarget(base.model, base.tokenizer)
    fresh = HFTarget(base.model, base.tokenizer, reuse_prefix=False)
    a, b = gpu_spec.encode(ALL_PROMPTS[0]), gpu_spec.encode(ALL_PROMPTS[1])
    for n, ids in enumerate([a + [11, 12], b + [13], a + [14, 15, 16], b + [17, 18]]):
        rows = []
        for target in (cached, fresh):
            solo(target).start(ids)
            rows.append(solo(target).score(ids[-1], Draft.chain(ids[3:6], "x")).clone())
        assert torch.equal(rows[0], rows[1]), f"call {n}"
    assert cached.prefix_stats.hits == 2


def test_a_worker_embedding_on_the_gpu_leaves_the_engines_captures_alone(gpu_spec):
    # The memory's worker thread embeds keys on the GPU (records written behind a call) while
    # the calls' thread may be capturing the engine's graphs: a prompt past 1,024 tokens needs
    # more attention splits (and may grow the pool), which captures them again. No capture may fail (the target would fall back to
    # eager forwards for good), and the output stays plain decoding's.
    import threading

    from agentspec.engine.target import HFTarget
    from agentspec.memory.embedder import MiniLMEmbedder

    embedder = MiniLMEmbedder(device="cuda")
    embedder.warmup()
    stop, errors = threading.Event(), []

    def embed_keys() -> None:
        i = 0
        while not stop.is_set():
            try:
                embedder.embed([f"user: call {i} of the agent " * (1 + i % 24)])
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return
            i += 1

    base = gpu_spec.target
    text = "\n\n".join(m["content"] for chat in GROUNDED for m in chat)
    prompt = [{"role": "user", "content": text * 2}]  # well past 1,024 tokens
    plain = Speculator(HFTarget(base.model, base.tokenizer, reuse_prefix=False), speculate=False, memory=None)
    want = plain.generate(prompt, 32).token_ids
    target = HFTarget(base.model, base.tokenizer)
    spec = Speculator(target, memory=None)
    spec.generate(GROUNDED[0], 8)  # graphs captured for a short sequence
    worker = threading.Thread(target=embed_keys)
    worker.start()
    try:
        got = spec.generate(prompt, 32).token_ids  # the KV grows: captured again
    finally:
        stop.set()
        worker.join()
    assert not errors and target.cuda_graphs  # every capture held
    assert got == want


def test_a_key_is_embedded_beside_the_default_streams_work_not_behind_it():
    # A lookup started ahead embeds its key while the target prefills: on a stream of its
    # own, the key's vector comes back while work queued before it on the default stream
    # still runs (on the default stream it would wait for all of it).
    import numpy as np

    from agentspec.memory.embedder import MiniLMEmbedder

    embedder = MiniLMEmbedder(device="cuda")
    embedder.warmup()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(400):  # tens of milliseconds of queued work on the default stream
        a = (a @ a).clamp_(-1, 1)
    vector = embedder.embed(["user: list the files in the project"])[0]
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "the key's embedding waited for the default stream's work"
    again = embedder.embed(["user: list the files in the project"])[0]
    np.testing.assert_allclose(vector, again, atol=1e-6)


def test_the_fused_forward_is_on_by_default_and_within_bf16_rounding_of_the_modules(gpu_spec):
    assert gpu_spec.target.fused is not None
    prompt = gpu_spec.encode(GROUNDED[1])
    rows = [_scored(gpu_spec, prompt, 12, fused=fused).float() for fused in (True, False)]
    scale = rows[1].abs().max().item()
    assert (rows[0] - rows[1]).abs().max().item() <= 0.05 * scale
    assert (rows[0].argmax(-1) == rows[1].argmax(-1)).float().mean().item() >= 0.9


def test_fused_rows_are_the_same_bits_at_any_width_and_capacity_on_cuda(gpu_spec):
    # A prompt written in 512-row chunks, in 64-row chunks, and after a long call that grew the
    # pool (its blocks elsewhere in it): the chain's logits and the prompt's KV rows are the
    # same bits.
    from agentspec.engine.target import HFTarget
    from agentspec.types import Draft
    from tests.prompts import ALL_PROMPTS

    base = gpu_spec.target
    prompt = gpu_spec.encode(ALL_PROMPTS[0])
    long = [t for p in ALL_PROMPTS for t in gpu_spec.encode(p)] * 2
    chain = Draft.chain(prompt[-6:], "x")
    out = []
    for n, kw in enumerate([dict(prefill_widths=(512,)), dict(prefill_widths=()),
                            dict(widths=(64,))]):
        target = HFTarget(base.model, base.tokenizer, reuse_prefix=False, **kw)
        if n == 2:
            solo(target).start(long[:3000])  # the pool grows past 3,000 positions
        solo(target).start(prompt)
        logits = solo(target).score(prompt[-1], chain).clone()
        k = solo(target).seq.read(len(target.pool.keys) - 1, len(prompt) - 1)[0]
        out.append((logits, k))
    for logits, k in out[1:]:
        assert torch.equal(logits, out[0][0]) and torch.equal(k, out[0][1])


def test_drafts_leave_outputs_unchanged_on_the_modules_too(gpu_spec):
    from agentspec.engine.target import HFTarget
    from tests.prompts import ALL_PROMPTS

    base = gpu_spec.target
    plain = Speculator(HFTarget(base.model, base.tokenizer, reuse_prefix=False, fused=False),
                       speculate=False, memory=None)
    spec = Speculator(HFTarget(base.model, base.tokenizer, fused=False), memory=None)
    for prompt in ALL_PROMPTS[:6]:
        assert spec.generate(prompt, 48).token_ids == plain.generate(prompt, 48).token_ids


def test_concurrent_calls_equal_their_solo_runs_on_cuda(gpu_spec):
    """Many calls at once share the fused forward's steps (row tiles of several sequences, one
    graph per width): every output is its solo run's, bitwise, greedy and seeded."""
    from tests.gpu.concurrent import concurrent_and_solo

    want, got, widths = concurrent_and_solo(gpu_spec.target)
    assert got == want
    assert max(widths) >= 8  # the calls shared forwards


def test_a_batched_fused_forward_gives_each_sequence_its_solo_rows_on_cuda(gpu_spec):
    """One fused forward of three sequences (a tree past a block, a chain, a prompt chunk) as a
    CUDA graph: each one's logits are the bits of its forward alone, graph and eager alike."""
    from agentspec.engine.plan import Member, causal, draft_member
    from agentspec.engine.target import HFTarget
    from agentspec.types import Draft

    base = gpu_spec.target
    out = {}
    for graphs in (True, False):
        target = HFTarget(base.model, base.tokenizer, reuse_prefix=False, cuda_graphs=graphs)
        seqs = [target.new_sequence() for _ in range(3)]
        for seq, n in zip(seqs, (300, 41, 0), strict=True):
            target.prefill(seq, list(range(5, 6 + n)))
        makes = [lambda s=seqs: draft_member(s[0], 7, Draft((5, 6, 7, 8), (-1, 0, 0, 2), "x")),
                 lambda s=seqs: draft_member(s[1], 9, Draft.chain([10, 11, 12], "x")),
                 lambda s=seqs: Member(s[2], list(range(20, 90)), list(range(70)), causal(70))]
        alone = [target.run([make()])[0] for make in makes]
        together = target.run([make() for make in reversed(makes)])[::-1]
        out[graphs] = together
        for a, b in zip(alone, together, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(out[True], out[False], strict=True):
        assert torch.equal(a, b)


FUSED_FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "phi3", "granite", "olmo2"]
"""Tiny random checkpoints of the Llama-like families (agentspec.bench.families)."""


def _family_rows(model, prompt, tail: int, **target_kw) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain of the prompt's last ``tail`` tokens scored after the prompt by a fresh target
    on ``model``: its logits and the last layer's KV of the prompt's last position."""
    from agentspec.engine.target import HFTarget
    from agentspec.types import Draft
    from tests.tiny_model import TinyTokenizer

    target = HFTarget(model, TinyTokenizer(256), name="tiny", reuse_prefix=False, **target_kw)
    solo(target).start(prompt)
    logits = solo(target).score(prompt[-1], Draft.chain(prompt[-tail:], "x")).clone()
    kv = torch.stack(solo(target).seq.read(len(target.pool.keys) - 1, len(prompt) - 1))
    return logits, kv


@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_each_fused_family_is_on_by_default_close_to_its_modules_and_the_same_bits_at_any_width(family):
    """On CUDA each family's fused forward is chosen by default, stays within bf16 rounding of
    its modules, replays as a graph the bits of the eager forward, and gives a row the same
    bits whatever the widths that wrote its prompt and scored it."""
    import numpy as np

    from agentspec.bench.families import tiny_model
    from agentspec.engine.fused.llama import select

    model = tiny_model(family).cuda()
    assert select(model, required=False) is not None
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 255, 300)]
    graph = _family_rows(model, prompt, 12)
    eager = _family_rows(model, prompt, 12, cuda_graphs=False)
    modules = _family_rows(model, prompt, 12, fused=False)
    assert torch.equal(graph[0], eager[0]) and torch.equal(graph[1], eager[1])
    got, want = graph[0].float(), modules[0].float()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 0.05 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
    for kw in (dict(prefill_widths=(512,)), dict(prefill_widths=()), dict(widths=(64,))):
        other = _family_rows(model, prompt, 12, **kw)
        assert torch.equal(other[0], graph[0]) and torch.equal(other[1], graph[1]), kw


@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_speculative_decoding_on_each_fused_family_gives_plain_decodings_tokens_on_cuda(family):
    import numpy as np

    from agentspec.bench.families import tiny_model
    from agentspec.decoding.loop import NoDrafter
    from agentspec.engine.target import HFTarget
    from tests.tiny_model import TinyTokenizer
    from tests.unit.test_fused import WrongThenRight, _generate

    model = tiny_model(family).cuda()
    prompt = [int(t) for t in np.random.default_rng(4).integers(1, 255, 40)]

    def fresh() -> HFTarget:
        return HFTarget(model, TinyTokenizer(256), name="tiny", reuse_prefix=False)

    plain = _generate(fresh(), NoDrafter(), prompt, 24)
    drafter = WrongThenRight(plain, len(prompt))
    assert _generate(fresh(), drafter, prompt, 24) == plain
    assert drafter.calls < 24
