"""LangChain models on a Speculator: ``ChatAgentSpec`` (chat, tools, structured output) and
``AgentSpecLLM`` (text completion). Needs ``pip install 'agentspec-llm[langchain]'``.

Streaming yields one chunk per committed step (one text delta of ``Speculator.stream``);
``invoke`` concatenates the same chunks. Async runs the sync stream in one worker thread per
call (the Speculator's turns are per step, so calls interleave and none blocks the event loop).

Tools are rendered through the chat template's own tool support when it has one, else as a
JSON-schema system block; the model answers a call in the tool-call format its template
teaches (``{"name": ..., "arguments": {...}}`` without one), or in ``tool_format``.
Every call with tools bound is grammar-constrained (:mod:`agentspec.grammar`): a forced
``tool_choice`` ("any"/"required"/a name) admits only a valid call of a bound tool, "auto" a
valid call or plain text, and JSON mode / structured output a value of the schema. The
grammar's forced tokens are drafted for free; outputs stay exact (the masked target's).
The prompt, the grammars and the parse of tool calls live in :mod:`agentspec.adapters.chat`,
shared with the OpenAI-compatible server, so both ask the Speculator the same thing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

try:
    from langchain_core.language_models import BaseChatModel, BaseLLM, LanguageModelInput
    from langchain_core.language_models.chat_models import generate_from_stream
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolMessage
    from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
    from langchain_core.outputs import (
        ChatGenerationChunk,
        ChatResult,
        Generation,
        GenerationChunk,
        LLMResult,
    )
    from langchain_core.runnables import Runnable
    from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
    from pydantic import BaseModel, ConfigDict, Field, field_validator
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("agentspec.adapters.langchain needs: pip install 'agentspec-llm[langchain]'") from exc

from agentspec.adapters.chat import (
    CallHoldback,
    build_prompt,
    call_grammar,
    calls_text,
    deltas_then_generation,
    in_thread,
    parse_tool_calls,
    resolve_tool_format,
    schema_grammar,
    tool_choice_mode,
)
from agentspec.config import SamplingParams
from agentspec.grammar import Grammar
from agentspec.grammar.tool_formats import ToolFormat
from agentspec.grammar.tool_formats import tool_format as find_format
from agentspec.types import Generation as SpecGeneration

# Re-exported: the prompt, grammar and parsing live in agentspec.adapters.chat, shared with
# the OpenAI server.
__all__ = ["AgentSpecLLM", "ChatAgentSpec", "build_prompt", "call_grammar", "parse_tool_calls",
           "to_chat_messages", "tool_choice_mode"]

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


def _speculate(spec: Any, prompt: Any, max_new_tokens: int, *, sampling: SamplingParams,
               stop: Sequence[str], scope: str | None) -> Iterator[str | SpecGeneration]:
    """Text deltas of one call, then its finished Generation as the last item (the one place
    the Speculator is called)."""
    yield from deltas_then_generation(
        spec.stream(prompt, max_new_tokens, sampling=sampling, stop=list(stop), scope=scope))


def to_chat_messages(messages: Sequence[BaseMessage], *,
                     tool_format: str | ToolFormat = "json") -> list[dict[str, str]]:
    """LangChain messages as ``{"role", "content"}`` dicts; an AI message's tool calls
    written after its text as the model writes them in ``tool_format``."""
    out = []
    for i, msg in enumerate(messages):
        role = _ROLES.get(msg.type)
        if role is None:
            raise ValueError(f"message {i} has unsupported type {msg.type!r}; expected one of {sorted(_ROLES)}")
        text = str(msg.text)
        if isinstance(msg, AIMessage) and msg.tool_calls:
            text = calls_text(text, [(c["name"], c["args"]) for c in msg.tool_calls], tool_format)
        if isinstance(msg, ToolMessage) and msg.status == "error":
            text = f"Error: {text}" if not text.startswith("Error") else text
        out.append({"role": role, "content": text})
    return out


# -- the models --------------------------------------------------------------------------------

class _SpecParams(BaseModel):
    """Fields and call plumbing of both models; ``model`` defaults to the target's name."""
    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    speculator: Any = Field(default=None, exclude=True)
    """The :class:`agentspec.Speculator` that generates (required; construction does no I/O)."""
    model_name: str | None = Field(default=None, alias="model")
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] | None = None
    scope: str | None = None
    """Memory scope of the calls; default the active session's, else ``"default"``."""
    streaming: bool = False

    @classmethod
    def from_pretrained(cls, name: str = "smollm2-135m-instruct", *, device: Any = None,
                        dtype: Any = None, memory: Any = "default", quantize: str | None = None,
                        **fields: Any) -> Any:
        """Load ``name`` into a new Speculator and wrap it: ``name``, ``device``, ``dtype``,
        ``quantize`` and ``memory`` as :meth:`agentspec.Speculator.from_pretrained` takes them
        (a packaged model, a model folder, a ``.gguf`` file or a hub id; ``memory=None``: no
        memory);
        ``fields`` as the constructor's (``max_tokens=64``, ``temperature=0.0``, ...)."""
        from agentspec.speculator import Speculator

        spec = Speculator.from_pretrained(name, device=device, dtype=dtype, quantize=quantize,
                                          memory=memory)
        return cls(speculator=spec, **fields)

    def _label(self) -> str:
        target = getattr(self.speculator, "target", None)
        return self.model_name or str(getattr(target, "name", None) or "agentspec")

    def _spec(self) -> Any:
        if self.speculator is None:
            raise ValueError(f"{type(self).__name__} needs speculator=Speculator(...), got None")
        return self.speculator

    def _sampling(self, grammar: Grammar | None = None) -> SamplingParams:
        return SamplingParams(temperature=float(self.temperature), top_p=float(self.top_p),
                              top_k=self.top_k, seed=self.seed, grammar=grammar)

    def _stops(self, stop: list[str] | None) -> list[str]:
        return [*(self.stop or []), *(stop or [])]

    def _steps(self, prompt: Any, stop: list[str] | None, max_tokens: int | None,
               grammar: Grammar | None = None) -> Iterator[str | SpecGeneration]:
        return _speculate(self._spec(), prompt, max_tokens or self.max_tokens,
                          sampling=self._sampling(grammar), stop=self._stops(stop),
                          scope=self.scope)

    def _metadata(self, gen: SpecGeneration) -> dict[str, Any]:
        s = gen.stats
        return {"model_name": self._label(), "model_provider": "agentspec",
                "finish_reason": gen.finish_reason, "steps": s.steps,
                "tokens_per_step": s.tokens_per_step, "accepted_by_source": dict(s.accepted),
                "drafted_by_source": dict(s.drafted), "seconds": s.seconds}


