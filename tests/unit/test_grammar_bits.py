"""Two grammar seams without a model: the bitmask unpacking and the compiled-grammar cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from agentspec.grammar import compiled  # noqa: E402
from agentspec.grammar.tokenizer import unpack_bits


def _reference(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token t is allowed iff bit ``t & 31`` of word ``t >> 5`` is set: one token at a time."""
    words = bits.tolist()
    return torch.tensor([[bool((row[t >> 5] >> (t & 31)) & 1) for t in range(vocab_size)]
                         for row in words])


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100, 49152])
def test_unpack_bits_reads_bit_t_of_word_t_over_32(vocab_size: int) -> None:
    rng = np.random.default_rng(vocab_size)
    words = (vocab_size + 31) // 32
    bits = torch.from_numpy(rng.integers(-2**31, 2**31, size=(3, words), dtype=np.int64)
                            .astype(np.int32))
    bits[1] = 0
    bits[2, 0] = -1  # all 32 bits of the first word, the sign bit included
    out = unpack_bits(bits, vocab_size)
    assert out.dtype == torch.bool and out.shape == (3, vocab_size)
    if vocab_size <= 100:
        assert torch.equal(out, _reference(bits, vocab_size))
    else:  # spot-check a large vocabulary at a thousand tokens
        tokens = rng.integers(0, vocab_size, size=1000)
        for t in tokens:
            assert bool(out[0, t]) == bool((int(bits[0, t >> 5]) >> (int(t) & 31)) & 1)
    assert not out[1].any()


def test_a_wrong_bit_order_fails_the_same_check() -> None:
    bits = torch.tensor([[0b1011, -(1 << 31)]], dtype=torch.int32)  # token 63: the sign bit
    flipped = torch.from_numpy(np.unpackbits(bits.numpy().view(np.uint8), axis=-1)[:, :64].copy()).bool()
    assert not torch.equal(flipped, _reference(bits, 64))  # big-endian bit order reads other tokens
    assert torch.equal(unpack_bits(bits, 64), _reference(bits, 64))


def test_compiled_keeps_the_schemas_property_order() -> None:
    """The grammar writes properties in the schema's order; the cache must not sort them."""
    spec = {"type": "json_schema", "schema": {"type": "object", "properties": {
        "setup": {"type": "string"}, "punchline": {"type": "string"}}}}
    schema = json.loads(compiled(spec).spec)["grammars"][0]["json_schema"]
    assert list(schema["properties"]) == ["setup", "punchline"]
    reordered = {"type": "json_schema", "schema": {"type": "object", "properties": {
        "punchline": {"type": "string"}, "setup": {"type": "string"}}}}
    other = json.loads(compiled(reordered).spec)["grammars"][0]["json_schema"]
    assert list(other["properties"]) == ["punchline", "setup"]  # a distinct grammar, not a cache hit


def test_example_values_follow_the_schema() -> None:
    from agentspec.grammar import Grammar
    from agentspec.grammar.spec import example_value

    schema = {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "opt": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}}
    assert example_value(schema) == {"city": "example", "unit": "c", "days": 1,
                                     "tags": ["example"], "opt": True}
    grammar = Grammar.tool_calls([{"name": "w", "parameters": schema}], as_list=True)
    assert grammar.examples == ('[{"name": "w", "arguments": {"city": "example", "unit": "c", '
                                '"days": 1, "tags": ["example"], "opt": true}}]',)
    assert grammar == Grammar.tool_calls([{"name": "w", "parameters": schema}], as_list=True)


def test_warmed_masks_equal_the_masks_a_cold_matcher_computes() -> None:
    """The examples' walk fills the per-grammar mask cache; a call walked on the warmed
    grammar gets, row for row, the masks of a grammar that was never warmed."""
    from transformers import AutoTokenizer

    from agentspec.engine.load import resolve_model_dir
    from agentspec.grammar import state as g
    from agentspec.types import Draft

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct")[1]))
    tools = [{"name": n, "parameters": {"type": "object", "required": ["q"], "properties": {
        "q": {"type": "string"}, "n": {"type": "integer"}}}} for n in ("search_web", "search_docs")]
    warm = g.Grammar.tool_calls(tools, as_list=True)
    # The same language in another grammar text (its own caches), never warmed.
    cold = g.Grammar.tool_calls(tools[::-1], as_list=True)
    object.__setattr__(cold, "examples", ())
    ids = tok.encode('[{"name": "search_docs", "arguments": {"q": "rust borrow", "n": 3}}]',
                     add_special_tokens=False)
    masks = {}
    for name, grammar in (("warm", warm), ("cold", cold)):
        state = g.GrammarState(grammar, tok, vocab_size=len(tok), eos_ids=[tok.eos_token_id])
        cached = sum(1 for _ in _trie_nodes(state._shared.root) if _[0] is not None)
        assert (cached > 10) == (name == "warm")  # the examples' paths were cached
        out, masks[name] = state.constrain(Draft.chain(ids, "x"), room=len(ids), max_nodes=len(ids),
                                           force=False)
        assert out.num_nodes == len(ids)
        state.close()
    assert torch.equal(masks["warm"], masks["cold"])


def _trie_nodes(node):
    yield node
    for child in node[1].values():
        yield from _trie_nodes(child)


def test_a_spent_mask_budget_drops_the_least_recently_used_grammars_masks(monkeypatch) -> None:
    """Past 3/4 of the budget a new request drops the masks of the grammars used longest ago
    (never the ones it needs first); a dropped grammar warms again on its next use."""
    from transformers import AutoTokenizer

    from agentspec.engine.load import resolve_model_dir
    from agentspec.grammar import state as g
    from agentspec.grammar import tokenizer as gt

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct")[1]))
    words = (len(tok) + 31) // 32
    grammars = [g.Grammar.tool_calls([{"name": f"tool_{k}", "parameters": {"type": "object", "properties": {
        "x": {"type": "string"}}}}], as_list=True) for k in range(3)]

    def use(grammar):
        state = g.GrammarState(grammar, tok, vocab_size=len(tok), eos_ids=[tok.eos_token_id])
        shared = state._shared
        state.close()
        return shared

    monkeypatch.setattr(gt, "_SHARED", type(gt._SHARED)())
    monkeypatch.setattr(gt, "_cached_bytes", 0)
    first = use(grammars[0])
    per_grammar = first.cached_bytes
    assert per_grammar >= 10 * words * 4  # the warm-up cached the skeleton's masks
    # Room for two grammars' masks under 3/4 of the budget, not three.
    monkeypatch.setattr(gt, "MASK_CACHE_BYTES", (per_grammar * 5 // 2) * 4 // 3)
    second = use(grammars[1])
    assert first.warmed and second.warmed
    third = use(grammars[2])
    assert not first.warmed and first.cached_bytes == 0 and first.root == [None, {}]
    assert second.warmed and third.warmed
    assert gt._cached_bytes == second.cached_bytes + third.cached_bytes
    assert use(grammars[0]) is first and first.warmed  # warmed again; now second is the oldest
    assert not second.warmed and third.warmed
