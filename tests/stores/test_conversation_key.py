"""conversation_key: the conversation, not the last message; cut in the middle."""

from __future__ import annotations

import pytest

from agentspec.text import conversation_key, truncate_middle

SYSTEM = {"role": "system", "content": "You are an assistant. Tools: search(q), calc(expr)."}


def test_same_last_message_after_different_questions_gives_different_keys():
    a = [SYSTEM, {"role": "user", "content": "Who is Barack Obama?"},
         {"role": "assistant", "content": "The 44th US president."},
         {"role": "user", "content": "how old is he?"}]
    b = [SYSTEM, {"role": "user", "content": "Who is Lionel Messi?"},
         {"role": "assistant", "content": "A footballer."},
         {"role": "user", "content": "how old is he?"}]
    assert conversation_key(a) != conversation_key(b)
    assert conversation_key(a) == conversation_key([dict(m) for m in a])  # deterministic
    assert conversation_key(a).startswith("system: You are an assistant.")
    assert conversation_key(a).endswith("user: how old is he?")


def test_system_prompt_and_tool_calls_count():
    turn = {"role": "user", "content": "hi"}
    other = {"role": "system", "content": "Tools: none."}
    assert conversation_key([SYSTEM, turn]) != conversation_key([other, turn])
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"function": {"name": "calc", "arguments": "{\"expr\": \"2+2\"}"}}]}
    key = conversation_key([SYSTEM, turn, call, {"role": "tool", "content": "4"}])
    assert "calc" in key and "tool: 4" in key


def test_content_parts_are_flattened():
    parts = {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "text", "text": "here"}]}
    assert conversation_key([parts]) == "user: look\nhere"


def test_long_conversations_keep_head_and_tail():
    history = [{"role": "user", "content": f"filler turn {i} " * 20} for i in range(50)]
    messages = [SYSTEM, *history, {"role": "user", "content": "the latest question"}]
    key = conversation_key(messages, max_chars=500)
    assert len(key) <= 500
    assert key.startswith("system: You are an assistant.") and key.endswith("the latest question")
    assert "filler turn 25 " not in key  # the middle went


def test_prompt_string_is_used_as_is():
    assert conversation_key("plain prompt") == "plain prompt"
    assert len(conversation_key("x" * 5000, max_chars=100)) == 100


@pytest.mark.parametrize("bad, error", [
    ([{"content": "no role"}], ValueError), (["not a dict"], ValueError), (42, TypeError),
])
def test_bad_messages_are_refused(bad, error):
    with pytest.raises(error):
        conversation_key(bad)


def test_truncate_middle_bounds():
    assert truncate_middle("abcdef", 6) == "abcdef"
    assert truncate_middle("abcdefghij", 3) == "hij"
    assert truncate_middle("abcdefghij", 9) == "a … fghij"
    assert len(truncate_middle("a" * 50, 10)) == 10
    with pytest.raises(ValueError, match="0"):
        truncate_middle("abc", 0)
