"""ChatAgentSpec / AgentSpecLLM beyond the standard suites: tool-call parsing, message
rendering, stream == invoke, metadata, structured output, async; mostly on a fake Speculator."""

from __future__ import annotations

import json
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from agentspec.adapters.langchain import (
    AgentSpecLLM,
    ChatAgentSpec,
    build_prompt,
    parse_tool_calls,
    to_chat_messages,
)
from tests.adapters.adapter_fakes import FakeSpeculator


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _concat(chunks: list[Any]) -> Any:
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    return full


# -- parsing ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    '{"name": "add", "arguments": {"a": 1, "b": 2}}',
    '```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```',
    '<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}</tool_call>',
    '{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}',
])
def test_valid_tool_call_json_is_parsed(text: str) -> None:
    content, calls, invalid = parse_tool_calls(text)
    assert content == "" and invalid == []
    assert [(c["name"], c["args"], c["type"]) for c in calls] == [("add", {"a": 1, "b": 2}, "tool_call")]
    assert calls[0]["id"].startswith("call_")


def test_two_calls_and_surrounding_text() -> None:
    text = 'Sure.\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n{"name": "add", "arguments": {}}'
    content, calls, invalid = parse_tool_calls(text)
    assert content == "Sure." and len(calls) == 2 and not invalid
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("text", [
    '{"name": "add", "arguments": {"a": 1, "b": ',  # partial: cut off by max_tokens
    '{"name": add, "arguments": {a: 1}}',  # malformed
    '```json\n{"nam',
])
def test_unparseable_call_goes_to_invalid_tool_calls(text: str) -> None:
    content, calls, invalid = parse_tool_calls(text)
    assert calls == [] and content == ""
    assert len(invalid) == 1 and invalid[0]["args"] == text and invalid[0]["error"]


def test_bad_arguments_are_invalid_and_plain_text_is_content() -> None:
    _, calls, invalid = parse_tool_calls('{"name": "add", "arguments": 3}')
    assert calls == [] and invalid[0]["name"] == "add" and "object" in invalid[0]["error"]
    assert parse_tool_calls("The answer is 3.") == ("The answer is 3.", [], [])


# -- rendering --------------------------------------------------------------------------------

def test_history_with_tool_calls_and_tool_messages_is_rendered() -> None:
    msgs = to_chat_messages([
        SystemMessage("be brief"), HumanMessage("1+2?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "x"}]),
        ToolMessage("3", tool_call_id="x"), ToolMessage("bad", tool_call_id="y", status="error"),
    ])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert json.loads(msgs[2]["content"]) == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert msgs[3]["content"] == "3" and msgs[4]["content"] == "Error: bad"


def test_tools_without_template_support_become_a_system_block(fake_spec: FakeSpeculator) -> None:
    tools = [ChatAgentSpec(speculator=fake_spec).bind_tools([add]).kwargs["tools"][0]]  # type: ignore[attr-defined]
    prompt = build_prompt(fake_spec.tokenizer, [{"role": "user", "content": "hi"}], tools=tools)
    assert isinstance(prompt, list) and prompt[0]["role"] == "system"
    assert '"add"' in prompt[0]["content"] and prompt[1] == {"role": "user", "content": "hi"}


def test_unknown_tool_choice_is_refused(fake_spec: FakeSpeculator) -> None:
    with pytest.raises(ValueError, match="'nope'"):
        ChatAgentSpec(speculator=fake_spec).bind_tools([add], tool_choice="nope")


# -- calls on the fake ------------------------------------------------------------------------

def test_stream_concatenates_to_invoke_with_metadata(fake_spec: FakeSpeculator) -> None:
    chat = ChatAgentSpec(speculator=fake_spec, scope="tenant-a", model="my-model")
    result = chat.invoke("hi")
    chunks = list(chat.stream("hi"))
    assert len(chunks) == 1 + len(range(0, len(fake_spec.reply), 3))  # one per step, then the last
    full = _concat(chunks)
    assert full.content == result.content == fake_spec.reply
    assert result.usage_metadata == {"input_tokens": 7, "output_tokens": len(fake_spec.reply),
                                     "total_tokens": 7 + len(fake_spec.reply),
                                     "input_token_details": {"cache_read": 3}}
    meta = result.response_metadata
    assert meta["model_name"] == "my-model" and meta["accepted_by_source"] == {"prompt_lookup": 1}
    assert meta["steps"] >= 1 and "seconds" in meta and "tokens_per_step" in meta
    assert {c["scope"] for c in fake_spec.calls} == {"tenant-a"}


def test_stop_sequences_from_field_and_call_are_combined(fake_spec: FakeSpeculator) -> None:
    chat = ChatAgentSpec(speculator=fake_spec, stop=["friend"])
    assert chat.invoke("hi", stop=["there"]).content == "Hello "
    assert fake_spec.calls[-1]["stop"] == ["friend", "there"]


def test_tool_call_reply_becomes_tool_calls_in_invoke_and_stream() -> None:
    spec = FakeSpeculator('{"name": "add", "arguments": {"a": 1, "b": 2}}')
    bound = ChatAgentSpec(speculator=spec).bind_tools([add])
    for msg in (bound.invoke("1+2?"), _concat(list(bound.stream("1+2?")))):
        assert msg.content == ""
        assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 1, "b": 2})]


