"""Draft logits through the weight-first output head equal the model's own, or it is not used."""

from __future__ import annotations

import pytest
import torch

from agentspec.target import HFTarget
from agentspec.types import Draft, Verdict

from .test_model_drafter import TinyTokenizer, tiny_model


def _score_and_roll_back(target: HFTarget, draft: Draft, root: int = 5) -> torch.Tensor:
    """Score ``root`` + ``draft``, then commit the root only (the KV grows by one row)."""
    logits = target.score(root, draft)
    target.commit(draft, Verdict((), (), root))
    return logits


def _own_logits(target: HFTarget, context: list[int], draft: Draft) -> torch.Tensor:
    with torch.inference_mode():
        ids = torch.tensor([[*context, *draft.token_ids]])
        return target.model(input_ids=ids).logits[0, len(context) - 1 :]


def test_real_model_uses_it_and_matches_its_own_forward(spec):
    target = spec.target.fork()
    prompt = spec.encode("Name three colours.")
    target.start(prompt + [5])
    draft = Draft.chain([100, 200, 300], "x")
    first = _score_and_roll_back(target, draft)  # checked against the model's forward
    assert target._head_checked is True
    again = _score_and_roll_back(target, draft)
    own = _own_logits(target, prompt + [5, 5], draft)  # the first root is committed since
    torch.testing.assert_close(first, _own_logits(target, prompt + [5], draft), atol=1e-4, rtol=0)
    torch.testing.assert_close(again, own, atol=1e-4, rtol=0)


def test_a_head_with_more_than_a_linear_layer_fails_the_check_and_is_not_used():
    target = tiny_model(3)
    model = target.model
    forward = type(model).forward

    def scaled(self, *args, **kwargs):  # a model that scales its logits (as some do)
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = scaled.__get__(model)
    target.start([1, 2, 3])
    draft = Draft.chain([4, 0], "x")
    with pytest.warns(UserWarning, match="output head"):
        logits = _score_and_roll_back(target, draft, root=3)
    assert target._head_checked is False
    torch.testing.assert_close(logits, _own_logits(target, [1, 2, 3], draft))  # scaled, as its own
    later = _score_and_roll_back(target, draft, root=3)
    torch.testing.assert_close(later, _own_logits(target, [1, 2, 3, 3], draft))


def test_a_biased_head_is_never_tried():
    target = tiny_model(4)
    head = target.model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    target.model.lm_head = biased
    fresh = HFTarget(target.model, TinyTokenizer(), name="biased")
    fresh.start([1, 2])
    _score_and_roll_back(fresh, Draft.chain([3], "x"), root=2)
    assert fresh._head_checked is False
