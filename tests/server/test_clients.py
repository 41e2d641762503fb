"""The real server with real clients: OpenAI's SDK and LangChain's ``ChatOpenAI``.

Every answer is compared with ``Speculator.generate`` in this process on the same prompt and
sampling (the prompt built by hand from :mod:`agentspec.adapters.chat`, the way
``ChatAgentSpec`` builds it, or, for ``ChatOpenAI``, from the request it sent): the text,
the tool calls, the finish reason and the token count. The comparison itself is shown
failing on outputs a wrong server would give (a token dropped, other sampling, other call
arguments), so a comparison that stopped comparing fails here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from agentspec.adapters.chat import (
    build_prompt,
    call_grammar,
    parse_tool_calls,
    schema_grammar,
)
from agentspec.adapters.openai_protocol import parse_chat_request, render
from agentspec.config import SamplingParams
from agentspec.types import Generation
from tests.server.conftest import MASTER_KEY, MODEL, TIME, WEATHER, Server

openai = pytest.importorskip("openai")
# One torch thread here and in the server: two processes share the cores (a test waits on
# the server, then checks it in process), and oversubscribed threads only spin.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str
    age: int


@dataclass(frozen=True)
class Answer:
    """What a client got: the text, the calls as (name, arguments), why it ended, how long."""

    content: str
    calls: tuple[tuple[str, Any], ...]
    finish: str
    tokens: int


def expected(gen: Generation, *, calls: bool) -> Answer:
    """What the server must answer for an in-process generation ``gen``."""
    if calls:
        content, valid, _ = parse_tool_calls(gen.text)
        if valid:
            return Answer(content, tuple((c["name"], c["args"]) for c in valid), "tool_calls",
                          len(gen.token_ids))
    return Answer(gen.text, (), gen.finish_reason, len(gen.token_ids))


def assert_same(got: Answer, gen: Generation, *, calls: bool = False) -> None:
    want = expected(gen, calls=calls)
    assert got == want, f"server answered {got}, Speculator.generate gave {want}"


def from_completion(c: Any) -> Answer:
    choice = c.choices[0]
    calls = tuple((t.function.name, json.loads(t.function.arguments))
                  for t in choice.message.tool_calls or ())
    return Answer(choice.message.content or "", calls, choice.finish_reason,
                  c.usage.completion_tokens)


def from_chunks(chunks: list[Any]) -> Answer:
    text, calls, finish, usage = "", [], None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.delta.content or ""
            calls += [(t.function.name, json.loads(t.function.arguments))
                      for t in choice.delta.tool_calls or ()]
            finish = choice.finish_reason or finish
    assert usage is not None and finish is not None
    return Answer(text, tuple(calls), finish, usage)


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url, api_key=MASTER_KEY, max_retries=0, timeout=120)


def ask(client: Any, messages: list[dict[str, Any]], *, stream: bool = False,
        **kw: Any) -> Answer:
    kw = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **kw}
    if stream:
        return from_chunks(list(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw)))
    return from_completion(client.chat.completions.create(**kw))


def test_chat_plain_and_streamed_equal_generate(client: Any, spec: Any) -> None:
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name three colours."}]
    greedy = spec.generate(messages, 8)
    assert_same(ask(client, messages), greedy)
    assert_same(ask(client, messages, stream=True), greedy)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    gen = spec.generate(messages, 8, sampling=sampled)
    assert_same(ask(client, messages, temperature=0.8, top_p=0.9, seed=7, stream=True), gen)
    stopped = spec.generate(messages, 8, stop=[" are"])
    assert_same(ask(client, messages, stop=[" are"]), stopped)  # memory drafts, same tokens


def test_the_comparison_fails_a_wrong_server(client: Any, spec: Any) -> None:
    """A server that dropped a token or sampled otherwise would be caught by
    :func:`assert_same` (a changed tool call: in the tools test)."""
    got = ask(client, ASK_WEATHER)
    right = spec.generate(ASK_WEATHER, 8)
    assert_same(got, right)
    ids = right.token_ids[:-1]  # one token short
    short = replace(right, token_ids=ids, text=spec.tokenizer.decode(ids, skip_special_tokens=True))
    with pytest.raises(AssertionError):
        assert_same(got, short)
    with pytest.raises(AssertionError):
        assert_same(got, spec.generate(ASK_WEATHER, 8, sampling=SamplingParams(
            temperature=1.0, seed=3)))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}},
                                    "auto", "none"])
def test_tools_equal_generate(client: Any, spec: Any, choice: Any) -> None:
    tools, forced = [WEATHER, TIME], choice not in ("none", "auto")
    prompt = build_prompt(spec.tokenizer, ASK_WEATHER, tools=tools)
    size = 20 if forced else 10
    gen = spec.generate(prompt, size, sampling=SamplingParams(grammar=call_grammar(tools, choice)))
    got = ask(client, ASK_WEATHER, tools=tools, tool_choice=choice, max_tokens=size)
    assert_same(got, gen, calls=choice != "none")
    if forced:
        assert got.finish == "tool_calls" and got.calls
        wrong = replace(got, calls=((got.calls[0][0], {"x": 1}),))  # other arguments
        with pytest.raises(AssertionError):
            assert_same(wrong, gen, calls=True)
    if choice == "required":
        streamed = ask(client, ASK_WEATHER, tools=tools, tool_choice=choice, max_tokens=size,
                       stream=True)
        assert_same(streamed, gen, calls=True)


def test_structured_output_equals_generate(client: Any, spec: Any) -> None:
    messages = [{"role": "user", "content": "Make up a person named Ada who is 36."}]
    schema = Person.model_json_schema()
    grammar, system = schema_grammar(schema)
    gen = spec.generate(build_prompt(spec.tokenizer, messages, system=system), 20,
                        sampling=SamplingParams(grammar=grammar))
    fmt = {"type": "json_schema", "json_schema": {"name": "Person", "schema": schema}}
    got = ask(client, messages, response_format=fmt, max_tokens=20)
    assert_same(got, gen)
    assert Person.model_validate_json(got.content)
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, max_tokens=20,
                                           temperature=0, response_format=Person)
    assert isinstance(parsed.choices[0].message.parsed, Person)


# -- LangChain's ChatOpenAI -------------------------------------------------------------------

class _Recorder:
    """The JSON bodies a client sent (an httpx event hook)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.read()))


