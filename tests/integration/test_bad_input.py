"""Bad input raises ValueError naming the value, before any compute."""

from __future__ import annotations

import pytest

from agentspec import SamplingParams


@pytest.mark.parametrize(
    ("prompt", "kwargs", "match"),
    [
        ("", {}, "empty"),
        ([], {}, "empty"),
        ([{"role": "wizard", "content": "hi"}], {}, "wizard"),
        ([{"role": "user"}], {}, "content"),
        ([{"role": "user", "content": 3}], {}, "content"),
        ("hello", {"max_new_tokens": 0}, "max_new_tokens"),
        ("hello", {"max_new_tokens": -4}, "max_new_tokens"),
        ("hello " * 9000, {}, "context"),
        ("hello", {"stop": [""]}, "stop"),
    ],
)
def test_bad_generate_input(spec, prompt, kwargs, match):
    calls = []
    spec.target.model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=match):
        spec.generate(prompt, **kwargs)
    assert not calls, "bad input must fail before any compute"
    spec.target.model._forward_pre_hooks.clear()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 0}, "top_k"),
     ({"repetition_penalty": 1.3}, "repetition_penalty")],
)
def test_bad_sampling(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_model_names_the_value():
    from agentspec import load_target

    with pytest.raises(ValueError, match="no-such-model"):
        load_target("no-such-model")
