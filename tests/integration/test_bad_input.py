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


class _NotADrafter:
    name = "half"

    def propose(self, context, *, max_tokens):  # no begin/observe/end
        return None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"memory": 42}, TypeError, "memory.*42"),
        ({"memory": object()}, TypeError, "memory.*object"),
        ({"memory": ""}, ValueError, "memory"),
        ({"drafters": "prompt_lookup"}, TypeError, "drafters.*prompt_lookup"),
        ({"drafters": [_NotADrafter()]}, TypeError, r"drafters\[0\].*_NotADrafter"),
        ({"config": {"max_draft_tokens": 4}}, TypeError, "config.*max_draft_tokens"),
        ({"speculate": "yes"}, TypeError, "speculate.*yes"),
        ({"cost": "fast"}, ValueError, "cost.*fast"),
        ({"cost": 0.1}, TypeError, "cost.*0.1"),
        ({"draft_model": 3}, TypeError, "draft_model.*3"),
    ],
)
def test_bad_constructor_arguments_name_the_value(spec, kwargs, error, match):
    from agentspec import Speculator

    with pytest.raises(error, match=match):
        Speculator(spec.target, **kwargs)


def test_the_target_must_be_an_hftarget():
    from agentspec import Speculator

    with pytest.raises(TypeError, match="target.*str.*smollm2"):
        Speculator("smollm2-135m-instruct", memory=None)


def test_a_memory_url_is_opened_not_kept_as_a_string(spec, tmp_path, monkeypatch):
    from agentspec import CompletionMemory, Speculator

    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    opened = Speculator(spec.target, memory=f"sqlite:///{tmp_path}/m.db")
    assert isinstance(opened.memory, CompletionMemory)
    opened.memory.close()


def test_stream_hands_back_the_finished_generation(spec):
    stream = spec.stream("The capital of France is", 6)
    assert stream.generation is None
    text = "".join(stream)
    gen = stream.generation
    assert gen is not None and gen.text == text
    assert gen.token_ids == spec.generate("The capital of France is", 6).token_ids

    def outer():
        return (yield from spec.stream("The capital of France is", 6))

    it = outer()
    with pytest.raises(StopIteration) as done:
        while True:
            next(it)
    assert done.value.value.token_ids == gen.token_ids  # also the generator's return value


def test_stream_refuses_bad_input_when_called(spec):
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec.stream("hello", 0)  # not at the first delta
