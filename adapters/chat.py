"""Chat calls with tools or a schema, shared by the LangChain models and the OpenAI server.

Both front ends turn a chat request into the same Speculator call: the prompt (tools rendered
through the chat template's own tool support when it has one, else as a JSON-schema system
block), the grammar (a forced or optional tool call, or a value of a JSON schema) and the
parse of the output back into tool calls. Keeping those in one module is what makes an
answer served over HTTP the same answer as one from ``ChatAgentSpec``, and both the same as
``Speculator.generate`` on that prompt and grammar.

It also holds the bridge from a Speculator stream, which blocks, to asyncio: the stream runs
in a worker thread and its items reach the event loop as they come; a consumer that goes
away stops the worker before its next step, so an abandoned call blocks nobody.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

from agentspec.grammar import Grammar, compiled
from agentspec.types import Generation

T = TypeVar("T")

TOOL_BLOCK = ("You can call these tools (JSON schemas):\n{tools}\n\nTo call a tool, reply with "
              'only a JSON object: {{"name": "<tool name>", "arguments": {{<argument>: <value>}}}}. '
              "Otherwise answer normally.")
SCHEMA_PROMPT = "Reply with only a JSON object matching this schema: {schema}"


# -- the prompt ------------------------------------------------------------------------------

def build_prompt(tokenizer: Any, messages: list[dict[str, str]], *,
                 tools: Sequence[dict[str, Any]] = (), system: str = "") -> list[dict[str, str]] | str:
    """The prompt for one call: the messages, or the rendered text when the chat template
    renders the tools itself."""
    native = "tools" in (getattr(tokenizer, "chat_template", None) or "")
    if tools and not native:
        # One compact line per tool (its name, description and parameters): a third of the
        # tokens of an indented dump, paid in prefill on every call, and SmolLM2-135M follows
        # it better (under an indented dump its greedy Joke punchline loops to max_tokens).
        block = TOOL_BLOCK.format(tools="\n".join(
            json.dumps(t.get("function", t), ensure_ascii=False) for t in tools))
        system = "\n\n".join(filter(None, [system, block]))
    if system:
        if messages and messages[0]["role"] == "system":
            messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{system}"},
                        *messages[1:]]
        else:
            messages = [{"role": "system", "content": system}, *messages]
    if not (tools and native):
        return messages
    text = tokenizer.apply_chat_template(messages, tools=list(tools) or None, tokenize=False,
                                         add_generation_prompt=True)
    bos = getattr(tokenizer, "bos_token", None)
    # A str prompt is tokenized with special tokens added: do not let the BOS appear twice.
    if bos and text.startswith(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]:
        text = text[len(bos):]
    return text


def calls_text(text: str, calls: Sequence[tuple[str, Any]]) -> str:
    """An assistant turn that made tool calls, as the model is asked to write them: its text,
    then one ``{"name": ..., "arguments": ...}`` line per ``(name, arguments)``."""
    return "\n".join(filter(None, [text, *(json.dumps({"name": name, "arguments": args},
                                                        ensure_ascii=False)
                                             for name, args in calls)]))


# -- the grammar -----------------------------------------------------------------------------

def tool_choice_mode(tools: Sequence[dict[str, Any]], tool_choice: Any) -> str | None:
    """A ``tool_choice`` (LangChain's or OpenAI's) as a grammar's ``choice``: ``"auto"``,
    ``"required"``, a tool's name, or None (no tools, or ``"none"``: unconstrained text).

    Raises:
        ValueError: ``tool_choice`` names no bound tool.
    """
    if not tools or tool_choice in ("none", False):
        return None
    if tool_choice in (None, "auto"):
        return "auto"
    if tool_choice in ("any", "required", True):
        return "required"
    if isinstance(tool_choice, dict):
        tool_choice = tool_choice.get("function", tool_choice).get("name", "required")
    names = [t["function"]["name"] for t in tools]
    if tool_choice not in names:
        raise ValueError(f"tool_choice {tool_choice!r} names no bound tool; bound: {names}")
    return str(tool_choice)


def call_grammar(tools: Sequence[dict[str, Any]], tool_choice: Any) -> Grammar | None:
    """The grammar of one call's answer with ``tools`` bound (None: unconstrained)."""
    mode = tool_choice_mode(tools, tool_choice)
    if mode is None:
        return None
    return compiled({"type": "tool_calls", "tools": list(tools), "choice": mode})


