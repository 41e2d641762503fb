"""After every step the KV gives the logits of a fresh prefill of the committed context."""

from __future__ import annotations

import pytest

from agentspec import SamplingParams, Speculator
from agentspec.bench.prompts import GROUNDED

from .helpers import CheckingTarget, OracleTreeDrafter


@pytest.mark.slow
def test_rollback_chains_and_trees(spec):
    target = CheckingTarget(spec.target.model, spec.target.tokenizer, atol=1e-4)
    prompt = GROUNDED[2]
    reference = list(Speculator(spec.target, speculate=False).generate(prompt, 12).token_ids)
    # Trees whose accepted path skips nodes, then prompt-lookup chains, then sampling.
    tree = Speculator(target, drafters=[OracleTreeDrafter(reference, target.vocab_size)])
    assert list(tree.generate(prompt, 12).token_ids) == reference
    Speculator(target).generate(GROUNDED[1], 12)
    Speculator(target).generate(GROUNDED[1], 8, sampling=SamplingParams(temperature=1.0, seed=3))
    assert target.checked_rows >= 30
