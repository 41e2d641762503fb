"""Two grammar seams without a model: the bitmask unpacking and the compiled-grammar cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from agentspec.grammar import compiled, unpack_bits  # noqa: E402


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
