"""An OpenAI-compatible HTTP server over one Speculator: ``agentspec serve``.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (:mod:`.openai_completions`;
plain or streamed as server-sent events, with log-probabilities on request), ``GET
/v1/models``, ``GET /health``, ``GET /ready``, ``GET /metrics``, and the page that shows what
the drafts did (``GET /`` and its data, :mod:`.dashboard`), on Starlette. Needs
``pip install 'agentspec-llm[serve]'``.

What a request means is :mod:`.openai_protocol`'s business, what an answer looks like
:mod:`.openai_answers`', a chat request's generation and answer :mod:`.openai_chat`'s; this
module moves bytes, guards the door and hands generations to worker threads:

- Access: with keys configured (``ServerConfig.api_keys``, ``key_scopes``) every ``/v1``
  request needs ``Authorization: Bearer <key>`` (401 without a known one). A request's memory
  scope is the ``X-Agentspec-Scope`` header, else its ``user`` field, else its key's first
  scope, else the server's default; a key with scopes may use only those, any other key only
  the allow-list (``scopes``) when there is one (403 otherwise). The scope is all a request
  reads from or writes to the completion memory, so tenants never see each other's drafts.
- Limits: a body over ``max_body_bytes`` is refused (413) before it is read whole; a
  ``max_tokens`` over the server's bound is a 400; every malformed request gets a 4xx in
  OpenAI's error shape and the server goes on.
- Generations run in worker threads (``workers``), each a call of the Speculator, whose
  scheduler steps every running request in the same forwards (``SpecConfig.max_batch`` at
  once; :mod:`agentspec.scheduler`). A streamed one (:meth:`Speculator.stream`) sends its text
  to the event loop as each step commits it; a client that disconnects ends it, and its
  sequence is freed at the next step. One not streamed is the same stream read whole; it
  stops the same way when its client disconnects.
- Admission, deadlines, shutdown and metrics are :mod:`.lifecycle`'s (``ServiceConfig``):
  a bounded queue (429), a request timeout (504), a drain on SIGTERM (503), ``/metrics``;
  the load they report and refuse by is the Speculator's (``Speculator.load``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

try:
    import anyio
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
    from starlette.types import Receive, Scope, Send
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the OpenAI server needs: pip install 'agentspec-llm[serve]'") from exc

from agentspec.adapters.chat import deltas_then_generation, in_thread, resolve_tool_format
from agentspec.adapters.dashboard import Dashboard
from agentspec.adapters.json_text import lone_surrogate
from agentspec.adapters.lifecycle import Lifecycle, ServiceConfig, Ticket, ticket_of
from agentspec.adapters.openai_chat import Chat, to_worker
from agentspec.adapters.openai_completions import Completions, parse_completion_request
from agentspec.adapters.openai_errors import ApiError
from agentspec.adapters.openai_logprobs import chat_logprobs
from agentspec.adapters.openai_protocol import check_scope as scope_name
from agentspec.adapters.openai_protocol import parse_chat_request
from agentspec.grammar.tool_formats import tool_format as find_format
from agentspec.types import Generation

logger = logging.getLogger("agentspec.serve")
SCOPE_HEADER = "x-agentspec-scope"


@dataclass(frozen=True)
class ServerConfig:
    """How a server answers.

    Attributes:
        models: the names a request's ``model`` may give (the first is listed first).
        max_tokens: the most tokens one request may ask for (and what it gets by default).
        max_body_bytes: the largest request body read.
        api_keys: keys that may use any allowed scope; with these or ``key_scopes`` given,
            a request without a known key is refused.
        key_scopes: key -> the scopes it may use, its default first.
        scopes: the allow-list of scopes for ``api_keys`` and keyless servers; None: any.
        default_scope: the scope of a request that names none.
        record: whether completions are recorded (None: the Speculator's setting).
        workers: threads carrying generations (each running request holds one); more requests
            wait for one. The Speculator steps up to its ``SpecConfig.max_batch`` of them at
            once.
        tool_format: how the model writes tool calls (a name in
            :data:`agentspec.grammar.tool_formats.FORMATS`); None: the format its chat
            template teaches.
    """

    models: tuple[str, ...]
    max_tokens: int = 1024
    max_body_bytes: int = 1 << 20
    api_keys: frozenset[str] = frozenset()
    key_scopes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    scopes: frozenset[str] | None = None
    default_scope: str = "default"
    record: bool | None = None
    workers: int = 16
    tool_format: str | None = None

    def __post_init__(self) -> None:
        if self.tool_format is not None:
            find_format(self.tool_format)  # raises, naming the value and the known formats
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise ValueError(f"models must name at least one model, got {self.models!r}")
        for name, value in (("max_tokens", self.max_tokens),
                            ("max_body_bytes", self.max_body_bytes), ("workers", self.workers)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for scope in [self.default_scope, *(self.scopes or ()),
                      *(s for scopes in self.key_scopes.values() for s in scopes)]:
            _valid_scope(scope)
        if any(not scopes for scopes in self.key_scopes.values()):
            raise ValueError("every key in key_scopes needs at least one scope")
        if self.scopes is not None and self.default_scope not in self.scopes:
            raise ValueError(f"the default scope {self.default_scope!r} is not in the allowed "
                             f"scopes {sorted(self.scopes)}")
        if any(not k for k in [*self.api_keys, *self.key_scopes]):
            raise ValueError("an API key may not be empty")

    @property
    def needs_key(self) -> bool:
        return bool(self.api_keys or self.key_scopes)


def _valid_scope(name: str) -> str:
    try:
        return scope_name(name, "scope")
    except ApiError as e:
        raise ValueError(e.message) from None


def resolve_scope(config: ServerConfig, key: str | None, header: str | None,
                  user: str | None) -> str:
    """The memory scope of a request (see the module docstring).

    Raises:
        ApiError: 400 for a badly formed scope name, 403 for a scope the key may not use.
    """
    asked = (scope_name(header, "X-Agentspec-Scope header") if header is not None
             else scope_name(user, "user") if user is not None else None)
    if key is not None and key in config.key_scopes:
        allowed: frozenset[str] | None = frozenset(config.key_scopes[key])
        default = config.key_scopes[key][0]
    else:
        allowed, default = config.scopes, config.default_scope
    scope = asked or default
    if allowed is not None and scope not in allowed:
        raise ApiError(403, f"scope {scope!r} is not allowed for this key", type="permission_error",
                       param=SCOPE_HEADER if header is not None else "user", code="scope_not_allowed")
    return scope


def visible_scopes(config: ServerConfig, key: str | None) -> frozenset[str] | None:
    """The scopes whose requests and memory a key may see (None: every scope): a key's own
    scopes, else the allow-list."""
    if key is not None and key in config.key_scopes:
        return frozenset(config.key_scopes[key])
    return config.scopes


def authenticate(config: ServerConfig, authorization: str | None) -> str | None:
    """The request's key (None on a keyless server).

    Raises:
        ApiError: 401 without ``Authorization: Bearer <a known key>``.
    """
    if not config.needs_key:
        return None
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    known = False
    for candidate in [*config.api_keys, *config.key_scopes]:  # each compared in constant time
        known |= hmac.compare_digest(candidate.encode(), key.encode())
    if scheme.lower() != "bearer" or not key or not known:
        said = "no API key" if not key else "an incorrect API key"
        raise ApiError(401, f"you provided {said}; send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    return key


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body, read up to ``limit`` bytes (413 past it, 400 if not JSON)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        if length.isdigit():
            raise ApiError(413, f"the request body is {length} bytes, more than this server's "
                                f"limit of {limit}", code="request_too_large")
        raise ApiError(400, f"bad Content-Length {length!r:.40}", code="invalid_body")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is more than this server's limit of {limit} "
                                f"bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        value = json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise ApiError(400, f"the request body is not valid JSON: {exc}"[:300],
                       code="invalid_json") from None
    if (not_text := lone_surrogate(value)) is not None:  # valid JSON, but not text
        raise ApiError(400, not_text[1], param=not_text[0], code="invalid_text")
    return value


class _EventStream(StreamingResponse):
    """A streamed answer whose generator is closed when the response ends, however it ends
    (a disconnected client included), so its generation stops at once."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


class OpenAIServer:
    """The endpoints over one Speculator (``spec``) under ``config`` and ``service`` (the
    queue, deadlines and metrics: :class:`~.lifecycle.ServiceConfig`); :attr:`app` is the ASGI
    application."""

    def __init__(self, spec: Any, config: ServerConfig,
                 service: ServiceConfig | None = None) -> None:
        self.spec, self.config = spec, config
        self.tool_format = resolve_tool_format(spec.tokenizer, config.tool_format)
        self.executor = ThreadPoolExecutor(config.workers, thread_name_prefix="agentspec-serve")
        self._chat = Chat(spec, record=config.record, tool_format=self.tool_format,
                          executor=self.executor)
        self._completions = Completions(spec, config.record)
        # The load is the scheduler's (Speculator.load), asked whenever it is needed.
        self.lifecycle = Lifecycle(service or ServiceConfig(), load=lambda: spec.load(),
                                   memory=getattr(spec, "memory", None))
        metrics = self.lifecycle.metrics_page(
            lambda request: authenticate(self.config, request.headers.get("authorization")))
        self.dashboard = Dashboard(
            spec, authorize=lambda request: authenticate(self.config,
                                                         request.headers.get("authorization")),
            scopes_for=lambda key: visible_scopes(self.config, key), load=self.lifecycle.counts)
        self.app = self.lifecycle.wrap(Starlette(
            routes=[Route("/", self.dashboard.page, methods=["GET"]),
                    Route("/v1/agentspec/dashboard", self.dashboard.data, methods=["GET"]),
                    Route("/v1/chat/completions", self.chat, methods=["POST"]),
                    Route("/v1/completions", self.completions, methods=["POST"]),
                    Route("/v1/models", self.models, methods=["GET"]),
                    Route("/health", self.health, methods=["GET"]),
                    Route("/ready", self.lifecycle.ready, methods=["GET"]),
                    Route("/metrics", metrics, methods=["GET"])],
            exception_handlers={HTTPException: _http_error, Exception: _server_error}))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        try:
            authenticate(self.config, request.headers.get("authorization"))
        except ApiError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "agentspec"}
            for name in self.config.models]})

    async def chat(self, request: Request) -> Response:
        try:
            key = authenticate(self.config, request.headers.get("authorization"))
            body = await read_json(request, self.config.max_body_bytes)
            req = parse_chat_request(body, models=self.config.models,
                                     max_tokens=self.config.max_tokens)
            top = chat_logprobs(body)
            scope = resolve_scope(self.config, key, request.headers.get(SCOPE_HEADER), req.user)
            # A Speculator stream either way, stopped when its ticket says so (its deadline,
            # the server's shutdown, a client gone): abandoned, freed at its next step.
            rendered, run = await to_worker(self.executor, self._chat.open, req, scope, top)
        except ApiError as e:
            return _error(e)
        ticket = ticket_of(request)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": req.model}

        def finished(gen: Generation) -> None:
            self.lifecycle.finished(ticket, gen, scope)
            self.dashboard.finished(head["id"], gen, scope, "chat")

        if req.stream:
            items = ticket.guard(self._steps(ticket, run))
            return _EventStream(self._chat.events(run, rendered, req, scope, head, items,
                                                  finished),
                                media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            gen = await ticket.last(self._steps(ticket, run), request)
        except ApiError as e:
            return _error(e)
        assert isinstance(gen, Generation)
        finished(gen)
        return JSONResponse(await self._chat.body(rendered, gen, top, scope, head))

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions`` (:mod:`.openai_completions`): keys and scopes as for chat."""
        try:
            key = authenticate(self.config, request.headers.get("authorization"))
            body = await read_json(request, self.config.max_body_bytes)
            req = parse_completion_request(body, models=self.config.models,
                                           max_tokens=self.config.max_tokens)
            scope = resolve_scope(self.config, key, request.headers.get(SCOPE_HEADER), req.user)
            opened = await to_worker(self.executor, self._completions.open, req, scope)
        except ApiError as e:
            return _error(e)
        ticket = ticket_of(request)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}

        def finished(gen: Generation) -> None:
            self.lifecycle.finished(ticket, gen, scope)
            self.dashboard.finished(head["id"], gen, scope, "completions")

        def whole(stream: Any) -> Any:
            return ticket.last(self._steps(ticket, stream), request)

        if req.stream:
            items = ticket.guard(self._steps(ticket, opened.streams[0]))
            return _EventStream(self._completions.events(opened, items, head=head,
                                                         finished=finished),
                                media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        runs = [asyncio.ensure_future(whole(s)) for s in opened.streams]  # a choice each
        try:
            gens = await asyncio.gather(*runs)
        except ApiError as e:
            return _error(e)
        finally:
            for run in runs:  # one failed or was stopped: the others stop too
                run.cancel()
        for gen in gens:
            finished(gen)
        # In a worker: with logprobs, each token's text offset decodes the tokens before it.
        return JSONResponse(await to_worker(self.executor, self._completions.body, opened, gens,
                                            head))

    def _steps(self, ticket: Ticket, stream: Any) -> AsyncIterator[Any]:
        """``stream``'s text deltas, then its Generation, from a worker thread, where it is
        handed to the scheduler (and counted as the scheduler's from then on:
        :meth:`~.lifecycle.Ticket.hand`)."""
        return in_thread(lambda: deltas_then_generation(ticket.hand(stream)),
                         executor=self.executor)


def _error(e: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "error"
    return _error(ApiError(status, f"{request.method} {request.url.path}: {detail}",
                           code="not_found" if status == 404 else None))


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.error("request failed", exc_info=exc)
    return _error(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))


def create_app(spec: Any, config: ServerConfig) -> Starlette:
    """The ASGI application serving ``spec`` under ``config``."""
    return OpenAIServer(spec, config).app
