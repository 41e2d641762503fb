"""Tool calls in each model's own format: the registry's grammars, renderers and parsers.

For every format (``json``, ``hermes``, ``llama3``, ``mistral``, ``mistral_v11``, ``phi``, ``granite``):

- the grammar admits valid calls and refuses wrong ones (a wrong or unchosen tool, a missing
  required argument, a wrong type, a malformed wrapper), fed token by token through the
  compiled grammar's matcher on the packaged SmolLM2 tokenizer;
- ``parse(render(calls))`` gives the calls back;
- a property test over random tools with random schemas (strings with quotes, escapes,
  unicode and the formats' own tags, numbers, booleans, enums, nested objects, arrays):
  :data:`SAMPLES` valid answers per format, every one admitted and parsed back equal, and as
  many wrong ones, none admitted.

The same checks are shown failing on deliberately wrong implementations: a parser that keeps
only the first of parallel calls, a grammar without its format's wrapper, and an ``auto``
grammar whose plain text may start like a call.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("llguidance")

from agentspec.adapters.chat import (  # noqa: E402
    CallHoldback,
    build_prompt,
    call_grammar,
    calls_text,
    parse_tool_calls,
    resolve_tool_format,
)
from agentspec.grammar import Grammar, GrammarError  # noqa: E402
from agentspec.grammar.tool_formats import (  # noqa: E402
    FORMATS,
    Call,
    Parsed,
    ToolFormat,
    detect_tool_format,
    tool_format,
)

SAMPLES = 500  # valid answers per format in the property test (and as many wrong ones)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
PARALLEL = {name for name, f in FORMATS.items() if f.listed or (f.between is not None and f.wrapped)}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from agentspec.engine.load import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct")[1]))


class Matcher:
    """Feeds text through a compiled grammar's matcher, as generation would: the tokenizer's
    tokens one by one; admitted when every token is consumed and the grammar may end there."""

    def __init__(self, tokenizer: Any, encode: Callable[[str], list[int]] | None = None) -> None:
        from agentspec.grammar.tokenizer import ll_tokenizer

        self.tokenizer = tokenizer
        self.encode = encode or (lambda text: tokenizer.encode(text, add_special_tokens=False))
        self.ll = ll_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                               json_slices=True)
        self._pristine: dict[str, Any] = {}

    def admits(self, grammar: Grammar, text: str) -> bool:
        import llguidance

        if grammar.spec not in self._pristine:
            self._pristine[grammar.spec] = llguidance.LLMatcher(self.ll, grammar.spec)
        matcher = self._pristine[grammar.spec].deep_copy()
        ids = self.encode(text)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting() \
            and not matcher.is_error()


@pytest.fixture(scope="module")
def matcher(tokenizer: Any) -> Matcher:
    return Matcher(tokenizer)


# -- the registry ------------------------------------------------------------------------------

def test_each_format_writes_its_models_layout() -> None:
    calls = [("add", {"a": 1, "b": "x\"y"}), ("get_weather", {"city": "Zürich"})]
    one = [calls[0]]
    assert FORMATS["json"].render(one) == '{"name": "add", "arguments": {"a": 1, "b": "x\\"y"}}'
    assert FORMATS["llama3"].render(one) == '{"name": "add", "parameters": {"a": 1, "b": "x\\"y"}}'
    assert FORMATS["hermes"].render(calls) == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x\\"y"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')
    listed = ('[{"name": "add", "arguments": {"a": 1, "b": "x\\"y"}}, '
              '{"name": "get_weather", "arguments": {"city": "Zürich"}}]')
    assert FORMATS["mistral"].render(calls) == "[TOOL_CALLS] " + listed
    assert FORMATS["mistral_v11"].render(calls) == (
        '[TOOL_CALLS]add[ARGS]{"a": 1, "b": "x\\"y"}[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}')
    assert FORMATS["phi"].render(calls) == "<|tool_call|>" + listed + "<|/tool_call|>"
    assert FORMATS["granite"].render(calls) == "<|tool_call|>" + listed


@pytest.mark.parametrize(("template", "name"), [
    ("{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>\n{{ call | tojson }}\n</tool_call>",
     "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
     "[TOOL_CALLS] [{{ calls }}]", "mistral"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
     "{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments }}"
     "{% endfor %}", "mistral_v11"),
    ("{% if tools %}Reply as {\"name\": function name, \"parameters\": dict}{% endif %}"
     "{% if m.role == 'ipython' %}<|python_tag|>{% endif %}", "llama3"),
    ("{% if 'tools' in message %}<|tool|>{{ message['tools'] }}<|/tool|>{% endif %}", "phi"),
    ("{% if tools %}<|start_of_role|>available_tools<|end_of_role|>{% endif %}"
     "<|tool_call|>{{ calls | tojson }}", "granite"),
    ("{% if tools %}{{ tools | tojson }}{% endif %}{{ m.content }}", "json"),
    ("{{ '<|im_start|>' + m.role + m.content }}<tool_call>", "json"),  # renders no tools
    (None, "json"),
])
def test_the_format_is_read_from_the_chat_template(template: str | None, name: str) -> None:
    assert detect_tool_format(template) == name

    class Tok:
        chat_template = template

    assert resolve_tool_format(Tok()).name == name
    assert resolve_tool_format(Tok(), "mistral").name == "mistral"  # the override wins


def test_an_unknown_format_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'bogus'.*json, hermes, llama3, mistral, mistral_v11, phi, granite"):
        tool_format("bogus")
    with pytest.raises(GrammarError, match="'bogus'"):
        Grammar.tool_calls([WEATHER], tool_format="bogus")
    with pytest.raises(GrammarError, match="json format only"):
        Grammar.tool_calls([WEATHER], tool_format="hermes", as_list=True)


def test_an_unknown_format_is_refused_by_each_front_end(fake_spec: Any) -> None:
    from agentspec.adapters.langchain import ChatAgentSpec
    from agentspec.adapters.openai_server import ServerConfig

    with pytest.raises(ValueError, match=r"unknown tool format 'hermez'; known formats: json"):
        ChatAgentSpec(speculator=fake_spec, tool_format="hermez")
    with pytest.raises(ValueError, match=r"unknown tool format 'hermez'; known formats: json"):
        ServerConfig(models=("m",), tool_format="hermez")
    assert ChatAgentSpec(speculator=fake_spec, tool_format="phi").tool_format == "phi"


def test_serve_tool_format_reaches_the_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """``agentspec serve --tool-format``: a known name becomes the server's config (caught
    there, before any model loads; ``OpenAIServer`` reads it: tests/server/
    test_tool_formats_served.py), an unknown one exits 2 naming the known formats."""
    pytest.importorskip("uvicorn")
    from typer.testing import CliRunner

    from agentspec.adapters import openai_server
    from agentspec.cli import app

    configs: list[Any] = []

    class Caught(Exception):
        pass

    real = openai_server.ServerConfig

    def config(**fields: Any) -> Any:
        configs.append(real(**fields))
        raise Caught

    monkeypatch.setattr(openai_server, "ServerConfig", config)
    res = CliRunner().invoke(app, ["serve", "--port", "0", "--tool-format", "hermes"])
    assert isinstance(res.exception, Caught), res.output
    monkeypatch.setattr(openai_server, "ServerConfig", real)
    assert [c.tool_format for c in configs] == ["hermes"]
    res = CliRunner().invoke(app, ["serve", "--port", "0", "--tool-format", "hermez"])
    assert res.exit_code == 2 and "unknown tool format 'hermez'" in res.output, res.output
    assert "json, hermes" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_earlier_calls_are_written_back_in_the_format(name: str) -> None:
    """The chat model and the server write an assistant turn's calls the same way, in the
    format the answer is constrained to."""
    from langchain_core.messages import AIMessage, HumanMessage

    from agentspec.adapters.langchain import to_chat_messages
    from agentspec.adapters.openai_protocol import parse_chat_request, render
    from tests.adapters.adapter_fakes import FakeTokenizer

    lc = to_chat_messages([HumanMessage("1+2?"), AIMessage("Adding.", tool_calls=[
        {"name": "add", "args": {"a": 1, "b": 2}, "id": "c1"}])], tool_format=name)
    req = parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}]},
        models=["m"], max_tokens=8)
    prompt = render(req, FakeTokenizer(), tool_format=name).prompt
    want = "Adding.\n" + FORMATS[name].render([("add", {"a": 1, "b": 2})])
    assert lc[1]["content"] == want and isinstance(prompt, list) and prompt[1]["content"] == want
    assert json.loads(req.messages[1]["content"].split("\n")[1])["arguments"] == {"a": 1, "b": 2}


# -- the grammars ------------------------------------------------------------------------------

# Per format: texts with a wrong wrapper around a valid call of get_weather.
CALL = ("get_weather", {"city": "Paris", "unit": "celsius"})
MALFORMED = {
    "json": ['```json\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
             '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'],
    "llama3": ['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
               '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'],
    "hermes": ['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'],
    "mistral": ['[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
                '[TOOL_CALLS] {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'],
    "mistral_v11": ['[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
                    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
                    'get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
                    '[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}',
                    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]'],
    "phi": ['<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
            '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]<|/tool_call|>'],
    "granite": ['<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]<|/tool_call|>',
                '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'],
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_grammar_admits_valid_calls_and_refuses_wrong_ones(name: str, matcher: Matcher) -> None:
    fmt = FORMATS[name]
    grammar = call_grammar([WEATHER, ADD], "required", name)
    assert grammar is not None and not grammar.or_text
    assert matcher.admits(grammar, fmt.render([CALL]))
    assert matcher.admits(grammar, fmt.render([("add", {"a": 1.5, "b": -2})]))
    parallel = fmt.render([CALL, ("add", {"a": 1, "b": 2})])
    assert matcher.admits(grammar, parallel) == (name in PARALLEL)
    wrong = {"a wrong tool": fmt.render([("get_time", {"city": "Paris", "unit": "celsius"})]),
             "a missing argument": fmt.render([("get_weather", {"city": "Paris"})]),
             "a wrong type": fmt.render([("get_weather", {"city": 7, "unit": "celsius"})]),
             "an undeclared argument": fmt.render([("add", {"a": 1, "b": 2, "c": 3})]),
             "a value off the enum": fmt.render([("get_weather", {"city": "P", "unit": "kelvin"})]),
             "plain text": "The weather is fine."}
    for i, text in enumerate(MALFORMED[name]):
        wrong[f"malformed wrapper {i}"] = text
    admitted = [why for why, text in wrong.items() if matcher.admits(grammar, text)]
    assert admitted == [], f"{name} admitted {admitted}"
    # A named tool_choice: calls of that tool only, in every format.
    named = call_grammar([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, name)
    assert named is not None
    assert matcher.admits(named, fmt.render([("add", {"a": 1, "b": 2})]))
    assert not matcher.admits(named, fmt.render([CALL]))
    assert call_grammar([WEATHER, ADD], "none", name) is None


@pytest.mark.parametrize("name", list(FORMATS))
def test_auto_is_a_call_or_text_that_does_not_start_like_one(name: str, tokenizer: Any) -> None:
    """Under ``auto`` the first token decides: a token that starts a call is constrained as
    the call from there on; any other (not whitespace) starts free text."""
    grammar = call_grammar([WEATHER, ADD], "auto", name)
    assert grammar is not None and grammar.or_text
    assert first_token_check(grammar, FORMATS[name], tokenizer) == []


def first_token_check(grammar: Grammar, fmt: ToolFormat, tokenizer: Any) -> list[str]:
    """What is wrong with ``auto``'s first-token rule on ``grammar`` (empty: nothing)."""
    from agentspec.grammar.state import GrammarState

    def state() -> GrammarState:
        return GrammarState(grammar, tokenizer, vocab_size=len(tokenizer),
                            eos_ids=[tokenizer.eos_token_id])

    ids = tokenizer.encode(fmt.render([CALL]), add_special_tokens=False)
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    problems = []
    first = state()
    mask = first.allowed_now()
    if mask is None or not (mask[0, ids[0]] and mask[0, hello[0]]):
        problems.append("the first mask must allow a call's first token and a text start")
    first.advance(ids[:1])
    after = first.allowed_now()  # the call has begun: only its continuation
    if after is None:
        problems.append(f"{tokenizer.decode(ids[:1])!r} started free text, not a call")
    elif after[0, hello[0]] or not after[0, ids[1]]:
        problems.append("after a call's first token, only the call may follow")
    first.close()
    text = state()
    text.advance(hello)
    if text.allowed_now() is not None:
        problems.append("text that does not start like a call is not free")
    text.close()
    whole = state()
    whole.advance(ids)
    end = whole.allowed_now()
    if end is None or not end[0, tokenizer.eos_token_id]:
        problems.append("a whole call may not end the output")
    whole.close()
    return problems


