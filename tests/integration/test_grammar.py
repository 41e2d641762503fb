"""Grammar-constrained decoding on the real packaged model: exact and always valid.

Greedy output under a grammar equals ``transformers.generate`` with the same grammar as a logits
processor (fp32), whatever the drafts: prompt lookup, the grammar's own forced tokens, or a
drafter proposing wrong and forbidden tokens. Seeded sampling gives the same output with and
without drafts. Every output is valid under its grammar.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from agentspec import SamplingParams, SpecConfig, Speculator
from agentspec.grammar import Grammar
from agentspec.grammar.hf import GrammarLogitsProcessor
from agentspec.protocols import DraftContext
from agentspec.types import Draft, Verdict

pytestmark = pytest.mark.slow
pytest.importorskip("llguidance")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "magic_function", "description": "Applies magic.",
                                      "parameters": {"type": "object", "properties": {
                                          "input": {"type": "integer"}}, "required": ["input"]}}},
]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"},
                                           "role": {"enum": ["admin", "user", "guest"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}
SYSTEM = ("You can call get_weather(city, unit) and magic_function(input). To call one, reply "
          'with JSON: {"name": ..., "arguments": {...}}.')
CASES = {
    "tool-required": (Grammar.tool_calls(TOOLS, choice="required"),
                      [{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": "What's the weather in Paris?"}]),
    "tool-auto-text": (Grammar.tool_calls(TOOLS, choice="auto"),
                       [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Hi! Tell me a short fact about owls."}]),
    "tool-list": (Grammar.tool_calls(TOOLS, choice="required", as_list=True),
                  [{"role": "system", "content": SYSTEM},
                   {"role": "user", "content": "Use magic_function on 7, then on 8."}]),
    "json-schema": (Grammar.json_schema(PERSON),
                    [{"role": "user", "content": "Make up a person as JSON with name, age, role."}]),
    "regex-date": (Grammar.regex(r"\d{4}-\d{2}-\d{2}"),
                   [{"role": "user", "content": "When did the Apollo 11 landing happen?"}]),
}
MAX_NEW = 40


class ForbiddenDrafter:
    """Proposes trees of wrong and forbidden tokens (and a right-looking brace) every step."""

    name = "forbidden"

    def begin(self, context: DraftContext) -> None:
        pass

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        k = len(context.generated)
        return Draft((7 + k, 90, 11, 90 + k), (-1, 0, 1, -1), self.name)

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        pass

    def end(self, context: DraftContext) -> None:
        pass


def hf_reference(spec: Speculator, prompt: Any, grammar: Grammar) -> list[int]:
    ids = spec.encode(prompt)
    proc = GrammarLogitsProcessor(grammar, spec.tokenizer, vocab_size=spec.target.vocab_size,
                                  eos_ids=sorted(spec.stop_token_ids), prompt_len=len(ids))
    with torch.inference_mode():
        out = spec.target.model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW,
                                         do_sample=False, logits_processor=[proc],
                                         eos_token_id=sorted(spec.stop_token_ids),
                                         pad_token_id=spec.tokenizer.eos_token_id)
    new = out[0, len(ids):].tolist()
    return new[:-1] if new and new[-1] in spec.stop_token_ids else new


def valid(name: str, text: str) -> bool:
    if name == "regex-date":
        return re.fullmatch(r"\d{4}-\d{2}-\d{2}", text) is not None
    if name == "tool-auto-text" and not text.startswith("{"):
        return bool(text.strip())
    value = json.loads(text)
    if name == "json-schema":
        return set(value) == {"name", "age", "role"} and value["role"] in ("admin", "user", "guest")
    calls = value if isinstance(value, list) else [value]
    names = {t["function"]["name"] for t in TOOLS}
    return all(c["name"] in names and isinstance(c["arguments"], dict) for c in calls)


@pytest.fixture(scope="module")
def poisoned(spec: Speculator) -> Speculator:
    return Speculator(spec.target.fork(), drafters=[ForbiddenDrafter()], memory=None)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_equals_transformers_with_the_grammar(name: str, spec: Speculator,
                                                     poisoned: Speculator) -> None:
    grammar, prompt = CASES[name]
    reference = hf_reference(spec, prompt, grammar)
    sampling = SamplingParams(grammar=grammar)
    outputs = {"lookup+forced": spec.generate(prompt, MAX_NEW, sampling=sampling),
               "forbidden drafts": poisoned.generate(prompt, MAX_NEW, sampling=sampling)}
    for label, gen in outputs.items():
        assert list(gen.token_ids) == reference, f"{name}, {label}: {gen.text!r}"
    text = outputs["lookup+forced"].text
    if outputs["lookup+forced"].finish_reason == "stop":
        assert valid(name, text), f"{name}: invalid output {text!r}"


def test_forced_tokens_are_drafted_free(spec: Speculator) -> None:
    """The call's skeleton rides as grammar drafts: fewer target steps, the same tokens."""
    grammar, prompt = CASES["tool-required"]
    sampling = SamplingParams(grammar=grammar)
    with_forced = spec.generate(prompt, MAX_NEW, sampling=sampling)
    off = Speculator(spec.target.fork(), config=SpecConfig(grammar_drafts=False), memory=None)
    without = off.generate(prompt, MAX_NEW, sampling=sampling)
    assert with_forced.token_ids == without.token_ids
    assert with_forced.stats.accepted.get("grammar", 0) >= 8
    assert with_forced.stats.steps < without.stats.steps


