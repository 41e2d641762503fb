"""Prompts in, text out: the ONE place a prompt becomes text, and generated tokens become text.

Renderings of a prompt: :func:`render_chat` (the chat template: what the model reads),
:func:`conversation_key` (what the completion memory is keyed on), :func:`request_text` (what
a memory record shows as its request). Then input validation, incremental detokenization,
stop strings and stop tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from agentspec.types import Origins

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


def render_chat(tokenizer: Any, messages: Sequence[Message]) -> str:
    """Messages through the chat template, the generation prompt added: the text the model reads.

    Raises:
        ValueError: the tokenizer has no chat template (a base model loaded from a folder or a
            GGUF of the user's): the message says to pass a raw string or set one.
    """
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"the tokenizer of {name!r} has no chat template, so messages cannot be rendered: "
            "pass the prompt as a raw string, or set tokenizer.chat_template")
    return str(tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=True))


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids: messages go through the chat template with the generation prompt added."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        ids = tokenizer(render_chat(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"prompt {prompt!r} encodes to no tokens")
    return list(ids)


def request_text(prompt: Prompt) -> str:
    """The request a memory record shows: a str prompt as is, messages as their JSON."""
    return prompt if isinstance(prompt, str) else json.dumps([dict(m) for m in prompt])


def truncate_middle(text: str, max_chars: int, *, head_fraction: float = 0.25) -> str:
    """``text`` cut to at most ``max_chars`` characters by removing its middle.

    The head (``head_fraction`` of the budget: a system prompt, tool docs) and the tail (the
    rest: the latest turns) are kept, joined by ``" … "``.
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be > 0, got {max_chars}")
    if not 0.0 <= head_fraction <= 1.0:
        raise ValueError(f"head_fraction must be in [0, 1], got {head_fraction}")
    if len(text) <= max_chars:
        return text
    sep = " … " if max_chars > 3 else ""
    budget = max_chars - len(sep)
    head = int(budget * head_fraction)
    tail = budget - head
    return text[:head] + sep + (text[-tail:] if tail else "")


def _render_message(message: Mapping[str, Any], i: int) -> str:
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"messages[{i}] must be a dict with a 'role', got {message!r:.80}")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI-style parts: keep the text ones
        content = "\n".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p)
                            for p in content)
    text = f"{message['role']}: {'' if content is None else content}"
    if message.get("tool_calls"):
        text += "\n" + json.dumps(message["tool_calls"], sort_keys=True, default=str)
    return text


def conversation_key(messages_or_prompt: str | Sequence[Mapping[str, Any]], *,
                     max_chars: int = 2000) -> str:
    """The text a request is remembered under: the whole conversation, not its last message.

    Each message becomes ``"role: content"`` (plus its tool calls), one per line, so the system
    prompt with its tool docs and every turn count: "how old is he?" asked after two different
    questions gives two different keys. A str prompt is used as is. Longer than ``max_chars``,
    the middle is cut: the head (system prompt, tool docs) and the tail (latest turns) stay.

    Args:
        messages_or_prompt: ``[{"role": ..., "content": ...}, ...]`` or a prompt string.
        max_chars: longest key returned.
    """
    if isinstance(messages_or_prompt, str):
        text = messages_or_prompt
    elif isinstance(messages_or_prompt, Sequence):
        messages: Sequence[Any] = messages_or_prompt
        text = "\n".join(_render_message(m, i) for i, m in enumerate(messages))
    else:
        raise TypeError(f"expected messages or a str prompt, got {type(messages_or_prompt).__name__}")
    return truncate_middle(text, max_chars)


def cut_at_stop(tokens: Sequence[int], stop_ids: frozenset[int]) -> tuple[tuple[int, ...], bool]:
    """``tokens`` cut before the first stop token, and whether one was there."""
    for i, tok in enumerate(tokens):
        if tok in stop_ids:
            return tuple(tokens[:i]), True
    return tuple(tokens), False


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


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids a Hugging Face tokenizer drops from text decoded with
    ``skip_special_tokens=True``: its named special tokens and its added tokens marked
    special."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)


