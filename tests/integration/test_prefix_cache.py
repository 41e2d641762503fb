"""The pool's cached blocks are exactly the rows a prefill computes (real model, fp32 and bf16).

Calls of two agents (two BFCL tool sets) interleave through one target, so every call after
the first two finds its system prompt's rows among the pool's cached blocks, not in its
sequence; each call's logits, the prompt's last row and a draft's rows, must equal bitwise
those of a target that prefills every prompt from scratch. bf16 is where a row computed after
other tokens would show.

The same file shows the check can fail: a pool that finds a block by its own tokens and its
position, whatever came before it, hands out rows computed after another prefix, and the
logits differ.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
import torch

from agentspec import Speculator
from agentspec.engine.load import load_target
from agentspec.engine.pool import BLOCK, KVPool
from agentspec.engine.target import HFTarget
from agentspec.tree import common_prefix_len
from agentspec.types import Draft
from tests.integration.helpers import modules_bf16_target
from tests.prompts import DATA, prompt_of, workload_lines
from tests.solo import solo

pytestmark = pytest.mark.slow

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PREFIX = 3 * BLOCK + 17  # tokens of each agent's system prompt kept (a tail off the blocks)


@functools.cache
def _model(dtype: str) -> HFTarget:
    if dtype == "bf16":  # the modules' path in bfloat16 (load_target's runs the native forward)
        return modules_bf16_target()
    return load_target("smollm2-135m-instruct", device="cpu", dtype=DTYPES[dtype])


@functools.cache
def _agents() -> tuple[list[int], list[int]]:
    """The opening tokens of two tool sets' prompts from the shipped bfcl-live workload."""
    target = _model("fp32")
    spec = Speculator(target, speculate=False, memory=None)
    lines = workload_lines(DATA / "bfcl-live.jsonl")
    first, second = lines[0], next(i for i in lines if i["scope"] != lines[0]["scope"])
    return (spec.encode(prompt_of(first))[:PREFIX], spec.encode(prompt_of(second))[:PREFIX])


def _rows(target: HFTarget, ids: list[int]) -> torch.Tensor:
    solo(target).start(ids)
    return solo(target).score(ids[-1], Draft.chain([ids[3], ids[4], ids[5]], "test")).clone()


def _pair(dtype: str) -> tuple[HFTarget, HFTarget]:
    base = _model(dtype)
    cached = HFTarget(base.model, base.tokenizer, name="cached")
    fresh = HFTarget(base.model, base.tokenizer, name="fresh", reuse_prefix=False)
    return cached, fresh


def _calls() -> list[list[int]]:
    a, b = _agents()
    tails = [[1000 + 7 * i + j for j in range(3 + i)] for i in range(4)]
    return [a + tails[0], b + tails[1], a + tails[2], b + tails[3]]


# fp32 in `make test-long`: bf16 here, and both dtypes on every family's tiny checkpoint in
# test_families (prefix reuse bitwise a fresh prefill's).
@pytest.mark.parametrize("dtype", [pytest.param(d, marks=pytest.mark.long) if d == "fp32" else d
                                   for d in DTYPES])
def test_restored_rows_are_the_rows_a_prefill_computes(dtype: str) -> None:
    cached, fresh = _pair(dtype)
    for n, ids in enumerate(_calls()):
        assert torch.equal(_rows(cached, ids), _rows(fresh, ids)), f"call {n} ({dtype})"
        if n >= 2:  # the agent's system prompt came from the pool's cached blocks (its full
            # blocks held by reference, its tail taken over), not from the sequence
            assert solo(cached).reused_tokens == PREFIX
    stats = cached.prefix_stats
    a, b = _agents()
    shared = common_prefix_len(a, b)  # the chat template's opening: held by the sequence
    assert stats.hits == 2 and stats.reused_tokens == 2 * (PREFIX - shared)


class _TokensAndPositionOnly(KVPool):
    """Deliberately wrong: a block is found by its tokens and position alone."""

    def match(self, ids: Sequence[int]) -> tuple[list[int], int, int]:
        def depth(block: int) -> int:
            parent = self.trie._key[block][0]
            return 0 if parent < 0 else 1 + depth(parent)

        found = {(depth(b), key): b for b, (_, key) in self.trie._key.items() if len(key) == BLOCK}
        chain: list[int] = []
        for index, start in enumerate(range(0, len(ids) - BLOCK + 1, BLOCK)):
            block = found.get((index, tuple(ids[start : start + BLOCK])))
            if block is None:
                break
            chain.append(block)
        return chain, -1, 0


@pytest.mark.parametrize("wrong", [False, True])
def test_a_block_is_reused_only_after_its_own_prefix(wrong: bool) -> None:
    cached, fresh = _pair("fp32")
    if wrong:
        cached.pool.__class__ = _TokensAndPositionOnly
    a, b = _agents()
    x, y, shared = a[:BLOCK], b[:BLOCK], a[BLOCK : 3 * BLOCK]
    _rows(cached, y + b[BLOCK : 3 * BLOCK] + [11])  # seals y as a first block
    _rows(cached, x + shared + [12])  # seals the shared blocks after x
    # After y, the shared blocks' rows are not the ones computed after x: only y is reused.
    third = y + shared + [13]
    same = torch.equal(_rows(cached, third), _rows(fresh, third))
    assert same != wrong
    assert solo(cached).reused_tokens == (3 * BLOCK if wrong else BLOCK)


def test_a_generation_reports_the_prompt_tokens_it_did_not_compute(spec: Speculator) -> None:
    a, b = _agents()
    text = spec.tokenizer.decode(a)
    other = spec.tokenizer.decode(b)
    first = spec.generate(text + " Reply in one word.", max_new_tokens=4)
    spec.generate(other + " Reply in one word.", max_new_tokens=4)
    again = spec.generate(text + " Reply in one word.", max_new_tokens=4)
    assert again.token_ids == first.token_ids
    assert again.stats.cached_tokens >= PREFIX // BLOCK * BLOCK
    assert again.stats.as_dict()["cached_tokens"] == again.stats.cached_tokens


def test_measuring_the_cost_curve_leaves_nothing_in_the_prefix_cache(tmp_path) -> None:
    from agentspec.engine.cost import measure_cost

    cached, _ = _pair("fp32")
    a, _ = _agents()
    _rows(cached, a)
    sealed = cached.prefix_stats.sealed_blocks
    for _ in range(2):  # measured, then read from its file after a probe
        measure_cost(cached, sizes=(0, 7), context=3 * BLOCK, repeats=1,
                     cache_file=tmp_path / "cost.json")
    assert cached.prefix_stats.sealed_blocks == sealed  # no synthetic row was sealed
    assert solo(cached).holds(a)  # and the target's own sequence is as it was
    _rows(cached, a)
    assert solo(cached).reused_tokens == len(a) - 1
