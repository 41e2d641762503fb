"""``POST /v1/completions``, log-probabilities on both endpoints, lone surrogates, and ``serve
--device/--dtype`` (issue 50), against the real server process (tests/server/conftest.py).

Every answer is compared with ``Speculator.generate`` in this process on the same prompt and
sampling: the text, the finish reason, the token count and, bitwise, every log-probability
(the server drafts from its memory and prompt lookup, this process from prompt lookup only:
the numbers come from the verifying rows, the same whatever the drafts). OpenAI's own client
reads the answers. The comparison is shown failing on answers a wrong server would give
(log-probabilities of the neighbouring tokens, a token dropped, the chat shape's alternatives
cut).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest

from agentspec.adapters.openai_logprobs import TokenText
from agentspec.adapters.openai_protocol import parse_chat_request, render
from agentspec.config import SamplingParams
from agentspec.text import encode_prompt
from agentspec.types import Generation
from tests.server.conftest import MASTER_KEY, MODEL, TENANT_KEYS, Server

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PROMPT = "The three primary colours are"
GREEDY = SamplingParams(logprobs=3)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=3)


@dataclass(frozen=True)
class Got:
    """What a client got: the text, why it ended, the token count, and per token its text,
    its log-probability and its alternatives ``{text: logprob}``."""

    text: str
    finish: str
    tokens: int
    token_texts: tuple[str, ...] = ()
    logprobs: tuple[float, ...] = ()
    top: tuple[tuple[tuple[str, float], ...], ...] = ()


def want(gen: Generation, text: TokenText, *, legacy: bool, prefix: str = "") -> Got:
    """What the server must answer for the in-process generation ``gen``: the legacy shape
    lists the chosen token among its alternatives, the chat shape the top ``k`` only."""
    lps = gen.logprobs or ()
    top = []
    for t in lps:
        alternatives = {text.text_of(i): v for i, v in t.top}
        if legacy:
            alternatives.setdefault(text.text_of(t.token_id), t.logprob)
        top.append(tuple(sorted(alternatives.items())))
    return Got(prefix + gen.text, gen.finish_reason, len(gen.token_ids),
               tuple(text.text_of(t.token_id) for t in lps), tuple(t.logprob for t in lps),
               tuple(top))


def assert_same(got: Got, gen: Generation, text: TokenText, *, legacy: bool = True,
                prefix: str = "") -> None:
    expected = want(gen, text, legacy=legacy, prefix=prefix)
    assert got == expected, f"server answered {got}, Speculator.generate gave {expected}"


def from_legacy(choice: Any, tokens: int) -> Got:
    lp = choice.logprobs
    if lp is None:
        return Got(choice.text, choice.finish_reason, tokens)
    return Got(choice.text, choice.finish_reason, tokens, tuple(lp.tokens),
               tuple(lp.token_logprobs), tuple(tuple(sorted(d.items())) for d in lp.top_logprobs))


def from_chat(choice: Any, tokens: int) -> Got:
    content = choice.logprobs.content if choice.logprobs is not None else []
    return Got(choice.message.content, choice.finish_reason, tokens,
               tuple(c.token for c in content), tuple(c.logprob for c in content),
               tuple(tuple(sorted((a.token, a.logprob) for a in c.top_logprobs))
                     for c in content))


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url, api_key=MASTER_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def text(spec: Any) -> TokenText:
    return TokenText.of(spec)


def post(server: Server, path: str, body: Any, key: str = MASTER_KEY,
         **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=json.dumps(body),
                      headers={"Authorization": f"Bearer {key}", **headers}, timeout=120)


# -- /v1/completions ----------------------------------------------------------------------------
def test_completions_with_logprobs_equal_generate(client: Any, spec: Any, text: TokenText) -> None:
    for sampling in (GREEDY, SAMPLED):
        gen = spec.generate(PROMPT, 8, sampling=sampling)
        c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                      temperature=sampling.temperature, top_p=sampling.top_p,
                                      seed=sampling.seed, logprobs=3)
        assert c.object == "text_completion" and c.usage.completion_tokens == len(gen.token_ids)
        assert_same(from_legacy(c.choices[0], c.usage.completion_tokens), gen, text)
        offsets = c.choices[0].logprobs.text_offset
        assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(gen.text)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == spec.generate(PROMPT, 8).text


def test_streamed_completion_carries_its_logprobs_chunk_by_chunk(client: Any, spec: Any,
                                                                  text: TokenText) -> None:
    gen = spec.generate(PROMPT, 12, sampling=GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            temperature=0, logprobs=3, stream=True,
                                            stream_options={"include_usage": True}))
    pieces = [c.choices[0] for c in chunks if c.choices]
    usage = [c.usage for c in chunks if c.usage is not None]
    joined = Got("".join(p.text for p in pieces),
                 next(p.finish_reason for p in pieces if p.finish_reason), usage[0].completion_tokens,
                 tuple(t for p in pieces for t in p.logprobs.tokens),
                 tuple(v for p in pieces for v in p.logprobs.token_logprobs),
                 tuple(tuple(sorted(d.items())) for p in pieces for d in p.logprobs.top_logprobs))
    assert_same(joined, gen, text)
    assert sum(1 for p in pieces if p.logprobs.tokens) >= 2  # spread over the chunks
    for p in pieces:  # each chunk's tokens are its own text
        assert "".join(p.logprobs.tokens) == p.text or not p.text


def test_echo_stop_and_token_id_prompts(client: Any, spec: Any) -> None:
    ids = encode_prompt(spec.tokenizer, PROMPT)
    gen = spec.generate(PROMPT, 8)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + gen.text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                       echo=True)
    assert by_ids.choices[0].text == spec.tokenizer.decode(ids) + gen.text
    stop = gen.text.split()[1]
    stopped = spec.generate(PROMPT, 8, stop=[stop])
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    stop=[stop])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (stopped.text, "stop")
    # A batch: one choice per prompt, in order, each its own generation.
    other = "def add(a, b):"
    batch = client.completions.create(model=MODEL, prompt=[ids, other], max_tokens=6,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [spec.generate(ids, 6).text,
                                               spec.generate(other, 6).text]
    assert batch.usage.completion_tokens == sum(
        len(spec.generate(p, 6).token_ids) for p in (ids, other))
    streamed = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=8,
                                              temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == spec.tokenizer.decode(ids) + gen.text


def test_completions_keep_keys_and_scopes(server: Server) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    assert post(server, "/completions", body, key="nope").status_code == 401
    tenant = next(iter(TENANT_KEYS))
    r = post(server, "/completions", body, key=tenant)
    assert r.status_code == 200 and r.json()["agentspec"]["scope"] == TENANT_KEYS[tenant][0]
    denied = post(server, "/completions", body, key=tenant, **{"X-Agentspec-Scope": "other"})
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "scope_not_allowed"


# -- chat completions' logprobs -----------------------------------------------------------------
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def chat_reference(spec: Any, top: int, **kw: Any) -> Generation:
    req = parse_chat_request({"model": MODEL, "messages": MESSAGES, **kw}, models=[MODEL],
                             max_tokens=48)
    rendered = render(req, spec.tokenizer)
    return spec.generate(rendered.prompt, req.max_tokens,
                         sampling=replace(rendered.sampling, logprobs=top), stop=req.stop)


def test_chat_logprobs_plain_and_streamed_equal_generate(client: Any, spec: Any,
                                                         text: TokenText) -> None:
    gen = chat_reference(spec, 2, max_tokens=10, temperature=0)
    c = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert_same(from_chat(c.choices[0], c.usage.completion_tokens), gen, text, legacy=False)
    entry = c.choices[0].logprobs.content[0]
    assert bytes(entry.bytes).decode() == entry.token and len(entry.top_logprobs) == 2
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, stream_options={"include_usage": True}))
    pieces = [ch.choices[0] for ch in chunks if ch.choices]
    content = [e for p in pieces if p.logprobs for e in p.logprobs.content]
    usage = next(ch.usage for ch in chunks if ch.usage is not None)
    streamed = Got("".join(p.delta.content or "" for p in pieces),
                   next(p.finish_reason for p in pieces if p.finish_reason),
                   usage.completion_tokens, tuple(e.token for e in content),
                   tuple(e.logprob for e in content),
                   tuple(tuple(sorted((a.token, a.logprob) for a in e.top_logprobs))
                         for e in content))
    assert_same(streamed, gen, text, legacy=False)
    none = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert none.choices[0].logprobs is None
    only = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                          temperature=0, logprobs=True)
    assert [e.top_logprobs for e in only.choices[0].logprobs.content] == [[]] * 4


def test_the_comparison_fails_a_wrong_server(client: Any, spec: Any, text: TokenText) -> None:
    """Answers a wrong server would give fail :func:`assert_same`: the numbers of the
    neighbouring token, a token dropped, the chat shape's alternatives cut to one."""
    gen = spec.generate(PROMPT, 8, sampling=GREEDY)
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  logprobs=3)
    got = from_legacy(c.choices[0], c.usage.completion_tokens)
    assert_same(got, gen, text)
    assert gen.logprobs is not None
    shifted = replace(gen, logprobs=(*gen.logprobs[1:], gen.logprobs[-1]))
    short = replace(gen, token_ids=gen.token_ids[:-1], logprobs=gen.logprobs[:-1],
                    text=spec.tokenizer.decode(gen.token_ids[:-1]))
    cut = replace(gen, logprobs=tuple(replace(t, top=t.top[:1]) for t in gen.logprobs))
    for wrong in (shifted, short):
        with pytest.raises(AssertionError):
            assert_same(got, wrong, text)
    with pytest.raises(AssertionError):
        assert_same(replace(got, top=want(cut, text, legacy=False).top), gen, text)


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/completions", {"n": 2}, "n"),
    ("/completions", {"best_of": 3}, "best_of"),
    ("/completions", {"suffix": "x"}, "suffix"),
    ("/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/completions", {"logprobs": 21}, "logprobs"),
    ("/completions", {"prompt": []}, "prompt"),
    ("/completions", {"prompt": [1.5, 2]}, "prompt[0]"),
    ("/completions", {"prompt": [[1, -2]]}, "prompt[0][1]"),
    ("/completions", {"prompt": [10 ** 9]}, "prompt"),
    ("/completions", {"prompt": ["a", "b"], "stream": True}, "prompt"),
    ("/completions", {"messages": []}, "messages"),
    ("/completions", {"max_tokens": 10 ** 6}, "max_tokens"),
    ("/completions", {"prompt": "\ud800 hi"}, "prompt"),
    ("/completions", {"prompt": ["ok", "x\udfff"]}, "prompt[1]"),
    ("/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]},
     "messages[0].content"),
    ("/chat/completions", {"user": "\udc00"}, "user"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "\ud800": 1}, "body"),
    ("/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
         "function": {"name": "f", "arguments": '{"city": "\\ud800"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]},
     "messages[1].tool_calls[0].function.arguments.city"),
])
def test_bad_requests_get_a_400_naming_the_field(server: Server, path: str,
                                                 fields: dict[str, Any], param: str) -> None:
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"prompt": PROMPT} if path == "/completions" else {"messages": MESSAGES})
    # ensure_ascii (json.dumps' default) writes a lone surrogate as its \\u escape: valid JSON.
    r = post(server, path, {**base, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert post(server, path, base).status_code == 200  # and the server goes on


# -- serve --device --dtype ---------------------------------------------------------------------
@pytest.mark.parametrize(("args", "named"), [(["--device", "tpu0"], "--device 'tpu0'"),
                                              (["--device", "cuda:7"], "--device 'cuda:7'"),
                                              (["--dtype", "int8"], "--dtype 'int8'")])
def test_serve_refuses_a_bad_device_or_dtype_naming_it(args: list[str], named: str) -> None:
    from typer.testing import CliRunner

    from agentspec.cli import app

    result = CliRunner().invoke(app, ["serve", "--port", "0", *args])
    assert result.exit_code == 2, result.output
    assert named in result.output


def test_serve_loads_the_model_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from typer.testing import CliRunner

    from agentspec.cli import app

    serve_cli = importlib.import_module("agentspec.cli.serve")  # the package's ``serve`` is the command

    asked: dict[str, Any] = {}

    def load(model: str, url: str, config: Any = None, **kw: Any) -> Any:
        asked.update(kw)
        raise SystemExit(0)  # stop before the model loads

    monkeypatch.setattr(serve_cli, "load_speculator", load)
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--device", "cpu", "--dtype",
                                      "bf16"])
    assert result.exit_code == 0, result.output
    assert asked == {"device": "cpu", "dtype": "bf16", "quantize": None, "speculate": True}
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--no-speculate"])
    assert result.exit_code == 0, result.output
    assert asked == {"device": None, "dtype": None, "quantize": None, "speculate": False}


def test_load_speculator_without_speculation_is_plain_and_keeps_no_memory(tmp_path: Any) -> None:
    from agentspec.cli.common import load_speculator

    spec = load_speculator(MODEL, f"sqlite:///{tmp_path / 'm.db'}", speculate=False)
    assert spec.speculate is False and spec.memory is None
    assert not (tmp_path / "m.db").exists()
