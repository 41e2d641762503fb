"""Log-probabilities in OpenAI's two shapes, and the request fields that ask for them.

The numbers come from the Speculator (``SamplingParams.logprobs``,
:class:`~agentspec.types.TokenLogprob`): the model's own distribution at each committed token,
taken from the verifying forward, so they are those of plain decoding whatever the drafts.
This module only writes them as OpenAI's clients read them:

- chat completions (``logprobs: true``, ``top_logprobs``): ``choices[].logprobs.content``, one
  entry per token with its text, its log-probability, its UTF-8 bytes and its alternatives;
- the legacy completions endpoint (``logprobs: k``): ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (the chosen token and its ``k`` alternatives by text) and ``text_offset``.

A token's text is its exact bytes (the tokenizer's own, through llguidance's view of it), as
a string where they are valid UTF-8 and as ``bytes:\\xNN...`` where a character is split across
tokens (OpenAI's convention); the ``bytes`` field always carries them, so a client can join
the pieces of a split character.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from agentspec.adapters.openai_protocol import ApiError, bad
from agentspec.config import MAX_LOGPROBS
from agentspec.grammar.tokenizer import ll_tokenizer
from agentspec.types import Generation, TokenLogprob

# What a log-probability that underflowed to -inf is written as (JSON has no infinity).
FLOOR = -9999.0


def _int_field(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise bad(f"{name} must be an integer in [{low}, {high}], got {value!r:.40}", name,
                  "invalid_value")
    return value


def chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """The alternatives a chat request asks for per token: None without ``logprobs: true``,
    else ``top_logprobs`` (0 to 20, default 0).

    Raises:
        ApiError: 400 naming ``logprobs`` or ``top_logprobs``.
    """
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise bad(f"logprobs must be a boolean, got {want!r:.40}", "logprobs", "invalid_type")
    top = _int_field(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not want:
        if top:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        return None
    return top or 0


def completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """The legacy endpoint's ``logprobs``: None, or the alternatives per token (0 to 20).

    Raises:
        ApiError: 400 naming ``logprobs``.
    """
    return _int_field(body, "logprobs", 0, MAX_LOGPROBS)


class TokenText:
    """Each token's exact bytes and its text, for one model's tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        # llguidance's view of the tokenizer: built once per tokenizer (seconds), then cached.
        self._ll = ll_tokenizer(tokenizer, vocab_size, sorted(stop_ids))
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def of(cls, spec: Any) -> TokenText:
        """The token text of a Speculator's model."""
        return cls(spec.tokenizer, spec.target.vocab_size, sorted(spec.stop_token_ids))

    def bytes_of(self, token_id: int) -> bytes:
        got = self._bytes.get(token_id)
        if got is None:
            got = self._bytes[token_id] = bytes(self._ll.decode_bytes([token_id]))
        return got

    def text_of(self, token_id: int) -> str:
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def offsets(self, token_ids: Sequence[int], text: str, *, start: int = 0,
                first: int = 0) -> list[int]:
        """Where each of ``token_ids[first:]`` starts in ``text`` (the generation's text,
        decoded as the Speculator decodes it), plus ``start``: the length of the text decoded
        from the tokens before it, a character split across tokens counted where it begins."""
        out = []
        for i in range(first, len(token_ids)):
            before = self.tokenizer.decode(list(token_ids[:i]), skip_special_tokens=True)
            out.append(start + min(len(before.rstrip("\ufffd")), len(text)))
        return out

    def covered(self, token_ids: Sequence[int], first: int, chars: int) -> int:
        """How many of ``token_ids`` (from ``first`` on, the ones before already counted) have
        their whole text within the first ``chars`` characters of the decoded text."""
        n = first
        while n < len(token_ids) and len(self.tokenizer.decode(
                list(token_ids[: n + 1]), skip_special_tokens=True)) <= chars:
            n += 1
        return n


class Sent:
    """What a streamed answer has sent of its tokens' log-probabilities: each chunk carries
    those of the tokens whose whole text the answer has shown so far, the last chunk the
    rest (a token cut by a stop string, or held back as a tool call)."""

    def __init__(self, text: TokenText) -> None:
        self.text, self.count = text, 0

    def shown(self, stream: Any, chars: int) -> tuple[int, tuple[TokenLogprob, ...]]:
        """The index of the first token not sent yet, and the tokens of ``stream`` (its
        ``logprobs`` so far) whose text lies within the first ``chars`` characters shown."""
        committed = stream.logprobs or ()
        first = self.count
        self.count = self.text.covered([t.token_id for t in committed], first, chars)
        return first, committed[first : self.count]

    def rest(self, gen: Generation) -> tuple[int, tuple[TokenLogprob, ...]]:
        """The tokens of the finished ``gen`` not sent yet (and the index of the first)."""
        first, tokens = self.count, gen.logprobs or ()
        self.count = max(first, len(tokens))
        return first, tokens[first:]


def put_logprobs(body: dict[str, Any], logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """``body`` (an answer or a chunk) with its first choice carrying ``logprobs``."""
    if body.get("choices"):
        body["choices"][0]["logprobs"] = logprobs
    return body


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def chat_content(text: TokenText, tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat answer (or of one streamed chunk) for ``tokens``."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": text.text_of(token_id), "logprob": _value(logprob),
                "bytes": list(text.bytes_of(token_id))}

    return {"content": [{**entry(t.token_id, t.logprob),
                         "top_logprobs": [entry(i, v) for i, v in t.top]} for t in tokens],
            "refusal": None}


def legacy(text: TokenText, tokens: Sequence[TokenLogprob],
           offsets: Sequence[int]) -> dict[str, Any]:
    """``choices[].logprobs`` of the completions endpoint: per token its text, its
    log-probability, the chosen token with its alternatives by text (so up to ``k + 1``), and
    where its text starts (``offsets``)."""
    top = []
    for t in tokens:
        alternatives = {text.text_of(i): _value(v) for i, v in t.top}
        alternatives.setdefault(text.text_of(t.token_id), _value(t.logprob))
        top.append(alternatives)
    return {"tokens": [text.text_of(t.token_id) for t in tokens],
            "token_logprobs": [_value(t.logprob) for t in tokens], "top_logprobs": top,
            "text_offset": list(offsets)}


def no_prompt_logprobs() -> ApiError:
    """The answer to ``echo`` with ``logprobs``: the prompt's own log-probabilities are not
    computed (prompt rows are prefilled without logits, or reused from the prefix cache)."""
    return bad("echo with logprobs asks for the prompt's log-probabilities, which this server "
               "does not compute; ask for echo or for logprobs, not both", "echo",
               "unsupported_parameter")