def test_tool_choice_sets_the_call_grammar() -> None:
    spec = FakeSpeculator('{"name": "add", "arguments": {"a": 4, "b": 5}}')
    chat = ChatAgentSpec(speculator=spec)
    msg = chat.bind_tools([add], tool_choice="any").invoke("4+5?")
    assert msg.tool_calls[0]["args"] == {"a": 4, "b": 5}
    forced = spec.calls[-1]["grammar"]
    assert forced.kind == "tool_calls" and forced.tools == ("add",)
    chat.bind_tools([add]).invoke("4+5?")  # auto: a call or text, another grammar
    assert spec.calls[-1]["grammar"].kind == "tool_calls" and spec.calls[-1]["grammar"] != forced
    chat.bind_tools([add], tool_choice="none").invoke("4+5?")
    assert spec.calls[-1]["grammar"] is None
    chat.invoke("hi")
    assert spec.calls[-1]["grammar"] is None


def test_malformed_tool_reply_is_an_invalid_call_not_an_error() -> None:
    spec = FakeSpeculator('{"name": "add", "arguments": {"a": 1,')
    msg = ChatAgentSpec(speculator=spec).bind_tools([add]).invoke("1+2?")
    assert msg.tool_calls == [] and len(msg.invalid_tool_calls) == 1


def test_plain_answer_with_tools_bound_streams_as_text() -> None:
    spec = FakeSpeculator("It is three.")
    chunks = list(ChatAgentSpec(speculator=spec).bind_tools([add]).stream("1+2?"))
    assert len(chunks) > 2 and _concat(chunks).content == "It is three."


class Pair(BaseModel):
    a: int
    b: int


def test_structured_output_function_calling_and_json_mode() -> None:
    spec = FakeSpeculator(lambda p: '{"name": "Pair", "arguments": {"a": 1, "b": 2}}'
                          if "Pair" in str(p) and "name" in str(p) else '{"a": 3, "b": 4}')
    chat = ChatAgentSpec(speculator=spec)
    assert chat.with_structured_output(Pair).invoke("give a pair") == Pair(a=1, b=2)
    assert chat.with_structured_output(Pair, method="json_mode").invoke("pair") == Pair(a=3, b=4)
    assert spec.calls[-1]["grammar"].kind == "json_schema"
    with pytest.raises(ValueError, match="'xml'"):
        chat.with_structured_output(Pair, method="xml")


async def test_async_invoke_and_stream_match(fake_spec: FakeSpeculator) -> None:
    chat = ChatAgentSpec(speculator=fake_spec)
    result = await chat.ainvoke("hi")
    chunks = [c async for c in chat.astream("hi")]
    assert _concat(chunks).content == result.content == fake_spec.reply


async def test_text_llm_sync_and_async(fake_spec: FakeSpeculator) -> None:
    llm = AgentSpecLLM(speculator=fake_spec, max_tokens=5)
    assert llm.invoke("x") == fake_spec.reply[:5]
    assert "".join([c async for c in llm.astream("x")]) == fake_spec.reply[:5]
    assert llm.generate(["x"]).generations[0][0].generation_info["model_name"] == "agentspec"


def test_missing_speculator_is_named() -> None:
    with pytest.raises(ValueError, match="speculator"):
        ChatAgentSpec().invoke("hi")


# -- the real model ---------------------------------------------------------------------------

@pytest.mark.slow
def test_real_model_stream_equals_invoke_at_temperature_0(real_spec: Any) -> None:
    chat = ChatAgentSpec(speculator=real_spec, temperature=0, max_tokens=12)
    result = chat.invoke("Name three colours.")
    chunks = list(chat.stream("Name three colours."))
    assert len(chunks) > 2
    assert _concat(chunks).content == result.content and result.content
    assert result.usage_metadata["output_tokens"] <= 12
