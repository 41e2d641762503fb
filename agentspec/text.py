"""Prompts in, text out: chat templates, input validation, incremental detokenization, stops."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]
Prompt = str | Sequence[Message]
ROLES = frozenset({"system", "user", "assistant", "tool"})


def validate_prompt(prompt: Prompt) -> None:
    """Raise ValueError naming the problem: empty prompt, unknown role, missing content."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: got ''")
        return
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
        raise ValueError(f"prompt must be a str or a list of messages, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError("prompt is empty: got an empty list of messages")
    for i, msg in enumerate(prompt):
        if not isinstance(msg, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {msg!r}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i} has unknown role {role!r}; expected one of {sorted(ROLES)}")
        if not isinstance(msg.get("content"), str):
            raise ValueError(f"message {i} content must be a str, got {msg.get('content')!r}")


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids: messages go through the chat template with the generation prompt added."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        text = tokenizer.apply_chat_template([dict(m) for m in prompt], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"prompt {prompt!r} encodes to no tokens")
    return list(ids)


class StopStrings:
    """Stop strings: find the first one, and how much of a text tail might still become one."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            stops = [stops]
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self.stops = tuple(stops)

    def find(self, text: str, start: int = 0) -> int:
        """Index of the earliest stop string at or after ``start`` (-1 when none)."""
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else -1

    def holdback(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


class TextDeltas:
    """Incremental detokenization with stop strings; nothing after a stop is ever emitted."""

    def __init__(self, tokenizer: Any, stops: StopStrings) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.tokens: list[int] = []
        self.text = ""  # the full text so far, cut at a stop string once one is found
        self.emitted = 0
        self.kept_tokens = 0
        self.stopped = False

    def push(self, new_tokens: Sequence[int]) -> tuple[str, bool]:
        """Add committed tokens; returns ``(text safe to emit now, a stop string was hit)``."""
        if self.stopped:
            return "", True
        self.tokens.extend(new_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = self.stops.find(text, max(0, self.emitted - max((len(s) for s in self.stops.stops), default=0)))
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            self.kept_tokens = len(self.tokens)
            return self._take(len(self.text)), True
        self.text = text
        self.kept_tokens = len(self.tokens)
        safe = len(text) - self.stops.holdback(text)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            safe = min(safe, len(text.rstrip("\ufffd")))
        return self._take(safe), False

    def flush(self) -> str:
        """Whatever was held back, at the end of the generation."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
