"""After every step the KV gives the logits of a fresh prefill of the committed context.

"Fresh" is transformers' own forward (its SDPA attention, MKL products), not the engine's
kernels, so rows agree to float32 rounding, not bitwise: ATOL is 1e-3 on logits of magnitude
~20 (30 layers of float32 rounding reach 1.1e-4). A rollback error is a row that attended a
rejected token, off by far more: the last test shows a target that keeps rejected draft rows
failing the check.
"""

from __future__ import annotations

import pytest

from agentspec import SamplingParams, Speculator
from agentspec.drafters.policy import DEFAULT_COST
from agentspec.types import Verdict
from tests.prompts import GROUNDED
from tests.solo import solo

from .helpers import CheckingTarget, OracleTreeDrafter

ATOL = 1e-3


def _oracle_tree(spec, target, prompt, max_new: int):
    """Plain decoding's output, and a Speculator on ``target`` whose trees hide it off the spine."""
    reference = list(Speculator(spec.target, speculate=False, memory=None).generate(prompt, max_new).token_ids)
    return reference, Speculator(target, drafters=[OracleTreeDrafter(reference, target.vocab_size)],
                                 cost=DEFAULT_COST, memory=None)


# long (make test-long): in make test, test_invariance's every-verified-row check holds each
# row after rollbacks, the families matrix walks trees off the spine, and the rest of this file
# checks reused prefixes row by row with its no-rollback control.
@pytest.mark.slow
@pytest.mark.long
def test_rollback_chains_and_trees(spec):
    target = CheckingTarget(spec.target.model, spec.target.tokenizer, atol=ATOL)
    # Trees whose accepted path skips nodes, then prompt-lookup chains, then sampling.
    reference, tree = _oracle_tree(spec, target, GROUNDED[2], 12)
    assert list(tree.generate(GROUNDED[2], 12).token_ids) == reference
    Speculator(target, cost=DEFAULT_COST, memory=None).generate(GROUNDED[1], 12)
    Speculator(target, cost=DEFAULT_COST, memory=None).generate(GROUNDED[1], 8, sampling=SamplingParams(temperature=1.0, seed=3))
    assert target.checked_rows >= 30


@pytest.mark.slow
def test_prefix_reuse_across_calls_is_exact(spec):
    """An agent's next call extends the last one: its shared prefix is not prefilled again, and
    every scored row still equals a fresh forward of its whole prefix."""
    target = CheckingTarget(spec.target.model, spec.target.tokenizer, atol=ATOL)
    first = [{"role": "system", "content": "You answer in one short sentence."},
             {"role": "user", "content": "Name a primary colour."}]
    reply = Speculator(target, cost=DEFAULT_COST, memory=None).generate(first, 8).text
    second = first + [{"role": "assistant", "content": reply},
                      {"role": "user", "content": "And another one?"}]
    prefilled: list[int] = []
    hook = target.model.register_forward_pre_hook(
        lambda _m, args, kwargs: prefilled.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        ids = Speculator(target, cost=DEFAULT_COST, memory=None).encode(second)
        solo(target).start(ids)
    finally:
        hook.remove()
    assert prefilled and prefilled[0] < len(ids) - 1 - 20  # most of the prompt was kept
    Speculator(target, cost=DEFAULT_COST, memory=None).generate(second, 8)  # checks every row against a fresh forward


class _NoRollback(CheckingTarget):
    """The deliberately wrong rollback: the committed length moves past every draft row, the
    rejected ones too, so the next forward attends tokens that were never accepted."""

    def run(self, members, **kw):
        for m in members:  # each scored sequence keeps its rejected rows once it commits
            _keep_rejected(m.seq, m.ids[1:])
        return super().run(members, **kw)


def _keep_rejected(seq, draft):
    """Make ``seq``'s next commit keep the rejected draft rows too: the wrong rollback."""
    if "commit" in vars(seq):
        del seq.commit
    right = seq.commit

    def commit(root, verdict):
        right(root, verdict)
        del seq.commit
        # the rejected rows' tokens (in their slots' order) join the committed ones
        rest = [t for i, t in enumerate(draft) if i not in verdict.path]
        if rest:
            right(rest[0], Verdict.chain(rest[1:]))

    seq.commit = commit


@pytest.mark.slow
def test_a_target_that_keeps_rejected_rows_fails_the_check(spec):
    target = _NoRollback(spec.target.model, spec.target.tokenizer, atol=ATOL)
    _, tree = _oracle_tree(spec, target, GROUNDED[2], 6)
    with pytest.raises(AssertionError, match="not close"):
        tree.generate(GROUNDED[2], 6)
