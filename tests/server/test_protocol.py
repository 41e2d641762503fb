"""The server's pure seams, without a model: request checking, scopes and keys, the answers'
shapes, the thread bridge's early stop, and the ASGI app over a scripted Speculator."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("starlette")

from agentspec.adapters.chat import in_thread  # noqa: E402
from agentspec.adapters.openai_errors import refused  # noqa: E402
from agentspec.adapters.openai_protocol import (  # noqa: E402
    SSE_DONE,
    ApiError,
    chunk_body,
    completion_body,
    openai_calls,
    parse_chat_request,
    render,
    sse,
)
from agentspec.adapters.openai_server import (  # noqa: E402
    ServerConfig,
    authenticate,
    create_app,
    resolve_scope,
)
from agentspec.errors import ContextLengthError  # noqa: E402
from agentspec.grammar.spec import GrammarError  # noqa: E402
from agentspec.scheduler import Load  # noqa: E402
from agentspec.stream import Stream  # noqa: E402
from agentspec.types import Generation, GenerationStats  # noqa: E402
from tests.adapters.adapter_fakes import FakeTokenizer  # noqa: E402

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def parse(**change: Any) -> Any:
    return parse_chat_request({**OK, **change}, models=["m"], max_tokens=64)


def test_a_minimal_request_gets_openai_defaults() -> None:
    req = parse()
    assert (req.max_tokens, req.temperature, req.top_p, req.stream) == (64, 1.0, 1.0, False)
    assert req.messages == [{"role": "user", "content": "hi"}] and req.json_schema is None


def test_messages_become_agentspec_messages() -> None:
    req = parse(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}],
        max_completion_tokens=5, stop="\n", tools=[TOOL], tool_choice="required")
    assert req.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "a\nb"},
                            {"role": "assistant", "content": '{"name": "add", "arguments": {"a": 1}}'},
                            {"role": "tool", "content": "2"}]
    assert req.max_tokens == 5 and req.stop == ["\n"] and req.tool_choice == "required"


@pytest.mark.parametrize(("change", "status", "param"), [
    ({"model": "other"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": True}, 400, "temperature"),
    ({"max_tokens": 65}, 400, "max_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, 400, "max_tokens"),
    ({"seed": 1.5}, 400, "seed"),
    ({"n": 3}, 400, "n"),
    ({"logit_bias": {"1": 5}}, 400, "logit_bias"),
    ({"wat": 1}, 400, "wat"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools[0].function.name"),
    ({"tools": [TOOL, TOOL]}, 400, "tools[1].function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "sub"}}, "tools": [TOOL]}, 400,
     "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format.json_schema.schema"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
])
def test_bad_fields_are_named(change: dict[str, Any], status: int, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse(**change)
    assert (caught.value.status, caught.value.param) == (status, param)
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}


def test_neutral_values_of_unsupported_fields_pass() -> None:
    parse(n=1, logprobs=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
          metadata={"a": "b"}, store=False, parallel_tool_calls=True)


def test_render_builds_what_chat_agentspec_builds() -> None:
    tok = FakeTokenizer()
    tools = render(parse(tools=[TOOL], tool_choice="required", temperature=0), tok)
    assert tools.calls and tools.sampling.grammar is not None and tools.sampling.greedy
    assert tools.prompt[0]["role"] == "system" and '"name": "add"' in tools.prompt[0]["content"]
    plain = render(parse(tools=[TOOL], tool_choice="none"), tok)
    assert not plain.calls and plain.sampling.grammar is None
    schema = render(parse(response_format={"type": "json_object"}), tok)
    assert schema.sampling.grammar is not None and "JSON object" in schema.prompt[0]["content"]
    with pytest.raises(ApiError) as caught:
        render(parse(tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "bogus"}}}], tool_choice="required"), tok)
    assert caught.value.param == "tools"


KEYS = ServerConfig(models=("m",), api_keys=frozenset({"master"}),
                    key_scopes={"ka": ("a", "a2"), "kb": ("b",)}, scopes=frozenset({"default", "x"}))


def test_scope_rules() -> None:
    assert resolve_scope(KEYS, "ka", None, None) == "a"
    assert resolve_scope(KEYS, "ka", "a2", "a") == "a2"  # the header first
    assert resolve_scope(KEYS, "ka", None, "a2") == "a2"  # then `user`
    assert resolve_scope(KEYS, "master", None, None) == "default"
    assert resolve_scope(KEYS, "master", "x", None) == "x"
    for key, header, user in (("ka", "b", None), ("kb", None, "a"), ("master", "a", None)):
        with pytest.raises(ApiError) as caught:
            resolve_scope(KEYS, key, header, user)
        assert caught.value.status == 403 and caught.value.code == "scope_not_allowed"
    for bad in ("", "a b", "../x", "-x", "x" * 129):
        with pytest.raises(ApiError) as caught:
            resolve_scope(KEYS, "master", bad, None)
        assert caught.value.status == 400
    open_server = ServerConfig(models=("m",))
    assert resolve_scope(open_server, None, None, "anyone@example.com") == "anyone@example.com"


def test_keys() -> None:
    assert authenticate(ServerConfig(models=("m",)), None) is None
    assert authenticate(KEYS, "Bearer kb") == "kb" and authenticate(KEYS, "bearer master") == "master"
    for header in (None, "", "Bearer", "Bearer nope", "Basic master", "master"):
        with pytest.raises(ApiError) as caught:
            authenticate(KEYS, header)
        assert caught.value.status == 401


@pytest.mark.parametrize("bad", [{"models": ()}, {"max_tokens": 0}, {"default_scope": "a b"},
                                 {"scopes": frozenset({"a"})}, {"key_scopes": {"k": ()}},
                                 {"api_keys": frozenset({""})}])
def test_bad_server_configs_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ServerConfig(**{"models": ("m",), **bad})


GEN = Generation('{"name": "add", "arguments": {"a": 1}}', (1, 2, 3),
                 GenerationStats(steps=2, new_tokens=3, prompt_tokens=5, cached_tokens=2), "stop")


def test_answers_have_openai_shapes() -> None:
    content, calls = openai_calls(GEN.text)
    assert content == "" and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert openai_calls("plain") == ("plain", [])
    body = completion_body(id="i", created=1, model="m", content=content, calls=calls, gen=GEN,
                           scope="s")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    usage = chunk_body(id="i", created=1, model="m", delta=None, usage=body["usage"])
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert sse({"a": 1}) == b'data: {"a": 1}\n\n' and SSE_DONE == b"data: [DONE]\n\n"


async def test_the_bridge_stops_its_worker_when_the_consumer_leaves() -> None:
    made, closed = [], threading.Event()

    def endless() -> Iterator[int]:
        try:
            i = 0
            while True:
                made.append(i)
                yield i
                i += 1
        finally:
            closed.set()

    items = in_thread(endless)
    assert [await items.__anext__() for _ in range(3)] == [0, 1, 2]
    await items.aclose()
    assert closed.is_set()  # closed in the worker, before aclose returned
    count = len(made)
    await asyncio.sleep(0.05)
    assert len(made) == count


class _Scripted:
    """A Speculator double: streams a fixed reply in two deltas, generates it whole."""

    def __init__(self, reply: str) -> None:
        self.reply, self.tokenizer, self.calls = reply, FakeTokenizer(), []

    def _gen(self) -> Generation:
        return Generation(self.reply, tuple(range(len(self.reply))),
                          GenerationStats(steps=2, new_tokens=len(self.reply), prompt_tokens=4),
                          "stop")

    def stream(self, prompt: Any, max_new_tokens: int, **kw: Any) -> Stream:
        self.calls.append(kw)
        half = len(self.reply) // 2

        def run() -> Any:
            yield self.reply[:half]
            yield self.reply[half:]
            return self._gen()

        return Stream(run())

    def generate(self, prompt: Any, max_new_tokens: int, **kw: Any) -> Generation:
        self.calls.append(kw)
        return self._gen()

    def load(self) -> Load:
        return Load(running=0, waiting=0, max_batch=1)


async def _post(spec: Any, body: Any, **config: Any) -> httpx.Response:
    app = create_app(spec, ServerConfig(models=("m",), **config))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await client.post("/v1/chat/completions", content=content,
                                 headers={"Authorization": "Bearer k"})


async def test_the_app_streams_a_tool_call_and_refuses_bad_requests() -> None:
    spec = _Scripted('{"name": "add", "arguments": {"a": 1}}')
    res = await _post(spec, {**OK, "stream": True, "tools": [TOOL], "tool_choice": "required",
                             "stream_options": {"include_usage": True}}, api_keys=frozenset({"k"}))
    events = [e for e in res.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    calls = chunks[1]["choices"][0]["delta"]["tool_calls"]
    assert calls[0]["function"]["name"] == "add" and calls[0]["index"] == 0
    assert chunks[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[3]["usage"]["completion_tokens"] == len(spec.reply)
    assert spec.calls[-1]["scope"] == "default"
    plain = await _post(_Scripted("Hello."), {**OK, "user": "alice"})
    assert plain.json()["choices"][0]["message"]["content"] == "Hello."
    assert plain.json()["agentspec"]["scope"] == "alice"
    assert (await _post(spec, b"{", api_keys=frozenset({"k"}))).status_code == 400
    assert (await _post(spec, OK, api_keys=frozenset({"other"}))).status_code == 401
    assert (await _post(spec, {**OK, "x": "y" * 100}, max_body_bytes=50)).status_code == 413


class _Refusing(_Scripted):
    """A Speculator double whose stream raises ``error`` as it opens, as a Speculator
    refuses a request."""

    def __init__(self, error: Exception) -> None:
        super().__init__("")
        self.error = error

    def stream(self, prompt: Any, max_new_tokens: int, **kw: Any) -> Stream:
        raise self.error


# None of the first two messages holds "context": the code comes from the type. The last is
# the control: a plain ValueError saying "context" is not a context-length error.
@pytest.mark.parametrize(("error", "code"), [
    (ContextLengthError("prompt plus max_new_tokens is 9000 tokens, over the 4096 the model "
                        "attends"), "context_length_exceeded"),
    (GrammarError("the json grammar is malformed"), "invalid_schema"),
    (ValueError("the context of this request is odd"), "invalid_request")])
async def test_a_refused_request_is_answered_by_its_error_type(error: Exception,
                                                               code: str) -> None:
    """Chat and completions map the Speculator's refusal to the same code by its type."""
    app = create_app(_Refusing(error), ServerConfig(models=("m",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        chat = await client.post("/v1/chat/completions", json=OK)
        plain = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    for res, param, prefix in ((chat, "messages", ""), (plain, "prompt", "prompt: ")):
        assert res.status_code == 400, res.text
        assert res.json()["error"] == {"message": f"{prefix}{error}",
                                       "type": "invalid_request_error", "param": param,
                                       "code": code}


def test_only_the_request_s_errors_are_refusals() -> None:
    """An error that is not the request's (a RuntimeError) is no 400: it is raised on."""
    assert refused(RuntimeError("context"), param="messages") is None
    error = refused(ContextLengthError("too long"), param="prompt[1]", where="prompt[1]: ")
    assert error is not None and (error.status, error.code, error.param, error.message) == \
        (400, "context_length_exceeded", "prompt[1]", "prompt[1]: too long")


def test_serve_refuses_bad_options_before_loading(tmp_path: Any) -> None:
    """Bad input exits 2 and a model that is not there 3, one line each, no model loaded."""
    from typer.testing import CliRunner

    from agentspec.cli import app

    keys = tmp_path / "keys.json"
    keys.write_text('{"k": []}')
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    cases = [(["--keys", str(tmp_path / "none.json")], 2, "cannot read --keys"),
             (["--keys", str(keys)], 2, "scopes of a key"),
             (["--scope", "a b"], 2, "scope name"),
             (["--allow-scope", "a"], 2, "not in the allowed scopes"),
             (["--log-level", "loud"], 2, "--log-level"),
             (["--port", "70000"], 2, ""),
             (["--port", str(busy.getsockname()[1])], 1, "cannot listen"),
             (["--port", "0", "--model", "no-such-model"], 3, "unknown model")]
    try:
        for args, code, said in cases:
            res = CliRunner().invoke(app, ["serve", *args])
            assert res.exit_code == code, (args, res.output)
            assert said in res.output and "Traceback" not in res.output, (args, res.output)
    finally:
        busy.close()