def test_a_text_start_that_may_start_a_call_fails_the_auto_check(tokenizer: Any) -> None:
    """The hermes grammar with the json format's text start (which lets ``<`` begin free
    text): its calls would go unconstrained, and the check sees it."""
    right = call_grammar([WEATHER, ADD], "auto", "hermes")
    assert right is not None
    wrong = Grammar(right.kind, right.spec, right.tools, or_text=True, text_start="")
    problems = first_token_check(wrong, FORMATS["hermes"], tokenizer)
    assert any("started free text" in p for p in problems)


# -- parsing -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FORMATS))
def test_parse_gives_back_what_render_wrote(name: str) -> None:
    fmt = FORMATS[name]
    calls = [CALL, ("add", {"a": 1, "b": {"nested": ["x", None, True]}})]
    for batch in ([calls[0]], calls):
        parsed = fmt.parse(fmt.render(batch))
        assert parsed == Parsed("", tuple(Call(n, a) for n, a in batch), ())
        with_text = fmt.parse(calls_text("Let me check.", batch, name))
        assert with_text.content == "Let me check." and len(with_text.calls) == len(batch)
    content, valid, invalid = parse_tool_calls(fmt.render(calls), name)
    assert [(c["name"], c["args"]) for c in valid] == calls and not invalid and content == ""
    assert len({c["id"] for c in valid}) == 2
    assert fmt.parse("Paris is sunny today.") == Parsed("Paris is sunny today.", (), ())