def test_seeded_sample_does_not_depend_on_drafts(spec: Speculator, poisoned: Speculator) -> None:
    grammar, prompt = CASES["json-schema"]
    sampling = SamplingParams(temperature=0.9, seed=11, grammar=grammar)
    plain = Speculator(spec.target.fork(), speculate=False, memory=None).generate(prompt, MAX_NEW, sampling=sampling)
    for other in (spec, poisoned):
        assert other.generate(prompt, MAX_NEW, sampling=sampling).token_ids == plain.token_ids


def _mask(matcher: Any, vocab_size: int) -> torch.Tensor:
    from agentspec.grammar.tokenizer import unpack_bits

    bits = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.shape[1] * 4)
    return unpack_bits(bits, vocab_size)


def test_auto_is_the_union_of_a_call_and_free_text(spec: Speculator) -> None:
    """choice="auto" at the first token allows what the call grammar allows plus every token
    the one Lark grammar ``call | TEXT`` allows as a text start; after a text start nothing
    is masked, after a call start the call's mask applies."""
    import llguidance

    from agentspec.grammar.state import GrammarState
    from agentspec.grammar.tokenizer import TEXT_START, ll_tokenizer

    vocab, eos = spec.target.vocab_size, sorted(spec.stop_token_ids)
    auto, required = Grammar.tool_calls(TOOLS, choice="auto"), Grammar.tool_calls(TOOLS)
    call_schema = json.loads(required.spec)["grammars"][0]["json_schema"]
    lark = (f"start: call | TEXT\ncall: %json {json.dumps(call_schema)}\n"
            "TEXT: /[^{\\[\\s][\\s\\S]*/\n")
    ll_tok = ll_tokenizer(spec.tokenizer, vocab, eos)
    union = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    text = _mask(llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_lark(TEXT_START),
                                      log_level=0), vocab)
    call_only = GrammarState(required, spec.tokenizer, vocab_size=vocab, eos_ids=eos).allowed_now()
    state = GrammarState(auto, spec.tokenizer, vocab_size=vocab, eos_ids=eos)
    first = state.allowed_now()
    assert torch.equal(first & text, _mask(union, vocab) & text)  # text starts: as the union
    assert torch.equal(first & ~text, call_only)  # call starts: the call grammar's own mask
    assert not (first & ~_mask(union, vocab)).any()
    assert not torch.equal(call_only, first)  # a mask without the text part fails the check
    brace = spec.tokenizer.encode('{"', add_special_tokens=False)
    state.advance(brace)
    union.consume_tokens(brace)
    assert torch.equal(state.allowed_now(), _mask(union, vocab))
    state.rollback(len(brace))
    state.advance(spec.tokenizer.encode("Hello", add_special_tokens=False))
    assert state.allowed_now() is None and not state.done


def test_json_slices_and_an_earlier_request_do_not_change_a_mask(spec: Speculator) -> None:
    """Masks along real calls are the same with llguidance's JSON slices, without slices, and
    for a second request of the grammar (its matcher a fresh copy, never the first one reset:
    tests/unit/test_grammar_reuse.py)."""
    import llguidance

    from agentspec.grammar.state import GrammarState
    from agentspec.grammar.tokenizer import ll_tokenizer

    vocab, eos = spec.target.vocab_size, sorted(spec.stop_token_ids)
    grammar = Grammar.tool_calls(TOOLS, as_list=True)
    plain = llguidance.LLMatcher(ll_tokenizer(spec.tokenizer, vocab, eos).with_slices([]),
                                 grammar.spec, log_level=0)
    text = ('[{"name": "get_weather", "arguments": {"city": "São Paulo \\"centro\\"", '
            '"unit": "celsius"}}, {"name": "magic_function", "arguments": {"input": -12}}]')
    ids = spec.tokenizer.encode(text, add_special_tokens=False)
    first = GrammarState(grammar, spec.tokenizer, vocab_size=vocab, eos_ids=eos)
    matcher = first.matcher
    first.advance(ids[:5])
    first.close()
    second = GrammarState(grammar, spec.tokenizer, vocab_size=vocab, eos_ids=eos)
    assert second.matcher is not matcher
    for token in ids:
        assert torch.equal(second.allowed_now(), _mask(plain, vocab))
        second.advance([token])
        assert plain.consume_token(token)
    assert second.done
