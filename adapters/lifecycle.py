"""The service around the OpenAI server: who gets in, how long a request may run, how the
server starts and stops.

- Admission: every generation request (``POST /v1/chat/completions``, ``/v1/completions``)
  gets a :class:`Ticket` at the door. The load is the scheduler's (``Speculator.load``: its
  requests running, waiting for room, and its ``max_batch``), and the requests admitted here
  that have not reached it yet (being read and rendered, or waiting for a worker thread:
  :meth:`Ticket.hand` marks the moment): those fill the batch's free room first, the rest
  wait (:meth:`Lifecycle.load`). With ``max_queue`` set, a request that finds that many
  already waiting is refused with a 429 and a ``Retry-After`` header (the mean duration of
  recent requests, in whole seconds), in OpenAI's error shape.
- Deadlines and departures: a ticket stops its generation when ``request_timeout`` passes
  (504), when the server's grace runs out at shutdown (503), or, for a request not streamed,
  when its client disconnects (polled while it runs; counted as 499, nginx's "client closed
  request"). Stopping closes the Speculator stream in its worker, which frees its sequence at
  its next step, as an abandoned stream does; a stream already answering gets an error event
  and ``[DONE]`` instead.
- Shutdown: the first SIGTERM or SIGINT starts a drain: new generation requests get a 503,
  ``/ready`` answers 503 (``/health`` stays 200: the process is alive), the requests in flight
  run to their end for up to ``grace`` seconds, then the rest are stopped. The server then
  exits, the worker threads end, and the completion memory is closed: its writes behind the
  calls are done, its queue flushed, its index files saved. A second signal exits at once
  (the memory is still closed).
- Start: :func:`check_memory` loads every scope's index and checks it against the store's
  rows (new rows added, deleted ones dropped, an unreadable file rebuilt), so a memory left
  by a killed process is made consistent before the first request, not during it.

Needs ``pip install 'agentspec-llm[serve]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

try:
    import anyio
    import uvicorn
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the OpenAI server needs: pip install 'agentspec-llm[serve]'") from exc

from agentspec.adapters.metrics import ServerMetrics
from agentspec.adapters.openai_protocol import ApiError
from agentspec.errors import StoreError
from agentspec.scheduler import Load
from agentspec.types import Generation

T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]
logger = logging.getLogger("agentspec.serve")
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
PROBES = frozenset({"/health", "/ready", "/metrics"})  # not counted as requests
TICKET = "agentspec.ticket"  # the ASGI scope key of a request's ticket
POLL_S = 0.1  # how often a request not streamed looks for its client
STOP_S = 10.0  # after the grace: how long stopped requests get to reach their next step
DISCONNECTED = 499


@dataclass(frozen=True)
class ServiceConfig:
    """How the service admits, times and stops requests, and what its metrics show.

    Attributes:
        max_queue: requests that may wait beyond the running batch (:meth:`Lifecycle.load`'s
            ``waiting``); one more gets a 429. None: no bound.
        request_timeout: seconds a generation request may take from its admission; past it
            the request is stopped (504). None: no limit.
        grace: seconds the requests in flight get to finish after SIGTERM.
        metrics_public: serve ``/metrics`` without an API key on a server that has keys.
        metrics_scopes: label the request and token metrics with the memory scope.
    """

    max_queue: int | None = None
    request_timeout: float | None = None
    grace: float = 20.0
    metrics_public: bool = False
    metrics_scopes: bool = False

    def __post_init__(self) -> None:
        if self.max_queue is not None and (type(self.max_queue) is not int or self.max_queue < 0):
            raise ValueError(f"max_queue must be an integer >= 0 or None, got {self.max_queue!r}")
        for name, value in (("request_timeout", self.request_timeout), ("grace", self.grace)):
            if value is not None and not (isinstance(value, int | float) and 0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


class Ticket:
    """One admitted generation request: when it came in, its deadline, and why it was
    stopped (None while it runs)."""

    def __init__(self, deadline_s: float | None = None) -> None:
        self.admitted = time.monotonic()
        self.deadline = None if deadline_s is None else self.admitted + deadline_s
        self.error: ApiError | None = None
        self.reason: str | None = None
        self.scope: str | None = None
        self.handed = False  # its generation asked of the scheduler (:meth:`hand`)
        self._stopped = asyncio.Event()

    def hand(self, stream: T) -> T:
        """``stream``, the request's Speculator stream, as its worker thread is about to ask
        it for its first step (which hands it to the scheduler): from then on the request is
        counted in the scheduler's load, not as one still at the door."""
        self.handed = True
        return stream

    def stop(self, error: ApiError, reason: str) -> None:
        """Stop the request (on the event loop); the first reason given is the one kept."""
        if self.error is None:
            self.error, self.reason = error, reason
            self._stopped.set()

    async def guard(self, items: AsyncIterator[T], request: Request | None = None
                    ) -> AsyncGenerator[T, None]:
        """``items`` until they end or this ticket is stopped: by its deadline, by the
        server's shutdown, or (given ``request``) by its client leaving. Then ``items`` is
        closed (a stream in a worker thread asks for nothing more and is closed there) and
        the stop's ApiError raised."""
        stopped = asyncio.ensure_future(self._stopped.wait())
        pending: asyncio.Future[T] | None = None
        polled = time.monotonic()  # when the client was last looked for

        async def following() -> T:
            return await items.__anext__()

        try:
            while True:
                pending = asyncio.ensure_future(following())
                while True:
                    await asyncio.wait({pending, stopped}, timeout=self._wait_s(request),
                                       return_when=asyncio.FIRST_COMPLETED)
                    # Checked by the clock, not only while items are slow: a fast stream
                    # must notice its client leaving too.
                    if request is not None and time.monotonic() - polled >= POLL_S:
                        polled = time.monotonic()
                        if await request.is_disconnected():
                            self.stop(ApiError(DISCONNECTED, "the client disconnected",
                                               code="client_closed"), "disconnect")
                    self._check_deadline()
                    if self.error is not None:
                        raise self.error
                    if pending.done():
                        break
                try:
                    item = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                yield item
        finally:
            stopped.cancel()
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending
            await items.aclose()  # type: ignore[attr-defined]

    async def last(self, items: AsyncIterator[T], request: Request | None = None) -> T | None:
        """The last of ``items`` under :meth:`guard` (a whole generation's Generation)."""
        found: T | None = None
        async with contextlib.aclosing(self.guard(items, request)) as guarded:
            async for item in guarded:
                found = item
        return found

    def _wait_s(self, request: Request | None) -> float | None:
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        if request is None:
            return left
        return POLL_S if left is None else min(left, POLL_S)

    def _check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.stop(ApiError(504, f"the request took longer than this server's request "
                                    f"timeout of {self.deadline - self.admitted:g} s; ask for "
                                    f"fewer max_tokens, or raise serve --request-timeout",
                               type="server_error", code="request_timeout"), "timeout")