class Detokenizer:
    """Token ids to text, without special tokens but those in ``keep``.

    Output text is decoded without special tokens (an end-of-turn marker is no part of an
    answer), except the special tokens a grammar writes as tokens (a tool-call wrapper such
    as Mistral's ``[TOOL_CALLS]``, :attr:`agentspec.grammar.Grammar.keep`): a parse reads
    them in the text. With nothing to keep it is the tokenizer's
    ``decode(ids, skip_special_tokens=True)``; else the other special tokens are taken out of
    the ids and the rest decoded with special tokens, which is the same text where none of
    ``keep`` occurs (tests/adapters/test_tool_formats.py checks it on random ids)."""

    def __init__(self, tokenizer: Any, keep: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.keep = frozenset(keep)
        self._drop = special_token_ids(tokenizer) - self.keep if self.keep else frozenset()

    def __call__(self, ids: Sequence[int]) -> str:
        if not self.keep:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
        return str(self.tokenizer.decode([t for t in ids if t not in self._drop],
                                         skip_special_tokens=False))


class TextDeltas:
    """Incremental detokenization with stop strings; nothing after a stop is ever emitted.
    ``keep``: the special tokens the text keeps (:class:`Detokenizer`)."""

    def __init__(self, tokenizer: Any, stops: StopStrings, keep: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.decode = Detokenizer(tokenizer, keep)
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
        before = len(self.tokens)
        self.tokens.extend(new_tokens)
        text = self.decode(self.tokens)
        start = max(0, self.emitted - max((len(s) for s in self.stops.stops), default=0))
        cut = self.stops.find(text, start)
        if cut >= 0:
            # Keep the tokens up to the first that completes a stop string, and cut there:
            # what one token a step keeps, however many this step committed (a draft must
            # not change a generation's token ids).
            for kept in range(before + 1, len(self.tokens) + 1):
                head = self.decode(self.tokens[:kept])
                at = self.stops.find(head, start)
                if at >= 0:
                    text, cut = head, at
                    break
            self.text, self.stopped = text[:cut], True
            self.kept_tokens = kept
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


# Tokens decoded before each run's own, so a tokenizer that drops a leading space at the start
# of a decode (SentencePiece) or meets half a character there does it in both decodes alike.
_WINDOW = 4


def origin_text(tokenizer: Any, token_ids: Sequence[int], origins: Origins, text: str,
                keep: Sequence[int] = ()) -> Origins:
    """``origins`` with :attr:`~agentspec.types.Origins.text_ends`: where each of its runs
    ends in ``text``, the completion ``token_ids`` decode to (cut at a stop string or not;
    ``keep``: the special tokens it keeps, :class:`Detokenizer`).

    Each run is decoded with a few tokens before it, and its text is what it adds to theirs
    (a character split between two runs goes with the later one); the runs' texts together
    must equal the whole decode, else every end is taken from a decode of the whole prefix.
    So the cost is about one decode of the completion, and the ends are exact either way.
    """
    ids = list(token_ids)
    ends = [end for _, _, _, end in origins.runs()]
    decode = Detokenizer(tokenizer, keep)
    whole = decode(ids)
    offsets = _window_offsets(decode, ids, ends, whole)
    if offsets is None:  # the windows disagree with the whole decode: exact, slower
        offsets = [len(decode(ids[:end]).rstrip("\ufffd"))
                   for end in ends[:-1]] + [len(whole)] * bool(ends)
    out, last = [], 0
    for offset in offsets:  # within the text, never going back
        last = max(last, min(offset, len(text)))
        out.append(last)
    return replace(origins, text_ends=tuple(out))


def _window_offsets(decode: Callable[[Sequence[int]], str], ids: list[int], ends: list[int],
                    whole: str) -> list[int] | None:
    pieces, offsets, prev, total = [], [], 0, 0
    for end in ends:
        start = max(0, prev - _WINDOW)
        head = decode(ids[start:prev]).rstrip("\ufffd") if prev > start else ""
        both = decode(ids[start:end])
        if end < len(ids):
            both = both.rstrip("\ufffd")  # half a character: the next run's
        if not both.startswith(head):
            return None
        pieces.append(both[len(head):])
        total += len(both) - len(head)
        offsets.append(total)
        prev = end
    return offsets if "".join(pieces) == whole else None
