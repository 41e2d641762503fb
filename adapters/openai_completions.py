"""OpenAI's legacy completions endpoint, ``POST /v1/completions``, read and written.

The endpoint vLLM-style servers offer for raw prompts (BFCL's local-model runner and
lm-eval's ``local-completions`` drive it): no chat template, the prompt is the text (or the
token ids) the model reads. A request is a prompt, or a list of prompts answered as one
choice each; the answer's ``choices[].text`` is the completion, after the prompt with
``echo``; ``logprobs: k`` adds the legacy log-probability shape
(:func:`~agentspec.adapters.openai_logprobs.legacy`).

The fields this endpoint shares with chat completions (``model``, ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stream``, ``stream_options``,
``user``, ``n`` and the penalties accepted only at their neutral values) are checked by the
chat parser itself (:func:`~agentspec.adapters.openai_protocol.parse_chat_request`): one
check per field, the same errors on both endpoints. ``max_tokens`` defaults to 16 here, as on
OpenAI's and vLLM's completions.

:class:`Completions` does the endpoint's work between the server's door (keys, scopes, the
body's bytes: :mod:`.openai_server`) and the answer: it opens one Speculator stream per
prompt, writes the JSON answer or the server-sent events of a streamed one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentspec.adapters.openai_answers import SSE_DONE, sse, usage_body
from agentspec.adapters.openai_errors import ApiError, bad, refused
from agentspec.adapters.openai_logprobs import (
    Sent,
    TokenText,
    completion_logprobs,
    legacy,
    no_prompt_logprobs,
)
from agentspec.adapters.openai_protocol import parse_chat_request
from agentspec.config import SamplingParams
from agentspec.types import Generation, GenerationStats

# Fields read here only; the others the endpoint takes are the chat endpoint's (see above).
OWN_FIELDS = frozenset({"prompt", "echo", "logprobs", "suffix", "best_of"})
SHARED_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed",
                           "stop", "stream", "stream_options", "user", "n", "presence_penalty",
                           "frequency_penalty", "logit_bias"})
DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 16
# A prompt as the endpoint takes it: the text the model reads, or its token ids.
RawPrompt = str | tuple[int, ...]


@dataclass(frozen=True)
class CompletionRequest:
    """A checked completions request: one choice per prompt, each with ``sampling``."""

    model: str
    prompts: tuple[RawPrompt, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    user: str | None = None

    @property
    def logprobs(self) -> int | None:
        return self.sampling.logprobs


def parse_completion_request(body: Any, *, models: Sequence[str],
                             max_tokens: int) -> CompletionRequest:
    """Check a decoded request body; ``models`` are the names served, ``max_tokens`` the
    server's bound.

    Raises:
        ApiError: 400 naming the first bad field, 404 for a model not served.
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_body")
    for name in body:
        if name not in OWN_FIELDS and name not in SHARED_FIELDS:
            raise bad(f"unrecognized request argument supplied: {name!r:.60}", str(name)[:60],
                      "unknown_parameter")
    shared = {k: v for k, v in body.items() if k in SHARED_FIELDS}
    if shared.get("max_tokens") is None:
        shared["max_tokens"] = min(DEFAULT_MAX_TOKENS, max_tokens)
    chat = parse_chat_request({**shared, "messages": [{"role": "user", "content": "-"}]},
                              models=models, max_tokens=max_tokens)
    for name, neutral in (("suffix", None), ("best_of", 1)):
        if body.get(name) not in (None, neutral):
            raise bad(f"{name} is not supported (only {neutral!r}), got {body[name]!r:.60}", name,
                      "unsupported_parameter")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad(f"echo must be a boolean, got {echo!r:.40}", "echo", "invalid_type")
    top = completion_logprobs(body)
    if echo and top is not None:
        raise no_prompt_logprobs()
    prompts = _prompts(body.get("prompt"))
    if chat.stream and len(prompts) > 1:
        raise bad(f"a streamed request takes one prompt, got {len(prompts)}; send them as "
                  f"requests of their own, or without stream", "prompt", "invalid_value")
    sampling = SamplingParams(temperature=chat.temperature, top_p=chat.top_p, top_k=chat.top_k,
                              seed=chat.seed, logprobs=top)
    return CompletionRequest(model=chat.model, prompts=prompts, max_tokens=chat.max_tokens,
                             sampling=sampling, stop=chat.stop, stream=chat.stream,
                             include_usage=chat.include_usage, echo=bool(echo), user=chat.user)


def _prompts(prompt: Any) -> tuple[RawPrompt, ...]:
    """``prompt``: a string, an array of token ids, or an array of either (one choice each)."""
    shape = ("prompt must be a non-empty string, an array of token ids, or an array of "
             f"those (at most {MAX_PROMPTS})")
    if isinstance(prompt, str):
        return (_one(prompt, "prompt"),)
    if not isinstance(prompt, list) or not prompt:
        raise bad(f"{shape}, got {prompt!r:.60}", "prompt", "invalid_type")
    if all(type(t) is int for t in prompt):
        return (_one(prompt, "prompt"),)
    if len(prompt) > MAX_PROMPTS:
        raise bad(f"{shape}, got {len(prompt)} prompts", "prompt", "invalid_value")
    return tuple(_one(p, f"prompt[{i}]") for i, p in enumerate(prompt))