class Lifecycle:
    """Admission, drain and metrics of one server (see the module docstring).

    Args:
        config: the service's settings.
        load: the Speculator's load now (``Speculator.load``: its scheduler's).
        memory: the Speculator's memory, for the metrics (None: none).
    """

    def __init__(self, config: ServiceConfig, *, load: Callable[[], Load],
                 memory: Any = None) -> None:
        self.config, self._scheduler_load = config, load
        self.tickets: set[Ticket] = set()  # the generation requests in flight
        self.draining_since: float | None = None
        self.stopped_at: float | None = None
        self.mean_s = 1.0  # recent requests' duration (an exponential average)
        self.metrics = ServerMetrics(scopes=config.metrics_scopes, load=self.counts,
                                     memory=memory)

    def load(self) -> Load:
        """The generation requests ``running`` (the scheduler's) and ``waiting``: the
        scheduler's waiting ones, and those admitted here but not handed to it yet that find
        no free room in its batch. Safe from any thread."""
        return self._ahead()[0]

    def counts(self) -> tuple[int, int]:
        """``(running, waiting)`` of :meth:`load`, for the metrics and the dashboard."""
        load = self.load()
        return load.running, load.waiting

    def _ahead(self) -> tuple[Load, int]:
        """The load, and the requests a new one would find ahead of it for the batch: the
        scheduler's, and those admitted here and not handed to it yet (not counted by it)."""
        scheduler = self._scheduler_load()
        # A snapshot in one call (the set changes on the event loop; this may run elsewhere).
        at_door = sum(not ticket.handed for ticket in tuple(self.tickets))
        ahead = scheduler.running + scheduler.waiting + at_door
        waiting = max(scheduler.waiting, ahead - scheduler.max_batch)
        return Load(scheduler.running, waiting, scheduler.max_batch), ahead

    def admit(self) -> Ticket:
        """A ticket for a new generation request.

        Raises:
            ApiError: 503 while draining, 429 when ``max_queue`` requests wait already (a
                request that would find room in the batch is never refused).
        """
        if self.draining_since is not None:
            raise ApiError(503, "the server is shutting down; retry on another replica or "
                                "after its restart", type="server_error", code="shutting_down")
        if self.config.max_queue is None:
            return self._ticket()
        load, ahead = self._ahead()
        waiting, full = load.waiting, ahead >= load.max_batch
        if full and waiting >= self.config.max_queue:
            raise ApiError(429, f"{waiting} requests are waiting already, this server's "
                                f"limit (serve --max-queue {self.config.max_queue}); retry "
                                f"after the Retry-After header's seconds",
                           type="rate_limit_error", code="queue_full")
        return self._ticket()

    def _ticket(self) -> Ticket:
        ticket = Ticket(self.config.request_timeout)
        self.tickets.add(ticket)
        return ticket

    def release(self, ticket: Ticket) -> None:
        self.tickets.discard(ticket)
        self.mean_s += 0.2 * (time.monotonic() - ticket.admitted - self.mean_s)
        if ticket.reason is not None:
            self.metrics.stopped.labels(reason=ticket.reason).inc()

    def finished(self, ticket: Ticket, gen: Generation, scope: str) -> None:
        """Count a generation that ran to its end (its ticket's wait before it started
        taken from the generation's own duration)."""
        ticket.scope = scope
        waited = max(0.0, time.monotonic() - gen.stats.seconds - ticket.admitted)
        self.metrics.generation(gen, scope, waited=waited)

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """``app`` behind the door: tickets for generation requests, every request counted
        (by ``app``'s route, or ``other``: a client cannot make up labels)."""
        known = {path for route in getattr(app, "routes", ())
                 if isinstance(path := getattr(route, "path", None), str)}
        return _Door(app, self, known - PROBES)

    def metrics_page(self, authorize: Callable[[Request], object]) -> Handler:
        """The ``GET /metrics`` endpoint. ``authorize`` raises ApiError for a request
        without a valid key; it is skipped with ``metrics_public`` (Prometheus scrapers
        usually carry no key)."""

        async def page(request: Request) -> Response:
            if not self.config.metrics_public:
                try:
                    authorize(request)
                except ApiError as e:
                    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
                    return JSONResponse(e.body(), status_code=e.status, headers=headers)
            body, kind = await anyio.to_thread.run_sync(self.metrics.render)
            return Response(body, media_type=kind)

        return page

    async def ready(self, request: Request) -> Response:
        """``GET /ready``: 200 while the server takes requests (its model loaded and warmed
        up before it listens), 503 once it drains."""
        if self.draining_since is not None:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ready"})

    def begin_drain(self) -> None:
        """Stop admitting (safe in a signal handler: it only sets a time)."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()

    def drained(self) -> bool:
        """On the event loop, while draining: True once no request is in flight. When the
        grace has passed, the requests left are stopped (503) and given :data:`STOP_S` to
        reach their next step."""
        if not self.tickets:
            return True
        assert self.draining_since is not None
        now = time.monotonic()
        if self.stopped_at is None and now >= self.draining_since + self.config.grace:
            logger.warning("stopping %d request(s) still running after the %g s grace",
                           len(self.tickets), self.config.grace)
            for ticket in list(self.tickets):
                ticket.stop(ApiError(503, "the server shut down before this request ended",
                                     type="server_error", code="shutting_down"), "shutdown")
            self.stopped_at = now
        return self.stopped_at is not None and now >= self.stopped_at + STOP_S


class _Door:
    """The ASGI middleware of :meth:`Lifecycle.wrap`."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, known: set[str]) -> None:
        self.app, self.lifecycle, self.known = app, lifecycle, known

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        status = 500
        path = scope["path"]

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        ticket = None
        try:
            if scope["method"] == "POST" and path in GENERATION_PATHS:
                try:
                    ticket = scope[TICKET] = self.lifecycle.admit()
                except ApiError as e:
                    retry = max(1, min(60, round(self.lifecycle.mean_s)))
                    await JSONResponse(e.body(), status_code=e.status,
                                       headers={"Retry-After": str(retry)})(scope, receive, sending)
                    return
            await self.app(scope, receive, sending)
        finally:
            seconds = None
            if ticket is not None:
                self.lifecycle.release(ticket)
                seconds = time.monotonic() - ticket.admitted
            endpoint = path if path in self.known else "other"
            self.lifecycle.metrics.request(endpoint, status, ticket and ticket.scope, seconds)