class ChatAgentSpec(_SpecParams, BaseChatModel):
    """A LangChain chat model on a Speculator: exact speculative decoding, local and offline.

    Example:
        >>> chat = ChatAgentSpec.from_pretrained("smollm2-135m-instruct", max_tokens=64)
        >>> chat.invoke("Name a colour.").content
    """

    tool_format: str | None = None
    """How the model writes tool calls: ``json``, ``hermes``, ``llama3``, ``mistral``,
    ``mistral_v11``, ``phi`` or ``granite`` (:mod:`agentspec.grammar.tool_formats`); None: the format the chat
    template teaches (``json`` when it renders no tools)."""

    @field_validator("tool_format")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        if value is not None:
            find_format(value)  # raises, naming the value and the known formats
        return value

    @property
    def _llm_type(self) -> str:
        return "agentspec-chat"

    def _format(self) -> ToolFormat:
        """The format of this model's calls (``tool_format``, else its template's)."""
        return resolve_tool_format(getattr(self.speculator, "tokenizer", None), self.tool_format)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params: Any = super()._get_ls_params(stop=stop, **kwargs)
        params.update(ls_provider="agentspec", ls_temperature=self.temperature,
                      ls_max_tokens=self.max_tokens, ls_model_name=kwargs.get("model") or self._label())
        if stop or self.stop:
            params["ls_stop"] = self._stops(stop)
        return params

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (functions, ``BaseTool``s, pydantic models, JSON schemas).

        ``tool_choice``: None/"auto": a valid call of a bound tool or plain text, as the model
        decides; "any"/"required": a valid call of a bound tool; a tool's name: a valid call
        of that tool; "none": plain text. Enforced by a grammar (exact: the masked target).
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        call_grammar(formatted, tool_choice, self._format())  # refuse a bad choice or schema now
        return self.bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type, *, include_raw: bool = False,
                               **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """Structured output, grammar-constrained: ``method="function_calling"`` (default, a
        forced tool call), ``"json_schema"`` (the same) or ``"json_mode"`` (a JSON value of the
        schema, parsed)."""
        method = kwargs.pop("method", None) or "function_calling"
        kwargs.pop("strict", None)
        if method in ("function_calling", "json_schema"):
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if method != "json_mode":
            raise ValueError(f"method must be 'function_calling', 'json_schema' or 'json_mode', got {method!r}")
        if include_raw or kwargs:
            raise ValueError(f"json_mode takes no include_raw/extra options, got {include_raw=}, {kwargs}")
        is_model = isinstance(schema, type) and issubclass(schema, BaseModel)
        llm = self.bind(response_format={"type": "json_object", "schema": convert_to_json_schema(schema)},
                        ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
        parser: Any = PydanticOutputParser(pydantic_object=schema) if is_model and isinstance(schema, type) else JsonOutputParser()
        return llm | parser

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: Any = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        tools = kwargs.get("tools") or []
        json_mode = kwargs.get("response_format")
        fmt = resolve_tool_format(self._spec().tokenizer, self.tool_format)
        grammar: Grammar | None
        if json_mode:
            grammar, system = schema_grammar(json_mode.get("schema"))
        else:
            grammar, system = call_grammar(tools, kwargs.get("tool_choice"), fmt), ""
        prompt = build_prompt(self._spec().tokenizer, to_chat_messages(messages, tool_format=fmt),
                              tools=tools, system=system, tool_format=fmt,
                              constrained=grammar is not None)
        holdback = CallHoldback(bool(tools), fmt)  # output that may still be a tool call
        for item in self._steps(prompt, stop, kwargs.get("max_tokens"), grammar):
            if isinstance(item, str):
                text = holdback.push(item)
                if not text:
                    continue
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=text))
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
            else:
                yield self._last_chunk(holdback.held, item, parse=bool(tools), fmt=fmt)

    def _last_chunk(self, held: str, gen: SpecGeneration, *, parse: bool,
                    fmt: ToolFormat) -> ChatGenerationChunk:
        content, calls, invalid = parse_tool_calls(held, fmt) if parse and held else (held, [], [])
        usage: Any = {"input_tokens": gen.stats.prompt_tokens, "output_tokens": len(gen.token_ids),
                      "total_tokens": gen.stats.prompt_tokens + len(gen.token_ids),
                      # prompt tokens whose KV came from earlier calls (held or prefix cache)
                      "input_token_details": {"cache_read": gen.stats.cached_tokens}}
        message = AIMessageChunk(content=content, tool_calls=calls, invalid_tool_calls=invalid,
                                 usage_metadata=usage, response_metadata=self._metadata(gen),
                                 chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": gen.finish_reason})

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        chunks = list(self._stream(messages, stop, run_manager, **kwargs))
        result = generate_from_stream(iter(chunks))
        # Summed chunks re-parse call args leniently (partial JSON); keep this parse's verdict.
        message, last = result.generations[0].message, chunks[-1].message
        assert isinstance(message, AIMessage) and isinstance(last, AIMessageChunk)
        message.tool_calls, message.invalid_tool_calls = last.tool_calls, last.invalid_tool_calls
        return result

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: Any = None, **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        sync_manager = run_manager.get_sync() if run_manager else None
        async for chunk in in_thread(lambda: self._stream(messages, stop, sync_manager, **kwargs)):
            yield chunk


class AgentSpecLLM(_SpecParams, BaseLLM):
    """A LangChain text-completion model (``BaseLLM``) on a Speculator; prompts used as is."""

    @property
    def _llm_type(self) -> str:
        return "agentspec"

    def _stream(self, prompt: str, stop: list[str] | None = None, run_manager: Any = None,
                **kwargs: Any) -> Iterator[GenerationChunk]:
        for item in self._steps(prompt, stop, kwargs.get("max_tokens")):
            if isinstance(item, str):
                chunk = GenerationChunk(text=item)
                if run_manager:
                    run_manager.on_llm_new_token(item, chunk=chunk)
            else:
                chunk = GenerationChunk(text="", generation_info={
                    **self._metadata(item), "prompt_tokens": item.stats.prompt_tokens,
                    "completion_tokens": len(item.token_ids)})
            yield chunk

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> LLMResult:
        generations: list[list[Generation]] = []
        for prompt in prompts:
            full: GenerationChunk | None = None
            for chunk in self._stream(prompt, stop, run_manager, **kwargs):
                full = chunk if full is None else full + chunk
            assert full is not None
            generations.append([Generation(text=full.text, generation_info=full.generation_info)])
        return LLMResult(generations=generations)

    async def _astream(self, prompt: str, stop: list[str] | None = None, run_manager: Any = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        sync_manager = run_manager.get_sync() if run_manager else None
        async for chunk in in_thread(lambda: self._stream(prompt, stop, sync_manager, **kwargs)):
            yield chunk
