"""The server's tool calls equal the chat model's in every tool-call format, on the real model.

SmolLM2's template renders no tools, so each format is forced: ``ServerConfig(tool_format=)``
on the server's app, run in this process over the same Speculator (what ``agentspec serve
--tool-format`` builds: tests/adapters/test_tool_formats.py follows the option there), and
``ChatAgentSpec(tool_format=)`` on the chat model. Both must give the same calls (names and
arguments) and the same text: for a forced call, which is also ``Speculator.generate``'s on
the rendered prompt and grammar parsed in that format, and for a turn after a call and its
result (the earlier call written back in the format).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("llguidance")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402

from agentspec.adapters.chat import parse_tool_calls  # noqa: E402
from agentspec.adapters.langchain import ChatAgentSpec  # noqa: E402
from agentspec.adapters.openai_protocol import parse_chat_request, render  # noqa: E402
from agentspec.adapters.openai_server import OpenAIServer, ServerConfig  # noqa: E402
from agentspec.grammar.tool_formats import FORMATS  # noqa: E402
from tests.server.conftest import MODEL, TIME, WEATHER, post_chat  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

MAX_TOKENS = 40
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A second turn: the call made, its result, and the question again (tool_choice auto).
AFTER = [*ASK,
         {"role": "assistant", "content": None, "tool_calls": [{
             "id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]
AFTER_LC = [HumanMessage(ASK[0]["content"]),
            AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"},
                                       "id": "call_1"}]),
            ToolMessage("Sunny, 21 C.", tool_call_id="call_1")]


def body(messages: list[dict[str, Any]], choice: Any, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "tools": [WEATHER, TIME], "tool_choice": choice,
            "max_tokens": MAX_TOKENS, "temperature": 0, **kw}


def generated(spec: Any, request: dict[str, Any], name: str) -> tuple[str, list[Any]]:
    """``Speculator.generate`` on the request as rendered in format ``name``: the raw text
    and its calls as ``(name, arguments)``."""
    req = parse_chat_request(request, models=[MODEL], max_tokens=MAX_TOKENS)
    rendered = render(req, spec.tokenizer, tool_format=name)
    gen = spec.generate(rendered.prompt, req.max_tokens, sampling=rendered.sampling)
    _, calls, _ = parse_tool_calls(gen.text, name)
    return gen.text, [(c["name"], c["args"]) for c in calls]


def served_calls(answer: dict[str, Any]) -> list[Any]:
    message = answer["choices"][0]["message"]
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or ()]


@pytest.mark.parametrize("name", list(FORMATS))
async def test_the_servers_tool_calls_equal_the_chat_models(spec: Any, name: str) -> None:
    server = OpenAIServer(spec, ServerConfig(models=(MODEL,), tool_format=name))
    chat = ChatAgentSpec(speculator=spec, tool_format=name, temperature=0, max_tokens=MAX_TOKENS)
    try:
        # A forced call, and a turn after a call and its result.
        for request, messages, choice in ((body(ASK, "required"), ASK[0]["content"], "required"),
                                          (body(AFTER, "auto"), AFTER_LC, "auto")):
            answer = await post_chat(server.app, request)
            message = chat.bind_tools([WEATHER, TIME], tool_choice=choice).invoke(messages)
            got_chat = [(c["name"], c["args"]) for c in message.tool_calls]
            assert served_calls(answer) == got_chat, name
            assert (answer["choices"][0]["message"]["content"] or "") == message.content
            if choice == "required":
                text, want = generated(spec, request, name)
                assert got_chat == want, (name, text)
                assert want and text.startswith(FORMATS[name].open or "{"), (name, text)
                assert answer["choices"][0]["finish_reason"] == "tool_calls"
    finally:
        server.close()


def test_the_comparison_sees_calls_parsed_in_another_format(spec: Any) -> None:
    """The hermes answer read as mistral holds no call: a server that parsed in the wrong
    format would fail the comparison above."""
    text, want = generated(spec, body(ASK, "required"), "hermes")
    assert want
    _, calls, _ = parse_tool_calls(text, "mistral")
    assert [(c["name"], c["args"]) for c in calls] != want
