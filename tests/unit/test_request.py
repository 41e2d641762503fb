"""One request, built once (agentspec.request), and a memory of the user's seen through the
memory protocol (agentspec.memory.foreign)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from agentspec.config import SamplingParams
from agentspec.memory.foreign import ForeignMemory, as_memory
from agentspec.request import Request
from agentspec.types import Finished, Record


class CountingTokenizer:
    """A tokenizer that counts its renderings: one id per character."""

    chat_template = "{{ messages }}"

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        self.events.append("template")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        self.events.append("encode")
        return {"input_ids": [ord(c) % 50 for c in text]}


class FakeSession:
    scope = "session-scope"


MESSAGES = [{"role": "system", "content": "tools: ls"}, {"role": "user", "content": "list"}]


def test_a_request_renders_its_prompt_once_and_gives_the_key_before_tokenising():
    events: list[str] = []
    request = Request.build(CountingTokenizer(events), MESSAGES, 16, sampling=None, stop=["\n"],
                            scope=None, record=True, session=None, keyed=True,
                            on_key=lambda key, scope: events.append(f"key:{key}@{scope}"))
    assert events == ["key:system: tools: ls\nuser: list@default", "template", "encode"]
    assert request.key_text == "system: tools: ls\nuser: list"
    assert request.prompt_ids == tuple(ord(c) % 50 for c in "<system>tools: ls<user>list<assistant>")
    assert request.text.startswith('[{"role": "system"')
    assert request.scope == "default" and request.sampling == SamplingParams()
    assert request.grammar is None and request.max_new_tokens == 16


def test_the_scope_is_the_calls_then_the_sessions_and_no_key_without_a_memory():
    events: list[str] = []
    tok = CountingTokenizer(events)
    kw = dict(sampling=None, stop=(), record=False, keyed=False,
              on_key=lambda key, scope: events.append(key))
    assert Request.build(tok, "hi", 4, scope=None, session=FakeSession(), **kw).scope == "session-scope"
    mine = Request.build(tok, "hi", 4, scope="mine", session=FakeSession(), **kw)
    assert mine.scope == "mine" and mine.key_text == "" and "hi" not in events  # no key asked


@pytest.mark.parametrize("prompt, max_new, match", [
    ("", 4, "prompt is empty"), ([{"role": "bot", "content": "x"}], 4, "unknown role 'bot'"),
    ("hi", 0, "max_new_tokens must be a positive integer, got 0"),
    ("hi", True, "max_new_tokens must be a positive integer, got True"),
])
def test_a_bad_request_is_refused_naming_the_value(prompt, max_new, match):
    with pytest.raises(ValueError, match=match):
        Request.build(CountingTokenizer([]), prompt, max_new, sampling=None, stop=(), scope=None,
                      record=True, session=None, keyed=True)


def _done(**kw) -> Finished:
    base = dict(record=Record("s", "m", "r", "k", "c", (1, 2)), remember=True,
                credits=((7, 3), (9, 1)))
    return Finished(**{**base, **kw})


class Basic:
    """A memory of the user's: lookup without min_similarity, record and credit."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def lookup(self, key_text, *, scope, model, k=8):
        self.calls.append(("lookup", key_text, k))
        return [(Record("s", "m", "r", key_text, "c", (1,), id=4), 0.9)]

    def record(self, **row):
        self.calls.append(("record", row["completion_ids"]))
        return 11

    def credit(self, record_id, accepted_tokens):
        self.calls.append(("credit", record_id, accepted_tokens))


def test_a_users_memory_hears_the_end_of_a_request_as_credits_then_its_record():
    user = Basic()
    memory = as_memory(user)
    assert isinstance(memory, ForeignMemory) and as_memory(memory) is memory
    assert [r.id for r, _ in memory.lookup("k", scope="s", model="m", min_similarity=0.5)] == [4]
    assert memory.finish(_done(), behind=True) == 11  # no record_behind: written now
    assert user.calls[1:] == [("credit", 7, 3), ("credit", 9, 1), ("record", [1, 2])]
    user.calls.clear()
    assert memory.finish(_done(remember=False), behind=False) == -1
    assert user.calls == [("credit", 7, 3), ("credit", 9, 1)]
    assert list(memory.completions(scope="s", model="m")) == []  # it has none
    memory.prefetch("k")  # neither prefetch nor warmup: nothing to do, nothing raised
    memory.warmup()


def test_a_users_memory_that_writes_behind_gives_the_future():
    class Behind(Basic):
        def record_behind(self, **row):
            done: Future[int] = Future()
            done.set_result(12)
            return done

    out = as_memory(Behind()).finish(_done(credits=()), behind=True)
    assert isinstance(out, Future) and out.result() == 12


def test_an_object_without_lookup_is_no_memory():
    with pytest.raises(TypeError, match="needs a callable lookup; object has none"):
        as_memory(object())
