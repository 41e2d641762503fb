"""OpenAI's chat answers, written without a web framework: a whole answer
(:func:`completion_body`), a streamed one's chunks (:func:`chunk_body`, :func:`stream_calls`)
framed as server-sent events (:func:`sse`, :data:`SSE_DONE`), their usage and agentspec's
own figures, and the tool calls read back from the model's output (:func:`openai_calls`).
"""

from __future__ import annotations

import json
from typing import Any

from agentspec.adapters.chat import parse_tool_calls
from agentspec.grammar.tool_formats import ToolFormat
from agentspec.types import Generation


def openai_calls(text: str, tool_format: str | ToolFormat = "json"
                 ) -> tuple[str, list[dict[str, Any]]]:
    """Output that may hold tool calls (in ``tool_format``) as ``(content, tool_calls)`` in
    OpenAI's shape (no valid call: the text unchanged and no calls)."""
    content, calls, _ = parse_tool_calls(text, tool_format)
    if not calls:
        return text, []
    return content, [{"id": c["id"], "type": "function",
                      "function": {"name": c["name"],
                                   "arguments": json.dumps(c["args"], ensure_ascii=False)}}
                     for c in calls]


def usage_body(gen: Generation) -> dict[str, Any]:
    prompt, completion = gen.stats.prompt_tokens, len(gen.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": gen.stats.cached_tokens}}


def extension(gen: Generation, scope: str) -> dict[str, Any]:
    """agentspec's own figures of a call (the ``agentspec`` field of an answer)."""
    return {"scope": scope, "stats": gen.stats.as_dict()}


def finish_reason(gen: Generation, calls: list[dict[str, Any]]) -> str:
    return "tool_calls" if calls else gen.finish_reason


def completion_body(*, id: str, created: int, model: str, content: str,
                    calls: list[dict[str, Any]], gen: Generation, scope: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else ""),
                               "refusal": None}
    if calls:
        message["tool_calls"] = calls
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason(gen, calls)}],
            "usage": usage_body(gen), "system_fingerprint": None,
            "agentspec": extension(gen, scope)}


def chunk_body(*, id: str, created: int, model: str, delta: dict[str, Any] | None,
               finish: str | None = None, usage: dict[str, Any] | None = None,
               **extra: Any) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta`` None: the usage chunk (no choices)."""
    body: dict[str, Any] = {"id": id, "object": "chat.completion.chunk", "created": created,
                            "model": model, "system_fingerprint": None,
                            "choices": [] if delta is None else [
                                {"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    body.update(extra)
    return body


def stream_calls(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The delta that carries a stream's tool calls, each whole."""
    return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