def _one(prompt: Any, where: str) -> RawPrompt:
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        negative = next((j for j, t in enumerate(prompt) if t < 0), None)
        if negative is not None:
            raise bad(f"{where}[{negative}] must be a token id (>= 0), got {prompt[negative]}",
                      f"{where}[{negative}]", "invalid_value")
        return tuple(prompt)
    raise bad(f"{where} must be a non-empty string or a non-empty array of token ids, got "
              f"{prompt!r:.60}", where, "invalid_type")


@dataclass
class Opened:
    """A request's Speculator streams (one per prompt), its prompts' text for ``echo``, and
    what writes its tokens' text (with ``logprobs``)."""

    request: CompletionRequest
    scope: str
    streams: list[Any]
    prompt_texts: list[str]
    text: TokenText | None


class Completions:
    """The endpoint over one Speculator (``spec``); ``record``: the server's recording
    setting (None: the Speculator's)."""

    def __init__(self, spec: Any, record: bool | None = None) -> None:
        self.spec, self.record = spec, record

    def open(self, req: CompletionRequest, scope: str) -> Opened:
        """Open one stream per prompt (in a worker: tokenising takes time); a prompt the
        Speculator refuses (too long for the context, an id outside the vocabulary:
        :data:`~.openai_errors.REFUSALS`) is a 400 naming it, and no stream is left open."""
        streams: list[Any] = []
        for i, prompt in enumerate(req.prompts):
            where = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
            try:
                streams.append(self.spec.stream(
                    list(prompt) if isinstance(prompt, tuple) else prompt, req.max_tokens,
                    sampling=req.sampling, stop=req.stop, scope=scope, record=self.record))
            except Exception as exc:
                for stream in streams:
                    stream.close()
                if (error := refused(exc, param=where, where=f"{where}: ")) is None:
                    raise
                raise error from None
        texts = [p if isinstance(p, str) else self.spec.tokenizer.decode(list(p))
                 for p in req.prompts] if req.echo else [""] * len(req.prompts)
        return Opened(req, scope, streams, texts,
                      None if req.logprobs is None else TokenText.of(self.spec))

    def body(self, opened: Opened, gens: Sequence[Generation], head: Mapping[str, Any]
             ) -> dict[str, Any]:
        """The JSON answer: a choice per prompt, in their order."""
        choices = []
        for i, gen in enumerate(gens):
            logprobs = None
            if opened.text is not None and gen.logprobs is not None:
                logprobs = legacy(opened.text, gen.logprobs,
                                  opened.text.offsets(gen.token_ids, gen.text))
            choices.append({"index": i, "text": opened.prompt_texts[i] + gen.text,
                            "logprobs": logprobs, "finish_reason": gen.finish_reason})
        return {**head, "object": "text_completion", "choices": choices,
                "usage": _usage(gens), "system_fingerprint": None,
                "agentspec": {"scope": opened.scope, "stats": _total(gens).as_dict()}}

    async def events(self, opened: Opened, items: AsyncIterator[Any], *,
                     head: Mapping[str, Any],
                     finished: Callable[[Generation], None]) -> AsyncIterator[bytes]:
        """A streamed answer's server-sent events from ``items`` (the one stream's text
        deltas, then its Generation): the echoed prompt first, then each delta with the
        log-probabilities of the tokens its text completes, the finish with the rest; an
        error (the request stopped, the generation failed) as an error event. ``finished``
        hears the Generation."""
        stream, text = opened.streams[0], opened.text
        sent = None if text is None else Sent(text)
        chunk = _chunker(head)
        if opened.prompt_texts[0]:
            yield sse(chunk(opened.prompt_texts[0]))
        emitted, gen = "", None
        try:
            async for item in items:
                if not isinstance(item, str):
                    gen = item
                    continue
                emitted += item
                logprobs = None
                if sent is not None:
                    first, tokens = sent.shown(stream, len(emitted))
                    ids = [t.token_id for t in stream.logprobs or ()][: first + len(tokens)]
                    logprobs = legacy(sent.text, tokens, sent.text.offsets(ids, emitted, first=first))
                yield sse(chunk(item, logprobs))
        except ApiError as e:  # stopped: its deadline passed, or the server shuts down
            yield sse(e.body())
            yield SSE_DONE
            return
        except Exception as exc:  # the answer has begun: the error goes in the stream
            yield sse(ApiError(500, f"the generation failed: {type(exc).__name__}",
                               type="server_error").body())
            yield SSE_DONE
            return
        assert gen is not None
        finished(gen)
        rest = None
        if sent is not None:
            first, tokens = sent.rest(gen)
            rest = legacy(sent.text, tokens, sent.text.offsets(gen.token_ids, gen.text, first=first))
        yield sse(chunk("", rest, gen.finish_reason))
        if opened.request.include_usage:
            yield sse({**head, "object": "text_completion", "choices": [],
                       "usage": _usage([gen])})
        yield SSE_DONE


def _chunker(head: Mapping[str, Any]) -> Callable[..., dict[str, Any]]:
    def chunk(text: str, logprobs: dict[str, Any] | None = None,
              finish: str | None = None) -> dict[str, Any]:
        return {**head, "object": "text_completion", "choices": [
            {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    return chunk


def _total(gens: Sequence[Generation]) -> GenerationStats:
    total = GenerationStats()
    for gen in gens:
        total = total + gen.stats
    return total


def _usage(gens: Sequence[Generation]) -> dict[str, Any]:
    """The usage of every choice together (a Generation's own shape, summed)."""
    total = _total(gens)
    ids = tuple(t for gen in gens for t in gen.token_ids)
    return usage_body(Generation("", ids, total, "stop"))
