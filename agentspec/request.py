"""One request, built once: the prompt and every rendering of it a call needs.

A prompt becomes text in :mod:`agentspec.text` only, and only here does a call ask for its
renderings: the token ids the model reads (the chat template), the key the completion
memory looks it up by, and the text a memory record shows. Everything downstream reads the
request instead of rendering the prompt again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from agentspec.config import SamplingParams
from agentspec.grammar import Grammar
from agentspec.session import Session
from agentspec.text import (
    Prompt,
    StopStrings,
    conversation_key,
    encode_prompt,
    request_text,
    validate_prompt,
)


@dataclass(frozen=True)
class Request:
    """One call of a :class:`~agentspec.Speculator`, as data.

    Attributes:
        prompt: the caller's prompt (a str or messages), validated; a prompt given as token
            ids is kept as their decoded text.
        prompt_ids: its token ids (messages through the chat template; token ids as given).
        text: what a memory record shows as the request.
        key_text: the conversation key the memory is looked up by; "" without a memory.
        scope: the memory scope: the call's, else its session's, else ``"default"``.
        sampling: the sampling parameters (greedy by default); ``grammar`` is theirs.
        max_new_tokens: at most this many tokens are generated.
        stops: the stop strings.
        record: whether the completion is remembered.
        session: the session the call belongs to, if any.
    """

    prompt: Prompt
    prompt_ids: tuple[int, ...]
    text: str
    key_text: str
    scope: str
    sampling: SamplingParams
    max_new_tokens: int
    stops: StopStrings
    record: bool
    session: Session | None

    @property
    def grammar(self) -> Grammar | None:
        return self.sampling.grammar

    @classmethod
    def build(cls, tokenizer: Any, given: Prompt | Sequence[int], max_new_tokens: int, *,
              sampling: SamplingParams | None, stop: Sequence[str], scope: str | None,
              record: bool, session: Session | None, keyed: bool,
              on_key: Callable[[str, str], None] | None = None,
              vocab_size: int | None = None) -> Request:
        """Check the arguments and render the prompt once.

        Args:
            given: the prompt: a str, messages, or the token ids the model reads (a non-empty list or
                tuple of ints: no template, no special tokens added); the memory keys and
                records those by their decoded text.
            keyed: the call has a memory, so it needs the memory key.
            on_key: called with the key and the scope as soon as they are known, before the
                prompt is tokenised (the memory may start the lookup meanwhile).
            vocab_size: the model's vocabulary: token ids must be below it.

        Raises:
            ValueError: a bad prompt (a token id out of the vocabulary included),
                ``max_new_tokens`` or stop string (the message names it).
        """
        ids = token_ids(given, vocab_size)
        # Token ids are keyed and recorded as their text; anything else is checked as a prompt.
        prompt = str(tokenizer.decode(list(ids))) if ids is not None else cast(Prompt, given)
        validate_prompt(prompt)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) \
                or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        stops = StopStrings(stop)
        key_text = conversation_key(prompt) if keyed else ""
        scope = scope or (session.scope if session else "default")
        if key_text and on_key is not None:
            on_key(key_text, scope)
        return cls(prompt=prompt, prompt_ids=ids or tuple(encode_prompt(tokenizer, prompt)),
                   text=request_text(prompt), key_text=key_text, scope=scope,
                   sampling=sampling or SamplingParams(), max_new_tokens=max_new_tokens,
                   stops=stops, record=record, session=session)


def token_ids(prompt: Any, vocab_size: int | None) -> tuple[int, ...] | None:
    """``prompt``'s token ids when it is given as ids (a non-empty list or tuple of ints, each
    in ``[0, vocab_size)``), None when it is text or messages.

    Raises:
        ValueError: an id that is negative or past the vocabulary (the message names it).
    """
    if not isinstance(prompt, (list, tuple)) or not prompt or \
            not all(type(t) is int for t in prompt):
        return None
    limit = vocab_size if vocab_size is not None else float("inf")
    for i, t in enumerate(prompt):
        if not 0 <= t < limit:
            raise ValueError(f"prompt token {i} is {t}, outside the model's vocabulary "
                             f"[0, {vocab_size}); pass ids the model's tokenizer gave")
    return tuple(prompt)
