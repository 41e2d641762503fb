"""The SQL store's bulk upkeep, each on a connection inside the caller's transaction.

Rows are deleted by age (``prune``) or least recently used first until scopes and the store
fit their token caps (``evict_to_caps``: the memory's caps; ``prune``'s ``max_tokens``); a model
fingerprint's rows are relabelled, a row whose twin the new fingerprint already holds merged
into it (``relabel``). :class:`~agentspec.stores.sql.SQLStore` checks the arguments and opens
the transactions.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Connection, bindparam, delete, func, select, update

from agentspec.stores.memory_store import content_hash, lru_victims
from agentspec.stores.sql_schema import CHUNK, filters, records


def delete_ids(conn: Connection, ids: list[int]) -> int:
    """Delete the rows of ``ids``; returns how many there were."""
    n = 0
    for i in range(0, len(ids), CHUNK):
        n += conn.execute(delete(records).where(records.c.id.in_(ids[i : i + CHUNK]))).rowcount
    return n


def token_total(conn: Connection, scope: str | None) -> int:
    """Completion tokens stored in ``scope`` (all scopes when None)."""
    stmt = select(func.coalesce(func.sum(records.c.num_tokens), 0)).where(*filters(scope))
    return int(conn.execute(stmt).scalar_one())


def lru(conn: Connection, scope: str | None, excess: int,
        skip: set[int]) -> tuple[list[int], int]:
    """Least recently used ids of ``scope`` (all when None) freeing ``excess`` tokens."""
    if excess <= 0:
        return [], 0
    stmt = (select(records.c.id, records.c.num_tokens).where(*filters(scope))
            .order_by(records.c.last_used_at, records.c.id))
    result = conn.execute(stmt)
    try:
        return lru_victims(((i, n) for i, n in result if i not in skip), excess)
    finally:
        result.close()


def prune(conn: Connection, older_than_s: float | None, scope: str | None,
          max_tokens: int | None, *, dry_run: bool) -> list[int]:
    """Delete rows unused for ``older_than_s`` seconds, then least recently used rows until
    ``scope`` (all scopes when None) holds at most ``max_tokens`` tokens; returns their ids
    (those that would be deleted, when ``dry_run``)."""
    old: list[tuple[int, int]] = []
    if older_than_s is not None:
        stmt = select(records.c.id, records.c.num_tokens).where(
            records.c.last_used_at < time.time() - older_than_s, *filters(scope))
        old = [(int(i), int(n)) for i, n in conn.execute(stmt)]
    victims = [i for i, _ in old]
    if max_tokens is not None:
        total = token_total(conn, scope) - sum(n for _, n in old)
        victims += lru(conn, scope, total - max_tokens, set(victims))[0]
    if not dry_run:
        delete_ids(conn, victims)
    return victims


def evict_to_caps(conn: Connection, max_tokens_per_scope: int | None,
                  max_tokens_total: int | None, scope: str | None) -> list[int]:
    """Delete least recently used rows until every scope (or only ``scope``) holds at most
    ``max_tokens_per_scope`` tokens and the store at most ``max_tokens_total``; returns the
    deleted ids."""
    victims: list[int] = []
    freed = 0
    if max_tokens_per_scope is not None:
        total = func.sum(records.c.num_tokens)
        stmt = (select(records.c.scope, total).where(*filters(scope))
                .group_by(records.c.scope).having(total > max_tokens_per_scope)
                .order_by(records.c.scope))
        for s, tokens in conn.execute(stmt).all():
            ids, n = lru(conn, s, int(tokens) - max_tokens_per_scope, set())
            victims += ids
            freed += n
    if max_tokens_total is not None:
        excess = token_total(conn, None) - freed - max_tokens_total
        victims += lru(conn, None, excess, set(victims))[0]
    delete_ids(conn, victims)
    return victims


def relabel(conn: Connection, old: str, new: str) -> tuple[int, int]:
    """Give every record of model fingerprint ``old`` the fingerprint ``new``; a record that
    ``new`` already holds is merged into it. Returns ``(moved, merged)`` record counts."""
    c = records.c
    rows = conn.execute(select(c.id, c.scope, c.model, c.key_text, c.completion_text,
                               c.hits, c.accepted_tokens, c.last_used_at)
                        .where(c.model == old).order_by(c.id)).all()
    hashes = {r.id: content_hash(r, model=new) for r in rows}  # type: ignore[arg-type]
    twins: dict[str, Any] = {}
    wanted = sorted(set(hashes.values()))
    for i in range(0, len(wanted), CHUNK):
        twins.update((t.content_hash, t) for t in conn.execute(
            select(c.id, c.content_hash, c.last_used_at)
            .where(c.content_hash.in_(wanted[i : i + CHUNK]))))
    moves = [{"rid": r.id, "h": hashes[r.id]} for r in rows if hashes[r.id] not in twins]
    merges = [{"rid": twins[hashes[r.id]].id, "more_hits": r.hits,
               "more_accepted": r.accepted_tokens,
               "used": max(r.last_used_at, twins[hashes[r.id]].last_used_at)}
              for r in rows if hashes[r.id] in twins]
    if moves:
        conn.execute(update(records).where(c.id == bindparam("rid"))
                     .values(model=new, content_hash=bindparam("h")), moves)
    if merges:
        conn.execute(update(records).where(c.id == bindparam("rid"))
                     .values(hits=c.hits + bindparam("more_hits"),
                             accepted_tokens=c.accepted_tokens + bindparam("more_accepted"),
                             last_used_at=bindparam("used")), merges)
        delete_ids(conn, [r.id for r in rows if hashes[r.id] in twins])
    return len(moves), len(merges)
