import pytest
import torch

from agentspec.config import SamplingParams
from agentspec.decoding.sampling import logits_to_probs, make_generator

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.10]]))


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), [0.5, 0.25, 0.15, 0.10]),
        (SamplingParams(temperature=1.0, top_k=2), [2 / 3, 1 / 3, 0, 0]),
        (SamplingParams(temperature=1.0, top_p=0.45), [1, 0, 0, 0]),
        (SamplingParams(temperature=1.0, top_p=0.7), [2 / 3, 1 / 3, 0, 0]),
        (SamplingParams(temperature=1.0, top_p=0.76), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]),
        # top-p applies to the top-k renormalised distribution, as in transformers
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.8), [2 / 3, 1 / 3, 0, 0]),
    ],
)
def test_logits_to_probs(params, expected):
    torch.testing.assert_close(logits_to_probs(LOGITS, params)[0], torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_temperature_sharpens():
    hot = logits_to_probs(LOGITS, SamplingParams(temperature=2.0))[0]
    cold = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))[0]
    assert cold[0] > 0.5 > hot[0]


def test_greedy_has_no_distribution():
    with pytest.raises(ValueError, match="temperature > 0"):
        logits_to_probs(LOGITS, SamplingParams())


def test_generator_is_explicit_and_seeded():
    a = torch.rand(3, generator=make_generator(7, "cpu"))
    b = torch.rand(3, generator=make_generator(7, "cpu"))
    torch.testing.assert_close(a, b)
