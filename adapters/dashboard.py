"""The server's page: ``GET /`` shows what the drafts did, ``GET /v1/agentspec/dashboard`` is
its data. Needs ``pip install 'agentspec-llm[serve]'``.

The page (``dashboard.html`` beside this module: HTML, CSS and script in one file, nothing
fetched from elsewhere, so it works offline) polls the data every two seconds and draws:

- acceptance by draft source over time (accepted / drafted tokens of the requests finished in
  each interval), tokens per second by origin, and the server's queue (running, waiting);
- the completion memory per scope: rows, tokens, hits;
- the last requests of the caller's scopes, each answer's text coloured by where each token
  came from (the memory, prompt lookup, suffix matches, the model itself, ...), its steps
  marked, and a legend with each origin's token count.

Access: the page itself holds no data; the data endpoint is behind the same keys as the API,
and a key sees only its own scopes (a key without scopes: the server's allow-list, or every
scope). The page takes the key from its address' fragment (``/#key=...``: a fragment is never
sent to the server, so no access log holds it) or from its key field, keeps it in the tab's
``sessionStorage`` and sends it as ``Authorization: Bearer``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

try:
    import anyio
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the server's page needs: pip install 'agentspec-llm[serve]'") from exc

from agentspec.adapters.openai_protocol import ApiError
from agentspec.text import origin_text
from agentspec.types import Generation

BUCKET_S = 2.0  # the chart's interval, the page's poll
WINDOW_S = 300.0  # the chart's span
KEEP = 20  # requests kept per scope, and shown per page
MAX_SCOPES = 64  # scopes followed at once (the least recently active are forgotten)
HEADERS = {"Cache-Control": "no-store", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
           "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                                      "style-src 'unsafe-inline'; connect-src 'self'; img-src data:"}


@dataclass
class Bucket:
    """What the requests of one scope finished within one interval added up to."""

    start: float
    tokens: int = 0
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    origins: dict[str, int] = field(default_factory=dict)


@dataclass
class Answer:
    """One finished request as the page shows it; ``pieces`` are worked out when first
    shown (a decode of its tokens, in a worker thread)."""

    id: str
    scope: str
    endpoint: str
    finished: float
    gen: Generation
    pieces: list[dict[str, Any]] | None = None


@dataclass
class _Scope:
    answers: deque[Answer] = field(default_factory=lambda: deque(maxlen=KEEP))
    buckets: deque[Bucket] = field(default_factory=lambda: deque(maxlen=int(WINDOW_S / BUCKET_S)))


class Dashboard:
    """The page and its data for one server.

    Args:
        spec: the Speculator (its tokenizer cuts answers by origin; its memory's figures).
        authorize: the request's key, or raises ApiError (401) without a valid one.
        scopes_for: the scopes a key may see; None: every scope.
        load: ``(running, waiting)`` requests now.
    """

    def __init__(self, spec: Any, *, authorize: Callable[[Request], str | None],
                 scopes_for: Callable[[str | None], frozenset[str] | None],
                 load: Callable[[], tuple[int, int]]) -> None:
        self.spec, self.authorize, self.scopes_for, self.load = spec, authorize, scopes_for, load
        self._scopes: OrderedDict[str, _Scope] = OrderedDict()
        self._html: str | None = None

    def finished(self, answer_id: str, gen: Generation, scope: str, endpoint: str) -> None:
        """Keep a finished request (on the event loop: no I/O, no decoding here)."""
        state = self._scopes.get(scope)
        if state is None:
            state = self._scopes[scope] = _Scope()
            while len(self._scopes) > MAX_SCOPES:
                self._scopes.popitem(last=False)
        self._scopes.move_to_end(scope)
        now = time.time()
        state.answers.append(Answer(answer_id, scope, endpoint, now, replace(gen, logprobs=None)))
        start = now - now % BUCKET_S
        if not state.buckets or state.buckets[-1].start != start:
            state.buckets.append(Bucket(start))
        bucket, stats = state.buckets[-1], gen.stats
        bucket.tokens += stats.new_tokens
        for into, add in ((bucket.drafted, stats.drafted), (bucket.accepted, stats.accepted),
                          (bucket.origins, gen.origins.counts() if gen.origins else {})):
            for name, n in add.items():
                into[name] = into.get(name, 0) + n

    async def page(self, request: Request) -> Response:
        """``GET /``: the page (no data in it; its script asks for the data with the key)."""
        if self._html is None:
            self._html = resources.files("agentspec.adapters").joinpath(
                "dashboard.html").read_text(encoding="utf-8")
        return HTMLResponse(self._html, headers=HEADERS)

    async def data(self, request: Request) -> Response:
        """``GET /v1/agentspec/dashboard``: the page's figures for the key's scopes."""
        try:
            key = self.authorize(request)
        except ApiError as e:
            headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
            return JSONResponse(e.body(), status_code=e.status, headers=headers)
        visible = self.scopes_for(key)
        # Taken on the event loop (where finished() writes), worked on in a thread.
        shown = {name: (list(s.answers), list(s.buckets)) for name, s in self._scopes.items()
                 if visible is None or name in visible}
        body = await anyio.to_thread.run_sync(self._body, visible, shown)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    def _body(self, visible: frozenset[str] | None,
              shown: dict[str, tuple[list[Answer], list[Bucket]]]) -> dict[str, Any]:
        running, waiting = self.load()
        answers = sorted((a for kept, _ in shown.values() for a in kept),
                         key=lambda a: a.finished, reverse=True)[:KEEP]
        return {"now": time.time(), "bucket_s": BUCKET_S,
                "scopes": None if visible is None else sorted(visible),
                "queue": {"running": running, "waiting": waiting},
                "series": _series([b for _, buckets in shown.values() for b in buckets]),
                "memory": self._memory(visible),
                "requests": [self._answer(a) for a in answers]}

    def _answer(self, answer: Answer) -> dict[str, Any]:
        gen = answer.gen
        if answer.pieces is None:
            answer.pieces = self._pieces(gen)
        return {"id": answer.id, "scope": answer.scope, "endpoint": answer.endpoint,
                "finished": answer.finished, "finish_reason": gen.finish_reason,
                "text": gen.text, "stats": gen.stats.as_dict(),
                "origins": None if gen.origins is None else gen.origins.counts(),
                "pieces": answer.pieces}

    def _pieces(self, gen: Generation) -> list[dict[str, Any]]:
        """The answer's text cut into runs of one origin within one step."""
        origins = gen.origins
        if origins is None:  # not a Speculator's generation: the text, of unknown origin
            return [{"step": 0, "source": "unknown", "tokens": len(gen.token_ids),
                     "text": gen.text}]
        if origins.text_ends is None:
            origins = origin_text(self.spec.tokenizer, gen.token_ids, origins, gen.text)
        return [{"step": step, "source": source, "tokens": n, "text": piece}
                for step, source, n, piece in origins.pieces(gen.text)]

    def _memory(self, visible: frozenset[str] | None) -> list[dict[str, Any]] | None:
        """Rows, tokens, hits and accepted tokens per visible scope (None: no memory)."""
        memory = getattr(self.spec, "memory", None)
        if memory is None or not callable(getattr(memory, "stats", None)):
            return None
        try:
            scopes = memory.stats().get("scopes", {})
        except Exception:  # noqa: BLE001 - the page shows what it can
            return None
        return [{"scope": name, "rows": row.get("rows", 0), "tokens": row.get("tokens", 0),
                 "hits": row.get("hits", 0), "accepted_tokens": row.get("accepted_tokens", 0)}
                for name, row in sorted(scopes.items()) if visible is None or name in visible]


def _series(buckets: list[Bucket]) -> list[dict[str, Any]]:
    """The buckets of every shown scope added up per interval, oldest first, within the
    chart's span."""
    cutoff = time.time() - WINDOW_S
    merged: dict[float, Bucket] = {}
    for b in buckets:
        if b.start < cutoff:
            continue
        into = merged.setdefault(b.start, Bucket(b.start))
        into.tokens += b.tokens
        for mine, theirs in ((into.drafted, b.drafted), (into.accepted, b.accepted),
                             (into.origins, b.origins)):
            for name, n in theirs.items():
                mine[name] = mine.get(name, 0) + n
    return [{"t": b.start, "tokens": b.tokens, "drafted": b.drafted, "accepted": b.accepted,
             "origins": b.origins} for _, b in sorted(merged.items())]