def reference(spec: Any, body: dict[str, Any]) -> Generation:
    """``Speculator.generate`` on the rendered prompt and sampling of a request body."""
    req = parse_chat_request(body, models=[MODEL], max_tokens=48)
    rendered = render(req, spec.tokenizer)
    return spec.generate(rendered.prompt, req.max_tokens, sampling=rendered.sampling, stop=req.stop)


def test_chat_openai_equals_generate(server: Server, spec: Any) -> None:
    lc = pytest.importorskip("langchain_openai")
    recorder = _Recorder()
    llm = lc.ChatOpenAI(model=MODEL, base_url=server.url, api_key=MASTER_KEY, temperature=0,
                        max_tokens=20, max_retries=0,
                        http_client=httpx.Client(event_hooks={"request": [recorder]}))
    msg = llm.invoke("Name a large animal.")
    gen = reference(spec, recorder.bodies[-1])
    assert msg.content == gen.text
    assert msg.usage_metadata["output_tokens"] == len(gen.token_ids)
    streamed = "".join(str(c.content) for c in llm.stream("Name a large animal."))
    assert recorder.bodies[-1]["stream"] is True
    assert streamed == reference(spec, recorder.bodies[-1]).text == gen.text

    with_tools = llm.bind_tools([WEATHER, TIME], tool_choice="get_weather")
    msg = with_tools.invoke("What is the weather in Rome?")
    gen = reference(spec, recorder.bodies[-1])
    want = expected(gen, calls=True)
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == list(want.calls)

    structured = llm.with_structured_output(Person, method="json_schema")
    person = structured.invoke("Make up a person named Ada who is 36.")
    gen = reference(spec, recorder.bodies[-1])
    assert person == Person.model_validate_json(gen.text)
