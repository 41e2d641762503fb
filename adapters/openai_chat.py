"""The chat endpoint's work, ``POST /v1/chat/completions``, between the server's door and the
answer.

The server (:mod:`.openai_server`) checks the key, the scope and the body, and parses the
request (:mod:`.openai_protocol`); :class:`Chat` renders it, opens its Speculator stream
(:meth:`Chat.open`: a request the Speculator refuses is a 400 by the exception's type,
:data:`~.openai_errors.REFUSALS`), and writes its answer: the JSON body of a whole one
(:meth:`Chat.body`), or the server-sent events of a streamed one (:meth:`Chat.events`), tool
calls held back until they are whole and log-probabilities written as their text is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from agentspec.adapters.chat import CallHoldback
from agentspec.adapters.openai_answers import (
    SSE_DONE,
    chunk_body,
    completion_body,
    extension,
    finish_reason,
    openai_calls,
    sse,
    stream_calls,
    usage_body,
)
from agentspec.adapters.openai_errors import ApiError, refused
from agentspec.adapters.openai_logprobs import Sent, TokenText, chat_content, put_logprobs
from agentspec.adapters.openai_protocol import ChatRequest, Rendered, render
from agentspec.grammar.tool_formats import ToolFormat
from agentspec.types import Generation

logger = logging.getLogger("agentspec.serve")


async def to_worker(executor: ThreadPoolExecutor, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a worker thread, awaited."""
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


class Chat:
    """The endpoint over one Speculator (``spec``): ``record`` is the server's recording
    setting (None: the Speculator's), ``tool_format`` the format tool calls are written in,
    ``executor`` the worker threads."""

    def __init__(self, spec: Any, *, record: bool | None, tool_format: ToolFormat,
                 executor: ThreadPoolExecutor) -> None:
        self.spec, self.record, self.tool_format = spec, record, tool_format
        self.executor = executor

    def open(self, req: ChatRequest, scope: str, top: int | None = None
             ) -> tuple[Rendered, Any]:
        """Render the request (``top``: the log-probability alternatives asked for, None for
        none), then open its Speculator stream (in a worker: tokenising and compiling a
        grammar take time); bad input raises ApiError before any token."""
        rendered = render(req, self.spec.tokenizer, tool_format=self.tool_format)
        if top is not None:
            rendered = replace(rendered, sampling=replace(rendered.sampling, logprobs=top))
        try:
            run = self.spec.stream(rendered.prompt, req.max_tokens, sampling=rendered.sampling,
                                   stop=req.stop, scope=scope, record=self.record)
        except Exception as exc:
            if (error := refused(exc, param="messages")) is None:
                raise
            raise error from None
        return rendered, run

    async def body(self, rendered: Rendered, gen: Generation, top: int | None, scope: str,
                   head: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON answer of a whole generation (its tool calls read back when it may
        hold them, its tokens' log-probabilities with ``top``)."""
        content, calls = openai_calls(gen.text, rendered.tool_format) if rendered.calls \
            else (gen.text, [])
        body = completion_body(content=content, calls=calls, gen=gen, scope=scope, **head)
        if top is not None:
            text = await to_worker(self.executor, TokenText.of, self.spec)
            put_logprobs(body, chat_content(text, gen.logprobs or ()))
        return body

    async def events(self, stream: Any, rendered: Rendered, req: ChatRequest, scope: str,
                     head: Mapping[str, Any], items: AsyncGenerator[Any, None],
                     finished: Callable[[Generation], None]) -> AsyncIterator[bytes]:
        """A streamed answer's server-sent events from ``items`` (``stream``'s text deltas,
        then its Generation): the role first, then the text as it comes (what may still
        become a tool call held back), the calls whole, the finish, the usage when asked; an
        error (the request stopped, the generation failed) as an error event. ``finished``
        hears the Generation."""
        yield sse(chunk_body(**head, delta={"role": "assistant", "content": ""}))
        holdback = CallHoldback(rendered.calls, rendered.tool_format)  # may still be a call
        gen: Generation | None = None
        sent = None if rendered.sampling.logprobs is None else Sent(
            await to_worker(self.executor, TokenText.of, self.spec))
        shown = 0  # characters of content sent
        try:
            async with aclosing(items):
                async for item in items:
                    if isinstance(item, str):
                        text = holdback.push(item)
                        if text:
                            shown += len(text)
                            chunk = chunk_body(**head, delta={"content": text})
                            if sent is not None:
                                put_logprobs(chunk, chat_content(sent.text,
                                                                 sent.shown(stream, shown)[1]))
                            yield sse(chunk)
                    else:
                        gen = item
        except ApiError as e:  # stopped: its deadline passed, or the server shuts down
            yield sse(e.body())
            yield SSE_DONE
            return
        except Exception as exc:  # the answer has begun: the error goes in the stream
            logger.exception("a streamed generation failed")
            yield sse(ApiError(500, f"the generation failed: {type(exc).__name__}",
                               type="server_error").body())
            yield SSE_DONE
            return
        assert gen is not None
        finished(gen)
        content, calls = openai_calls(holdback.held, rendered.tool_format) if holdback.held \
            else ("", [])
        if content:
            yield sse(chunk_body(**head, delta={"content": content}))
        if calls:
            yield sse(chunk_body(**head, delta=stream_calls(calls)))
        last = chunk_body(**head, delta={}, finish=finish_reason(gen, calls),
                          agentspec=extension(gen, scope))
        if sent is not None:
            put_logprobs(last, chat_content(sent.text, sent.rest(gen)[1]))
        yield sse(last)
        if req.include_usage:
            yield sse(chunk_body(**head, delta=None, usage=usage_body(gen)))
        yield SSE_DONE
