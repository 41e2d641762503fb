"""Masks on demand (``GrammarState.constrain(lazy=True)``, :class:`LazyMasks`) against every
row's mask computed: the same drafts kept, the same per-token verdicts, the same greedy tokens.
No model: the real SmolLM2 tokenizer, random logits. A lazy mask that skips its check (the
argmax taken unmasked) fails the same comparison."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("llguidance")

from agentspec.decoding.sampling import greedy_host, greedy_tokens  # noqa: E402
from agentspec.grammar import state as g  # noqa: E402
from agentspec.types import Draft  # noqa: E402

TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}},
    {"name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}, "n": {"type": "integer"}}}}]
CALLS = ['[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
         '[{"name": "search", "arguments": {"q": "rust borrow checker", "n": 3}}]']


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from agentspec.engine.load import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct")[1]))


def _state(tok, choice: str = "required") -> g.GrammarState:
    grammar = g.Grammar.tool_calls(TOOLS, choice=choice, as_list=True)
    return g.GrammarState(grammar, tok, vocab_size=len(tok), eos_ids=[tok.eos_token_id])


def test_a_tokens_check_is_its_mask_bit(tok) -> None:
    """``allows`` (llguidance's check of one token, no mask) says what the mask says, at every
    state of a call, the stop token included (allowed only once the call is complete)."""
    rng = random.Random(0)
    state = _state(tok)
    ids = tok.encode(CALLS[0], add_special_tokens=False)
    for at in range(len(ids) + 1):
        state._grow(1)
        state.fill_row(0, None)
        mask = g.unpack_bits(state._bits[:1], state.vocab_size)[0]
        allowed = mask.nonzero().flatten().tolist()
        probe = rng.sample(allowed, min(40, len(allowed))) + [rng.randrange(len(tok)) for _ in range(80)]
        probe += [tok.eos_token_id] + ids
        for t in probe:
            assert state.allows(t, None, at == 0) == bool(mask[t]), (at, t)
        assert bool(mask[tok.eos_token_id]) == (at == len(ids))
        if at < len(ids):
            state.advance([ids[at]])
    state.close()


def _random_draft(rng: random.Random, ids: list[int], vocab: int, eos: int) -> Draft:
    """A tree: a prefix of the call, then maybe a wrong token or a stop token, plus
    alternatives off the spine (some right, some wrong)."""
    cut = rng.randrange(len(ids) + 1)
    spine = ids[:cut]
    if rng.random() < 0.5:
        spine.append(rng.choice([eos, rng.randrange(vocab), *ids]))
    tokens, parents = list(spine), list(range(-1, len(spine) - 1))
    for _ in range(rng.randrange(4)):
        parent = rng.randrange(-1, len(spine)) if spine else -1
        tokens.append(rng.choice([rng.randrange(vocab), ids[min(parent + 1, len(ids) - 1)]]))
        parents.append(parent)
    return Draft(tuple(tokens), tuple(parents), ("x",) * len(tokens)) if tokens else Draft()


def _logits(rng: random.Random, draft: Draft, walk: list[int], vocab: int,
            forbidden: list[int]) -> torch.Tensor:
    """Random rows whose argmax is, by chance, the walked token, a forbidden token or neither."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = torch.randn((draft.num_nodes + 1, vocab), generator=gen)
    for r in range(draft.num_nodes + 1):
        pick = rng.random()
        if pick < 0.4 and r < len(walk):
            logits[r, walk[r]] = 50.0
        elif pick < 0.8:
            logits[r, rng.choice(forbidden)] = 60.0
            if rng.random() < 0.5 and r < len(walk):
                logits[r, walk[r]] = 50.0  # the masked argmax: the second best
    return logits


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_lazy_masks_keep_the_same_drafts_and_the_same_greedy_tokens(tok, choice: str) -> None:
    rng = random.Random(choice)
    vocab, eos = len(tok), tok.eos_token_id
    lazy_state, full_state = _state(tok, choice), _state(tok, choice)
    forbidden = tok.encode(" hello world the", add_special_tokens=False)
    mismatches = 0
    for trial in range(60):
        ids = tok.encode(CALLS[trial % 2], add_special_tokens=False)
        committed = rng.randrange(len(ids) - 2) if trial % 3 else 0
        for state in (lazy_state, full_state):
            state.rollback(state._committed)
            state.advance(ids[:committed])
        draft = _random_draft(rng, ids[committed:], vocab, eos)
        room = rng.choice([0, 3, 40])
        force = rng.random() < 0.5
        out_l, lazy = lazy_state.constrain(draft, room=room, max_nodes=40, force=force, lazy=True)
        out_f, full = full_state.constrain(draft, room=room, max_nodes=40, force=force)
        assert out_l == out_f  # the same tokens kept, forced and pruned
        assert isinstance(lazy, g.LazyMasks) and isinstance(full, torch.Tensor)
        logits = _logits(rng, out_l, lazy.walk, vocab, forbidden)
        want = greedy_tokens(logits, full)
        assert torch.equal(greedy_tokens(logits, lazy), want)
        assert greedy_host(logits, lazy) == want.tolist()  # the verifier's one-copy path
        assert torch.equal(lazy.full(), full)
        mismatches += not torch.equal(logits.argmax(dim=-1), want)
    assert mismatches > 10  # the trials did put forbidden tokens on top


class _Unchecked(g.LazyMasks):
    """A deliberately wrong lazy mask: trusts every row's argmax."""

    def forbidding(self, tokens):
        return {}


def test_a_lazy_mask_that_trusts_the_argmax_fails_the_same_comparison(tok) -> None:
    rng = random.Random(1)
    state = _state(tok)
    ids = tok.encode(CALLS[0], add_special_tokens=False)
    forbidden = tok.encode(" hello world the", add_special_tokens=False)
    failures = 0
    for _ in range(20):
        draft = _random_draft(rng, ids, len(tok), tok.eos_token_id)
        out, full = state.constrain(draft, room=40, max_nodes=40)
        _, lazy = state.constrain(draft, room=40, max_nodes=40, lazy=True)
        wrong = _Unchecked(state, lazy.walk, lazy.num_rows)
        logits = _logits(rng, out, lazy.walk, len(tok), forbidden)
        failures += not torch.equal(greedy_tokens(logits, wrong), greedy_tokens(logits, full))
    assert failures > 5


def test_masks_of_a_past_step_are_refused(tok) -> None:
    state = _state(tok)
    ids = tok.encode(CALLS[1], add_special_tokens=False)
    _, lazy = state.constrain(Draft.chain(ids[:5], "x"), room=10, max_nodes=10, lazy=True)
    state.advance(ids[:2])
    with pytest.raises(g.GrammarError, match="moved past"):
        lazy.forbidding([0] * 6)
