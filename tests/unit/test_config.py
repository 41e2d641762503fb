import math

import pytest

from agentspec.config import SamplingParams, SpecConfig


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_draft_tokens": 0}, "max_draft_tokens"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram_min"),
        ({"max_tree_nodes": 0}, "max_tree_nodes"),
        ({"prefetch_key": "yes"}, "prefetch_key"),
        ({"memory_neighbours": 0}, "memory_neighbours must be an int >= 1, got 0"),
        ({"memory_neighbours": 2.5}, "memory_neighbours must be an int >= 1, got 2.5"),
    ],
)
def test_bad_spec_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(**kwargs)


def test_defaults_are_greedy_and_frozen():
    params = SamplingParams()
    assert params.greedy
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]