@pytest.mark.parametrize("name", list(FORMATS))
def test_malformed_or_cut_off_calls_are_invalid_never_raised(name: str) -> None:
    fmt = FORMATS[name]
    text = fmt.render([CALL])
    for cut in (3, len(fmt.open) + 5, len(text) // 2):
        content, valid, invalid = parse_tool_calls(text[:cut], name)
        assert not valid and len(invalid) == 1 and invalid[0]["error"], (name, text[:cut])
        assert invalid[0]["type"] == "invalid_tool_call"
    bad_args = fmt.render([("add", 3)])
    _, valid, invalid = parse_tool_calls(bad_args, name)
    assert not valid and invalid[0]["name"] == "add" and "object" in invalid[0]["error"]


@pytest.mark.parametrize("name", list(FORMATS))
def test_streamed_calls_are_held_back_and_text_is_not(name: str) -> None:
    fmt = FORMATS[name]
    text = fmt.render([CALL])
    hold = CallHoldback(True, name)
    shown = "".join(hold.push(text[i:i + 2]) for i in range(0, len(text), 2))
    assert shown == "" and hold.held == text
    plain = CallHoldback(True, name)
    assert plain.push("Sunny") == "Sunny" and plain.held == ""


def test_the_system_block_teaches_the_format_it_constrains(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    json_prompt = build_prompt(tokenizer, messages, tools=[WEATHER])
    assert isinstance(json_prompt, list)
    assert json_prompt[0]["content"].endswith(
        'To call a tool, reply with only a JSON object: {"name": "<tool name>", "arguments": '
        '{<argument>: <value>}}. Otherwise answer normally.')
    for name in ("hermes", "mistral", "phi"):
        prompt = build_prompt(tokenizer, messages, tools=[WEATHER], tool_format=name)
        assert isinstance(prompt, list) and FORMATS[name].shape() in prompt[0]["content"]


def test_tools_go_on_the_system_turn_for_templates_that_read_them_there() -> None:
    class PhiLike:
        chat_template = ("{% for message in messages %}{% if 'tools' in message %}<|tool|>"
                         "{{ message['tools'] }}<|/tool|>{% endif %}{% endfor %}")
        bos_token = None
        seen: list[Any] = []

        def apply_chat_template(self, messages: Any, **kw: Any) -> str:
            self.seen.append(messages)
            return "rendered"

    tok = PhiLike()
    assert build_prompt(tok, [{"role": "user", "content": "hi"}], tools=[WEATHER]) == "rendered"
    system = tok.seen[-1][0]
    assert system["role"] == "system" and json.loads(system["tools"]) == [WEATHER]


# Qwen3's switch, as its template has it: with thinking off, an empty think block opens the
# answer (the model's non-thinking mode); tools listed for <tool_call> blocks.
QWEN3_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for t in tools %}{{- t | tojson }}"
    "{%- endfor %}{{- '</tools>\\nCall a tool in <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
EMPTY_THINK = "<think>\n\n</think>\n\n"


def test_a_constrained_answer_is_asked_for_in_the_models_non_thinking_mode(tokenizer: Any) -> None:
    """A grammar refuses the ``<think>`` a thinking model opens with, so a constrained call
    renders the template with thinking off; an unconstrained one is left as the user has it.
    Through the server's renderer and the chat model alike."""
    import copy

    from agentspec.adapters.langchain import ChatAgentSpec
    from agentspec.adapters.openai_protocol import parse_chat_request, render
    from tests.adapters.adapter_fakes import FakeSpeculator

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN3_LIKE
    assert resolve_tool_format(tok).name == "hermes"
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    on = build_prompt(tok, ask, tools=[WEATHER], constrained=True)
    off = build_prompt(tok, ask, tools=[WEATHER])
    assert isinstance(on, str) and on.endswith(EMPTY_THINK) and "<tools>" in on
    assert isinstance(off, str) and not off.endswith(EMPTY_THINK)
    json_mode = build_prompt(tok, ask, system="Reply in JSON.", constrained=True)
    assert isinstance(json_mode, str) and json_mode.endswith(EMPTY_THINK)
    assert isinstance(build_prompt(tok, ask), list)  # free text: the messages, as ever
    for choice, thinking_off in (("auto", True), ("required", True), ("none", False)):
        req = parse_chat_request({"model": "m", "messages": ask, "tools": [WEATHER],
                                  "tool_choice": choice}, models=["m"], max_tokens=8)
        prompt = render(req, tok).prompt
        assert (isinstance(prompt, str) and prompt.endswith(EMPTY_THINK)) == thinking_off, choice
    fake = FakeSpeculator()
    fake.tokenizer = tok
    chat = ChatAgentSpec(speculator=fake, max_tokens=8)
    chat.bind_tools([WEATHER], tool_choice="auto").invoke("Weather in Paris?")
    assert fake.calls[-1]["prompt"].endswith(EMPTY_THINK)
    chat.invoke("Weather in Paris?")
    assert not isinstance(fake.calls[-1]["prompt"], str) \
        or not fake.calls[-1]["prompt"].endswith(EMPTY_THINK)


# -- the property test -------------------------------------------------------------------------

_PIECES = ["a", "Paris", " ", '"', "\\", "\n", "\t", "é", "中文", "😀", "\u0001", "/", "'", "{",
           "}", "[", "]", ",", ":", "<tool_call>", "</tool_call>", "[TOOL_CALLS]",
           "<|tool_call|>", "\\n", "null", "true"]


def _text(rng: random.Random, most: int = 6) -> str:
    return "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, most)))


def _ident(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefgh_xyz") for _ in range(rng.randint(1, 8)))


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"enum": sorted({_text(rng, 3) or "e" for _ in range(rng.randint(1, 4))})}
    if kind == "object":
        return random_object(rng, depth + 1)
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1)}
    return {"type": kind}


