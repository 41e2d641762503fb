"""Chat calls with tools or a schema, shared by the LangChain models and the OpenAI server.

Both front ends turn a chat request into the same Speculator call: the prompt (tools rendered
through the chat template's own tool support when it has one, else as a JSON-schema system
block), the grammar (a forced or optional tool call, or a value of a JSON schema) and the
parse of the output back into tool calls. Calls are written in one tool-call format
(:mod:`agentspec.grammar.tool_formats`): the one the chat template teaches, or the one a
caller names; the grammar, the earlier calls in the prompt and the parse all use it. Keeping those in one module is what makes an
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
from agentspec.grammar.tool_formats import ToolFormat, detect_tool_format
from agentspec.grammar.tool_formats import tool_format as find_format
from agentspec.types import Generation

T = TypeVar("T")

TOOL_BLOCK = ("You can call these tools (JSON schemas):\n{tools}\n\nTo call a tool, reply with "
              "only {how}. Otherwise answer normally.")
# Templates that read the tools from the system message rather than from ``tools=``.
_SYSTEM_TOOLS = ("message['tools']", 'message["tools"]', "message.tools")
SCHEMA_PROMPT = "Reply with only a JSON object matching this schema: {schema}"


# -- the prompt ------------------------------------------------------------------------------

def resolve_tool_format(tokenizer: Any, override: str | ToolFormat | None = None) -> ToolFormat:
    """The tool-call format of a model's calls: ``override`` when given, else the one its
    chat template teaches (:func:`~agentspec.grammar.tool_formats.detect_tool_format`;
    ``json`` when the template renders no tools, since agentspec's own system block then
    teaches that one), bound to the tokenizer's special tokens (:meth:`ToolFormat.on`: a
    wrapper the tokenizer holds as one special token is written as that token).

    Raises:
        ValueError: ``override`` names no known format (the message lists them).
    """
    name = override if override is not None else \
        detect_tool_format(getattr(tokenizer, "chat_template", None))
    fmt = find_format(name)
    return fmt if fmt.tokens or tokenizer is None else fmt.on(tokenizer)


def build_prompt(tokenizer: Any, messages: list[dict[str, str]], *,
                 tools: Sequence[dict[str, Any]] = (), system: str = "",
                 tool_format: str | ToolFormat = "json",
                 constrained: bool = False) -> list[dict[str, str]] | str:
    """The prompt for one call: the messages, or the rendered text when the chat template
    renders the tools itself. Without template support the tools become a system block
    that teaches ``tool_format``'s layout of a call.

    ``constrained``: a grammar constrains the answer from its first token (tool calls, JSON
    mode). A template with a thinking switch (Qwen3's ``enable_thinking``) is then rendered
    with thinking off, the model's own non-thinking mode (an empty think block opens its
    answer): the grammar would refuse the ``<think>`` its thinking mode starts with."""
    template = getattr(tokenizer, "chat_template", None) or ""
    native = "tools" in template
    no_thinking = constrained and "enable_thinking" in template
    if tools and not native:
        # One compact line per tool (its name, description and parameters): a third of the
        # tokens of an indented dump, paid in prefill on every call, and SmolLM2-135M follows
        # it better (under an indented dump its greedy Joke punchline loops to max_tokens).
        fmt = find_format(tool_format)
        how = f"a JSON object: {fmt.shape()}" if fmt.name == "json" else \
            f"the call written exactly like this: {fmt.shape()}"
        block = TOOL_BLOCK.format(how=how, tools="\n".join(
            json.dumps(t.get("function", t), ensure_ascii=False) for t in tools))
        system = "\n\n".join(filter(None, [system, block]))
    if system:
        if messages and messages[0]["role"] == "system":
            messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{system}"},
                        *messages[1:]]
        else:
            messages = [{"role": "system", "content": system}, *messages]
    if not (tools and native) and not no_thinking:
        return messages
    if tools and native and any(mark in template for mark in _SYSTEM_TOOLS):
        # Phi-4-mini's: tools on the system turn
        has_system = bool(messages) and messages[0]["role"] == "system"
        head = messages[0] if has_system else {"role": "system", "content": ""}
        messages = [{**head, "tools": json.dumps(list(tools), ensure_ascii=False)},
                    *messages[has_system:]]
    switch = {"enable_thinking": False} if no_thinking else {}
    text = tokenizer.apply_chat_template(messages, tools=(list(tools) or None) if native else None,
                                         tokenize=False, add_generation_prompt=True, **switch)
    bos = getattr(tokenizer, "bos_token", None)
    # A str prompt is tokenized with special tokens added: do not let the BOS appear twice.
    if bos and text.startswith(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]:
        text = text[len(bos):]
    return text


def calls_text(text: str, calls: Sequence[tuple[str, Any]],
               tool_format: str | ToolFormat = "json") -> str:
    """An assistant turn that made tool calls, as the model is asked to write them: its text,
    then the ``(name, arguments)`` calls in ``tool_format`` (``json``: one
    ``{"name": ..., "arguments": ...}`` line per call)."""
    fmt = find_format(tool_format)
    return "\n".join(filter(None, [text, fmt.render(calls)]))


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


def call_grammar(tools: Sequence[dict[str, Any]], tool_choice: Any,
                 tool_format: str | ToolFormat = "json") -> Grammar | None:
    """The grammar of one call's answer with ``tools`` bound, its calls in ``tool_format``
    (None: unconstrained)."""
    mode = tool_choice_mode(tools, tool_choice)
    if mode is None:
        return None
    fmt = find_format(tool_format)
    spec: dict[str, Any] = {"type": "tool_calls", "tools": list(tools), "choice": mode}
    if fmt.name != "json":  # the json format's spec as it always was: one compiled grammar
        spec["format"] = fmt.name
    if fmt.tokens:
        spec["special_tokens"] = dict(fmt.tokens)
    return compiled(spec)


def schema_grammar(schema: Mapping[str, Any] | None) -> tuple[Grammar, str]:
    """JSON mode: the grammar of one value of ``schema`` (any JSON object when None or empty)
    and the system line that asks the model for it."""
    schema = dict(schema or {}) or {"type": "object"}
    return (compiled({"type": "json_schema", "schema": schema}),
            SCHEMA_PROMPT.format(schema=json.dumps(schema)))


# -- the output ------------------------------------------------------------------------------

def looks_like_call(text: str, tool_format: str | ToolFormat = "json") -> bool:
    """Whether output starting with ``text`` may still turn out to be a tool call in
    ``tool_format``."""
    return find_format(tool_format).starts_call(text)


class CallHoldback:
    """Streamed text that may still turn out to be a tool call (in ``tool_format``) is held
    back, not shown.

    ``push`` returns the text to show now ("" while holding); ``held`` is what is held when
    the stream ends: the caller parses it with :func:`parse_tool_calls`.
    """

    def __init__(self, active: bool, tool_format: str | ToolFormat = "json") -> None:
        self.active = active
        self.format = find_format(tool_format)
        self.held = ""

    def push(self, delta: str) -> str:
        starts = self.format.starts_call
        if self.active and (self.held or starts(delta)) and starts(self.held + delta):
            self.held += delta
            return ""
        out, self.held = self.held + delta, ""
        return out


def parse_tool_calls(text: str, tool_format: str | ToolFormat = "json"
                     ) -> tuple[str, list[Any], list[Any]]:
    """Split model output into ``(content, tool_calls, invalid_tool_calls)``; never raises.

    The calls are read in ``tool_format`` (:meth:`ToolFormat.parse`; parallel calls where the
    format has them). ``json`` is lenient: every JSON object with a ``"name"`` (and
    ``"arguments"``, ``"parameters"`` or ``"args"``) is a call, fenced or not. When the output
    starts like a call but none parses (malformed, or cut off by ``max_tokens``), the text
    becomes one invalid call carrying the raw text and the error. Calls are LangChain's
    shape: ``{"name", "args", "id", "type": "tool_call"}``.
    """
    parsed = find_format(tool_format).parse(text)
    valid = [{"name": c.name, "args": c.arguments, "id": call_id(), "type": "tool_call"}
             for c in parsed.calls]
    return parsed.content, valid, [_invalid(b.name, b.raw, b.error) for b in parsed.invalid]


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