def ticket_of(request: Request) -> Ticket:
    """The request's ticket (one without limits where the app runs without the door)."""
    ticket = request.scope.get(TICKET)
    return ticket if isinstance(ticket, Ticket) else Ticket()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT drains (:class:`Lifecycle`) instead of
    closing the socket at once, and which does not re-raise the signal after (the process
    exits 0 once the memory is closed)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.draining_since is None:
            logger.warning("signal %d: draining (%d request(s) in flight, %g s grace)", sig,
                           len(self.lifecycle.tickets), self.lifecycle.config.grace)
            self.lifecycle.begin_drain()
        else:  # a second signal: stop now
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        stop = await super().on_tick(counter)
        if self.lifecycle.draining_since is not None and not self.should_exit:
            return self.lifecycle.drained()
        return stop


def serve_until_stopped(app: ASGIApp, sock: socket.socket, lifecycle: Lifecycle, *,
                        log_level: str = "info") -> None:
    """Serve ``app`` on the listening ``sock`` until a signal's drain ends."""
    config = uvicorn.Config(app, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=int(STOP_S))
    DrainingServer(config, lifecycle).run(sockets=[sock])


def shut_down(executor: Executor, memory: Any) -> None:
    """After serving: let the worker threads end (a stopped stream ends at its next step),
    then close the memory (its writes behind the calls, its queue, its index files)."""
    executor.shutdown(wait=True, cancel_futures=True)
    close = getattr(memory, "close", None)
    if callable(close):
        close()


def check_memory(memory: Any) -> dict[str, int]:
    """Load every scope's index now and make it hold exactly the store's rows; returns the
    vectors per scope.

    A search over every scope syncs each one's index: its saved file loaded (an unreadable
    one replaced), the rows written since added, and the store's row count compared, which
    reconciles the two id sets when they differ. A scope whose index still disagrees with
    the store's count after that is rebuilt from the store's rows.
    """
    if not all(hasattr(memory, name) for name in ("search", "prefetch", "rebuild", "store")):
        return {}  # no memory, or a user's own
    text = "agentspec index check"
    memory.prefetch(text)  # embedded on the memory's worker thread, as a request's key is
    try:
        memory.search(text, k=1)
        name, sizes = memory.embedder.name, dict(memory.stats()["indexes"])
        for scope, size in sorted(sizes.items()):
            rows = int(memory.store.count(scope=scope, embedder=name))
            if rows != size:
                logger.warning("memory index of scope %r holds %d vectors for %d rows; "
                               "rebuilt from the store", scope, size, rows)
                sizes[scope] = memory.rebuild(scope)
    except StoreError as e:  # an accelerator: the server runs on, its memory rides it out
        logger.warning("the memory's indexes were not checked at start: %s", e)
        return {}
    return sizes

