"""Tool-call wrappers that are special tokens, end to end (issue 49's tool formats).

Mistral's ``[TOOL_CALLS]`` (and its v11 ``[ARGS]``) and Phi-4-mini's and Granite's
``<|tool_call|>`` are special tokens in those models' tokenizers. The packaged SmolLM2, its
vocabulary grown by those tokens (their embedding rows zero) on a copy of its tokenizer that
holds them as special tokens (``tests/families.py``: :func:`wrapper_tokenizer`), is asked for
a call in each such format, by the chat model and by the server over the same Speculator:

- the answer's first token is the wrapper's token (the one the model was trained to emit), not
  the wrapper spelled out; its text keeps the wrapper, and the calls parse from it;
- the server's ``tool_calls`` equal the chat model's, and the format is detected from a chat
  template that renders ``[TOOL_CALLS]`` as well as named.

A grammar built without the tokenizer's tokens (the format as plain text) has the model spell
the wrapper out: the first check fails on it. That grammar spells a special token's text, where
llguidance 1.9.1 masks the special token but refuses to consume it; the engine's masks drop
such tokens (:func:`agentspec.grammar.tokenizer.fill_mask`), and without that the request
fails, which the last test shows.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("llguidance")

from agentspec import SamplingParams, Speculator  # noqa: E402
from agentspec.adapters.chat import call_grammar, parse_tool_calls, resolve_tool_format  # noqa: E402
from agentspec.adapters.langchain import ChatAgentSpec  # noqa: E402
from agentspec.adapters.openai_server import OpenAIServer, ServerConfig  # noqa: E402
from agentspec.drafters.policy import DEFAULT_COST  # noqa: E402
from agentspec.engine.target import HFTarget  # noqa: E402
from agentspec.grammar.tool_formats import FORMATS  # noqa: E402
from tests.families import wrapper_tokenizer  # noqa: E402
from tests.server.conftest import post_chat  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

MODEL = "tiny-wrapper"
MAX_TOKENS = 48
# Enum-only arguments: a call stays short and whole within MAX_TOKENS.
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A Mistral-style template: tools listed before the last user turn, calls after [TOOL_CALLS].
MISTRAL_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'user' %}[INST] {% if tools and loop.last %}"
    "[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS] "
    "{{ m.tool_calls | tojson }}{% else %}{{ m.content }}{% endif %}</s>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS] {{ m.content }}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}")


@pytest.fixture(scope="module")
def grown() -> Any:
    """The packaged SmolLM2 (fp32) with embedding rows for the wrapper tokens, all zero."""
    import torch

    from agentspec.engine import compat
    from agentspec.engine.load import resolve_model

    model = compat.load_causal_lm(resolve_model("smollm2-135m-instruct")[1], torch.float32)
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(wrapper_tokenizer()), mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[old:] = 0
        model.get_output_embeddings().weight[old:] = 0
    return model.eval()


def _speculator(model: Any, tokenizer: Any) -> Speculator:
    return Speculator(HFTarget(model, tokenizer, name=MODEL), cost=DEFAULT_COST, memory=None)


@pytest.fixture(scope="module")
def spec(grown: Any) -> Speculator:
    return _speculator(grown, wrapper_tokenizer())


@pytest.fixture(scope="module")
def mistral_spec(grown: Any) -> Speculator:
    """The same model under a chat template that renders tools the Mistral way."""
    tok = copy.deepcopy(wrapper_tokenizer())
    tok.chat_template = MISTRAL_TEMPLATE
    return _speculator(grown, tok)


def first_token_and_text(spec: Speculator, fmt: Any) -> tuple[int, str]:
    """The first token and the text of a required call of :data:`CITY` under ``fmt``'s
    grammar (a format bound to the tokenizer, or the plain one)."""
    grammar = call_grammar([CITY], "required", fmt)
    gen = spec.generate("Weather in Paris?", MAX_TOKENS, sampling=SamplingParams(grammar=grammar))
    return gen.token_ids[0], gen.text


async def served_and_chat(spec: Speculator, tool_format: str | None) -> tuple[list[Any], list[Any]]:
    """One required call through the server and through the chat model: their calls."""
    server = OpenAIServer(spec, ServerConfig(models=(MODEL,), tool_format=tool_format))
    chat = ChatAgentSpec(speculator=spec, tool_format=tool_format, temperature=0,
                         max_tokens=MAX_TOKENS)
    try:
        answer = await post_chat(server.app, {"model": MODEL, "messages": ASK, "tools": [CITY],
                                     "tool_choice": "required", "max_tokens": MAX_TOKENS,
                                     "temperature": 0})
    finally:
        server.close()
    message = answer["choices"][0]["message"]
    served = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
              for c in message.get("tool_calls") or ()]
    assert answer["choices"][0]["finish_reason"] == "tool_calls", answer
    invoked = chat.bind_tools([CITY], tool_choice="required").invoke(ASK[0]["content"])
    return served, [(c["name"], c["args"]) for c in invoked.tool_calls]


@pytest.mark.parametrize("name", ["mistral", "mistral_v11", "phi", "granite"])
def test_the_model_writes_the_wrapper_as_its_token_and_the_text_keeps_it(
        spec: Speculator, name: str) -> None:
    fmt = resolve_tool_format(spec.tokenizer, name)
    assert fmt.tokens, name
    first, text = first_token_and_text(spec, fmt)
    assert first == fmt.keep[0], (name, spec.tokenizer.convert_ids_to_tokens([first]))
    assert text.startswith(fmt.parts()[0]), (name, text)
    _, calls, invalid = parse_tool_calls(text, fmt)
    assert calls and not invalid, (name, text)
    if fmt.close:  # phi closes the list with its other token, also kept
        assert text.endswith(fmt.close), (name, text)


def test_a_grammar_without_the_token_has_the_wrapper_spelled_and_fails_the_check(
        spec: Speculator) -> None:
    fmt = resolve_tool_format(spec.tokenizer, "mistral")
    first, text = first_token_and_text(spec, FORMATS["mistral"])  # the unbound format
    assert first != fmt.keep[0]
    assert spec.tokenizer.convert_ids_to_tokens([first])[0] != "[TOOL_CALLS]", text


@pytest.mark.parametrize("name", ["mistral", "mistral_v11", "phi"])
async def test_the_servers_calls_equal_the_chat_models(spec: Speculator, name: str) -> None:
    served, chat = await served_and_chat(spec, name)
    assert served and served == chat, name


async def test_the_format_is_detected_from_the_template_and_bound(
        mistral_spec: Speculator) -> None:
    fmt = resolve_tool_format(mistral_spec.tokenizer)
    assert fmt.name == "mistral" and fmt.tokens
    served, chat = await served_and_chat(mistral_spec, None)
    assert served and served == chat


def test_without_settled_masks_a_grammar_spelling_a_special_token_fails_the_request(
        spec: Speculator, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentspec.grammar import tokenizer
    from agentspec.grammar.spec import GrammarError

    monkeypatch.setattr(tokenizer, "settle_specials", lambda *a: None)
    tokenizer.forget_masks()  # the masks cached by the tests above were settled
    with pytest.raises(GrammarError):
        first_token_and_text(spec, FORMATS["mistral"])
    tokenizer.forget_masks()  # nor may the unsettled ones outlive this test