def random_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = list(dict.fromkeys(_ident(rng) for _ in range(rng.randint(0 if depth else 1, 4))))
    props = {n: random_schema(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def random_value(rng: random.Random, schema: dict[str, Any]) -> Any:
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        return {k: random_value(rng, s) for k, s in schema["properties"].items()
                if k in schema["required"] or rng.random() < 0.5}
    if kind == "array":
        return [random_value(rng, schema["items"]) for _ in range(rng.randint(0, 3))]
    if kind == "string":
        return _text(rng)
    if kind == "integer":
        return rng.choice([0, 7, -3, 2 ** 40, rng.randint(-10 ** 6, 10 ** 6)])
    if kind == "number":
        return rng.choice([0.5, -2.25, 1e-07, 1.5e20, 3, rng.uniform(-1e3, 1e3)])
    return rng.random() < 0.5


def wrong_type(rng: random.Random, schema: dict[str, Any]) -> Any:
    """A value ``schema`` refuses."""
    if "enum" in schema:
        return "".join(schema["enum"]) + "!"  # longer than any member: not among them
    return {"string": 12, "integer": "12", "number": "1.5", "boolean": "true",
            "object": [1], "array": {"x": 1}}[schema["type"]]


class Sample:
    """A random tool set, a tool_choice and a way to draw valid and wrong answers."""

    def __init__(self, rng: random.Random, fmt: ToolFormat) -> None:
        self.rng, self.fmt = rng, fmt
        names = list(dict.fromkeys(f"t_{_ident(rng)}" for _ in range(rng.randint(1, 3))))
        self.tools = [{"type": "function", "function": {"name": n, "parameters": random_object(rng)}}
                      for n in names]
        self.params = {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}
        self.choice = rng.choice(["required", "required", names[-1]])
        self.allowed = names if self.choice == "required" else [self.choice]

    def calls(self) -> list[tuple[str, Any]]:
        count = self.rng.randint(1, 3) if self.fmt.name in PARALLEL else 1
        return [(n, random_value(self.rng, self.params[n]))
                for n in (self.rng.choice(self.allowed) for _ in range(count))]

    def wrong(self) -> str:
        """A rendered answer with one thing wrong in one call (or in the wrapper)."""
        rng, calls = self.rng, self.calls()
        at = rng.randrange(len(calls))
        name, args = calls[at]
        params = self.params[name]
        ways = ["name", "wrapper"]
        if params["required"]:
            ways.append("missing")
        if args:
            ways.append("type")
        way = rng.choice(ways)
        if way == "name":
            others = [n for n in self.params if n not in self.allowed]
            unknown = name + "x"
            while unknown in self.params:
                unknown += "x"
            calls[at] = (rng.choice(others) if others and rng.random() < 0.5 else unknown, args)
        elif way == "missing":
            gone = rng.choice(params["required"])
            calls[at] = (name, {k: v for k, v in args.items() if k != gone})
        elif way == "type":
            key = rng.choice(list(args))
            calls[at] = (name, {**args, key: wrong_type(rng, params["properties"][key])})
        else:
            return malformed(rng, self.fmt, calls)
        return self.fmt.render(calls)


def malformed(rng: random.Random, fmt: ToolFormat, calls: list[tuple[str, Any]]) -> str:
    """``calls`` rendered with a broken wrapper: in another format's wrapper, without its own,
    or with its first or last characters lost."""
    text = fmt.render(calls)
    others = [f for f in FORMATS.values()
              if (f.open, f.close, f.listed, f.args_key) != (fmt.open, fmt.close, fmt.listed,
                                                           fmt.args_key)]
    way = rng.randrange(3)
    if way == 0:
        return rng.choice(others).render(calls)
    if way == 1:
        return text[1:]
    return text[:-1]


def property_check(name: str | ToolFormat, seed: int, *,
                   grammar_of: Callable[[Sample], Grammar | None],
                   parse: Callable[[str], Parsed], admits: Callable[[Grammar, str], bool]
                   ) -> dict[str, int]:
    """Counts over :data:`SAMPLES` valid answers and as many wrong ones in format ``name`` (a
    registered name, or a format bound to a tokenizer)."""
    rng = random.Random(seed)
    fmt = tool_format(name)
    out = {"valid": 0, "admitted": 0, "parsed back": 0, "wrong": 0, "wrong admitted": 0}
    while out["valid"] < SAMPLES:
        sample = Sample(rng, fmt)
        grammar = grammar_of(sample)
        assert grammar is not None
        for _ in range(10):
            calls = sample.calls()
            text = fmt.render(calls)
            out["valid"] += 1
            out["admitted"] += admits(grammar, text)
            parsed = parse(text)
            out["parsed back"] += parsed == Parsed("", tuple(Call(n, a) for n, a in calls), ())
            out["wrong"] += 1
            out["wrong admitted"] += admits(grammar, sample.wrong())
    return out


def _grammar(sample: Sample) -> Grammar | None:
    return call_grammar(sample.tools, sample.choice, sample.fmt)


@pytest.mark.parametrize("name", list(FORMATS))
def test_sampled_calls_are_all_admitted_and_parsed_back_and_no_wrong_one_admitted(
        name: str, matcher: Matcher) -> None:
    started = time.perf_counter()
    got = property_check(name, 49, grammar_of=_grammar, parse=FORMATS[name].parse,
                         admits=matcher.admits)
    n = got["valid"]
    assert n >= SAMPLES and got["wrong"] == n
    assert got == {"valid": n, "admitted": n, "parsed back": n, "wrong": n, "wrong admitted": 0}, got
    assert time.perf_counter() - started < 60  # keeps the file within its budget


def test_a_parser_that_drops_parallel_calls_fails_the_property_check(matcher: Matcher) -> None:
    def first_only(text: str) -> Parsed:
        parsed = FORMATS["hermes"].parse(text)
        return Parsed(parsed.content, parsed.calls[:1], parsed.invalid)

    got = property_check("hermes", 49, grammar_of=_grammar, parse=first_only,
                         admits=lambda g, t: True)
    assert got["parsed back"] < got["valid"]


def test_a_grammar_without_the_wrapper_fails_the_property_check(matcher: Matcher) -> None:
    """The mistral check run on the json grammar of the same tools: the calls inside their
    wrapper are refused, and bare ones (a malformed mistral answer) admitted."""
    def bare(sample: Sample) -> Grammar | None:
        return call_grammar(sample.tools, sample.choice, "json")

    got = property_check("mistral", 49, grammar_of=bare, parse=FORMATS["mistral"].parse,
                         admits=matcher.admits)
    assert got["admitted"] == 0 and got["wrong admitted"] > 0


# -- wrappers that are special tokens ------------------------------------------------------------
# Mistral's [TOOL_CALLS] and Phi-4-mini's and Granite's <|tool_call|> are special tokens in
# those models' tokenizers: bound to such a tokenizer, a format's grammar admits its wrapper as
# that one token, never spelled out, and the text keeps it where decoding drops special tokens.

SPECIAL_FORMATS = ("mistral", "mistral_v11", "phi", "granite")


@pytest.fixture(scope="module")
def wrapper_tok() -> Any:
    from tests.families import wrapper_tokenizer

    return wrapper_tokenizer()


def as_model_writes(tok: Any) -> Callable[[str], list[int]]:
    """Text to ids as a model on ``tok`` writes an answer: a wrapper outside JSON values as its
    special token, JSON values and other text spelled out in ordinary tokens (a string value
    holding ``[TOOL_CALLS]`` is text, not the token)."""
    from tests.families import WRAPPER_TOKENS

    ids = dict(zip(WRAPPER_TOKENS, tok.convert_tokens_to_ids(list(WRAPPER_TOKENS)), strict=True))
    decoder = json.JSONDecoder()

    def spelled(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []

    def encode(text: str) -> list[int]:
        out: list[int] = []
        pos = plain = 0
        while pos < len(text):
            wrapper = next((w for w in WRAPPER_TOKENS if text.startswith(w, pos)), None)
            end = None
            if wrapper is None and text[pos] in "{[":
                try:
                    end = decoder.raw_decode(text, pos)[1]
                except json.JSONDecodeError:
                    end = None
            if wrapper is None and end is None:
                pos += 1
                continue
            out += spelled(text[plain:pos])
            if wrapper is not None:
                out.append(ids[wrapper])
                pos += len(wrapper)
            else:
                assert end is not None
                out += spelled(text[pos:end])
                pos = end
            plain = pos
        return out + spelled(text[plain:])
    return encode


@pytest.fixture(scope="module")
def wrapper_matcher(wrapper_tok: Any) -> Matcher:
    return Matcher(wrapper_tok, as_model_writes(wrapper_tok))


def test_formats_bind_to_the_special_tokens_their_tokenizer_has(wrapper_tok: Any,
                                                                tokenizer: Any) -> None:
    ids = dict(zip(("[TOOL_CALLS]", "<|tool_call|>", "<|/tool_call|>"),
                   wrapper_tok.convert_tokens_to_ids(["[TOOL_CALLS]", "<|tool_call|>",
                                                      "<|/tool_call|>"]), strict=True))
    assert FORMATS["mistral"].on(wrapper_tok).tokens == (("[TOOL_CALLS]", ids["[TOOL_CALLS]"]),)
    assert FORMATS["phi"].on(wrapper_tok).tokens == (("<|tool_call|>", ids["<|tool_call|>"]),
                                                     ("<|/tool_call|>", ids["<|/tool_call|>"]))
    assert FORMATS["granite"].on(wrapper_tok).keep == (ids["<|tool_call|>"],)
    for name in ("json", "hermes", "llama3"):
        assert FORMATS[name].on(wrapper_tok).tokens == ()
    for name in FORMATS:  # SmolLM2's own tokenizer holds none of them: text, as before
        assert FORMATS[name].on(tokenizer).tokens == ()
    # The front ends bind what they resolve, named or detected.
    assert resolve_tool_format(wrapper_tok, "phi").keep == FORMATS["phi"].on(wrapper_tok).keep
    grammar = call_grammar([WEATHER], "required", resolve_tool_format(wrapper_tok, "mistral"))
    assert grammar is not None and grammar.keep == (ids["[TOOL_CALLS]"],)
    with pytest.raises(GrammarError, match="no wrapper part of the mistral format"):
        Grammar.from_spec({"type": "tool_calls", "tools": [WEATHER], "format": "mistral",
                           "special_tokens": {"<|tool_call|>": 3}})
    with pytest.raises(GrammarError, match="non-negative int"):
        Grammar.from_spec({"type": "tool_calls", "tools": [WEATHER], "format": "mistral",
                           "special_tokens": {"[TOOL_CALLS]": "x"}})


def spelled_check(fmt: ToolFormat, seed: int, matcher: Matcher,
                  grammar_of: Callable[[Sample], Grammar | None]) -> dict[str, int]:
    """Valid answers in ``fmt`` written with the wrapper as its special token, and the same
    answers with the wrapper spelled out in ordinary tokens: how many of each are admitted."""
    import llguidance

    rng = random.Random(seed)
    tok = matcher.tokenizer
    out = {"valid": 0, "as token admitted": 0, "spelled admitted": 0}
    while out["valid"] < SAMPLES // 5:
        sample = Sample(rng, fmt)
        grammar = grammar_of(sample)
        assert grammar is not None
        for _ in range(5):
            text = fmt.render(sample.calls())
            out["valid"] += 1
            out["as token admitted"] += matcher.admits(grammar, text)
            spelled = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
            m = llguidance.LLMatcher(matcher.ll, grammar.spec)
            out["spelled admitted"] += (m.try_consume_tokens(spelled) == len(spelled)
                                        and m.is_accepting())
    return out


@pytest.mark.parametrize("name", SPECIAL_FORMATS)
def test_a_bound_wrapper_is_admitted_as_its_token_only(name: str, wrapper_tok: Any,
                                                       wrapper_matcher: Matcher) -> None:
    """The property test on the bound format (every valid answer admitted and parsed back, no
    wrong one admitted), and the same answers with the wrapper spelled out all refused."""
    fmt = FORMATS[name].on(wrapper_tok)
    assert fmt.tokens
    got = property_check(fmt, 50, grammar_of=_grammar, parse=fmt.parse,
                         admits=wrapper_matcher.admits)
    n = got["valid"]
    assert got == {"valid": n, "admitted": n, "parsed back": n, "wrong": n, "wrong admitted": 0}, got
    spelled = spelled_check(fmt, 51, wrapper_matcher, _grammar)
    assert spelled == {"valid": spelled["valid"], "as token admitted": spelled["valid"],
                       "spelled admitted": 0}, spelled


def test_an_unbound_grammar_admits_the_spelled_wrapper_and_fails_the_check(
        wrapper_tok: Any, wrapper_matcher: Matcher) -> None:
    """The mistral grammar built without the tokenizer's token: the spelled-out wrapper is
    admitted, so the check above would see a grammar that ignores the model's token."""
    def unbound(sample: Sample) -> Grammar | None:
        return call_grammar(sample.tools, sample.choice, "mistral")

    got = spelled_check(FORMATS["mistral"].on(wrapper_tok), 51, wrapper_matcher, unbound)
    assert got["spelled admitted"] == got["valid"] and got["as token admitted"] == 0


@pytest.mark.parametrize("name", SPECIAL_FORMATS)
def test_auto_with_a_bound_wrapper_starts_a_call_with_its_token(name: str,
                                                                 wrapper_tok: Any) -> None:
    fmt = FORMATS[name].on(wrapper_tok)
    grammar = call_grammar([WEATHER, ADD], "auto", fmt)
    assert grammar is not None and grammar.or_text
    assert first_token_check(grammar, fmt, wrapper_tok) == []


def test_the_text_keeps_the_wrapper_token_and_nothing_else_changes(wrapper_tok: Any) -> None:
    """:class:`Detokenizer`: with wrapper tokens kept, a bound format's answer decodes to its
    rendered text (parsed back whole), where the usual decode drops the wrapper and the parse
    finds no call; on ids without a kept token (other special tokens among them) the text is
    the usual decode's, over random id sequences."""
    from agentspec.text import Detokenizer

    fmt = FORMATS["phi"].on(wrapper_tok)
    text = fmt.render([CALL, ("add", {"a": 1, "b": 2})])
    ids = wrapper_tok.encode(text, add_special_tokens=False)
    assert ids[0] == fmt.keep[0] and ids[-1] == fmt.keep[1]
    kept = Detokenizer(wrapper_tok, fmt.keep)
    assert kept(ids) == text and len(fmt.parse(kept(ids)).calls) == 2
    usual = Detokenizer(wrapper_tok)
    assert fmt.parse(usual(ids)).calls == ()  # a decode that drops the wrapper loses the calls
    rng = random.Random(7)
    specials = sorted(set(wrapper_tok.all_special_ids) - set(fmt.keep))
    for _ in range(200):
        seq = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(wrapper_tok) - 3)
               for _ in range(rng.randint(1, 24))]
        assert kept(seq) == wrapper_tok.decode(seq, skip_special_tokens=True), seq