def schema_grammar(schema: Mapping[str, Any] | None) -> tuple[Grammar, str]:
    """JSON mode: the grammar of one value of ``schema`` (any JSON object when None or empty)
    and the system line that asks the model for it."""
    schema = dict(schema or {}) or {"type": "object"}
    return (compiled({"type": "json_schema", "schema": schema}),
            SCHEMA_PROMPT.format(schema=json.dumps(schema)))


# -- the output ------------------------------------------------------------------------------

def looks_like_call(text: str) -> bool:
    """Whether output starting with ``text`` may still turn out to be a tool call."""
    head = text.lstrip()
    return head.startswith(("{", "```", "<tool_call>", "[")) or not head


class CallHoldback:
    """Streamed text that may still turn out to be a tool call is held back, not shown.

    ``push`` returns the text to show now ("" while holding); ``held`` is what is held when
    the stream ends: the caller parses it with :func:`parse_tool_calls`.
    """

    def __init__(self, active: bool) -> None:
        self.active = active
        self.held = ""

    def push(self, delta: str) -> str:
        if self.active and (self.held or looks_like_call(delta)) and looks_like_call(self.held + delta):
            self.held += delta
            return ""
        out, self.held = self.held + delta, ""
        return out


def parse_tool_calls(text: str) -> tuple[str, list[Any], list[Any]]:
    """Split model output into ``(content, tool_calls, invalid_tool_calls)``; never raises.

    Every JSON object with a ``"name"`` (and ``"arguments"``, ``"parameters"`` or ``"args"``)
    is a call; when the output starts like a call but no object parses (malformed, or cut off
    by ``max_tokens``), the text becomes one invalid call carrying the raw text and the error.
    Calls are LangChain's shape: ``{"name", "args", "id", "type": "tool_call"}``.
    """
    decoder, calls, spans, pos = json.JSONDecoder(), [], [], 0
    while (start := text.find("{", pos)) >= 0:
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            pos = start + 1
            continue
        found = [o for o in (obj if isinstance(obj, list) else [obj])
                 if isinstance(o, dict) and isinstance(o.get("name"), str)]
        if found:
            calls.extend(found)
            spans.append((start, end))
        pos = end
    valid, invalid = [], []
    for call in calls:
        args: Any = next((call[k] for k in ("arguments", "parameters", "args") if k in call), {})
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError as exc:
                invalid.append(_invalid(call["name"], args, f"arguments are not JSON: {exc}"))
                continue
        if not isinstance(args, dict):
            invalid.append(_invalid(call["name"], json.dumps(args), f"arguments must be an object, got {args!r}"))
            continue
        valid.append({"name": call["name"], "args": args, "id": call_id(), "type": "tool_call"})
    if not calls and looks_like_call(text) and text.strip():
        return "", [], [_invalid(None, text, "no parseable tool call JSON in the output")]
    content = text
    for start, end in reversed(spans):
        content = content[:start] + content[end:]
    for junk in ("```json", "```", "<tool_call>", "</tool_call>"):
        content = content.replace(junk, "")
    content = content.strip() if calls else text
    return content, valid, invalid


def _invalid(name: str | None, args: str, error: str) -> dict[str, Any]:
    return {"name": name, "args": args, "id": call_id(), "error": error, "type": "invalid_tool_call"}


def call_id() -> str:
    """A fresh tool-call id: ``call_`` and random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


# -- running a call ----------------------------------------------------------------------------

def deltas_then_generation(stream: Any) -> Iterator[str | Generation]:
    """The text deltas of a Speculator stream, then its finished Generation as the last item."""
    yield from stream
    if stream.generation is None:
        raise RuntimeError("the Speculator's stream ended without its Generation")
    yield stream.generation


async def in_thread(make: Callable[[], Iterator[T]], *,
                    executor: Executor | None = None) -> AsyncIterator[T]:
    """Iterate a sync iterator in one worker thread (this context copied), items as they come.

    When the consumer stops early (closed, cancelled, raised into), the worker asks for no
    further item and closes the iterator (a Speculator stream then abandons its run and its
    turn goes on); an item already being computed finishes first.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
    cancelled = threading.Event()

    def put(item: tuple[bool, Any]) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def pump() -> None:
        items: Iterator[T] | None = None
        try:
            items = make()
            while not cancelled.is_set():
                try:
                    item = next(items)
                except StopIteration:
                    break
                put((False, item))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            put((True, exc))
        else:
            put((True, None))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    worker = loop.run_in_executor(executor, contextvars.copy_context().run, pump)
    try:
        while True:
            done, item = await queue.get()
            if done:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        cancelled.set()
        await worker
