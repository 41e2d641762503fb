"""``agentspec cache``: inspect and maintain the completion memory (SQL store + faiss indexes).

Every command here except ``search`` (and ``reindex``/``verify`` in :mod:`agentspec.cli.verify`)
imports neither torch nor transformers, so they answer quickly even on large stores.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from agentspec.cli import origins as by_origin
from agentspec.cli.common import (
    APP_SETTINGS,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    FRESH_HINT,
    DbOpt,
    JsonOpt,
    age,
    cache_command,
    confirm,
    console,
    db_url,
    embedder_by_name,
    err_console,
    fail,
    fresh_home,
    index_files,
    open_store,
    parse_duration,
    print_json,
    report,
    set_options,
    short,
    want_json,
)

cache_app = typer.Typer(**APP_SETTINGS, help="Inspect and maintain the completion memory.", no_args_is_help=True)

YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
ScopeOpt = Annotated[str | None, typer.Option("--scope", help="Only this scope.")]


@cache_app.callback()
def _cache(ctx: typer.Context, db: DbOpt = None, json_out: JsonOpt = False) -> None:
    set_options(ctx, db, json_out)


def _totals_table(title: str, rows: dict[str, dict[str, int]], key: str) -> Table:
    table = Table(title=title)
    for col in (key, "rows", "tokens", "bytes", "hits", "accepted"):
        table.add_column(col, justify="left" if col == key else "right")
    for name, t in rows.items():
        table.add_row(name, *(f"{t[k]:,}" for k in ("rows", "tokens", "bytes", "hits",
                                                      "accepted_tokens")))
    return table


def _index_health(store: Any) -> dict[str, Any]:
    """Vectors per persisted index file against the rows the SQL store holds for it."""
    files = index_files(store.url)
    if not files:
        return {"status": "not built", "files": []}
    out = []
    for f in files:
        rows = store.count(scope=f.scope, embedder=f.embedder)
        out.append({"scope": f.scope, "embedder": f.embedder, "dim": f.dim, "path": str(f.path),
                     "index_vectors": f.vectors, "sql_rows": rows, "in_sync": f.vectors == rows})
    ok = all(f["in_sync"] for f in out)
    return {"status": "ok" if ok else "out of sync (agentspec cache reindex)", "files": out}


@cache_app.command("stats")
@cache_command
def stats(ctx: typer.Context) -> None:
    """Rows, tokens, bytes, hits and accepted tokens per scope and model; index health.

    Example: agentspec cache stats --json
    """
    if fresh_home(ctx):  # nothing recorded yet: zeros (an empty store's) and a hint
        from agentspec.stores.sql import SQLStore

        empty = SQLStore("sqlite://")
        try:
            out = empty.stats()
        finally:
            empty.close()
        out["database"] = db_url(ctx)
        out["index"] = {"status": "none yet", "files": []}
        out["hint"] = FRESH_HINT
    else:
        with open_store(ctx) as store:
            out = store.stats()
            out["database"] = store.url
            out["index"] = _index_health(store)
    if want_json(ctx):
        print_json(out)
        return
    if "hint" in out:
        err_console.print(out["hint"], markup=False)
    console.print(f"[bold]{out['database']}[/]: {out['rows']:,} rows, {out['tokens']:,} tokens, "
                  f"{out['bytes']:,} bytes, {out['hits']:,} hits, "
                  f"{out['accepted_tokens']:,} accepted tokens")
    if out["rows"]:
        console.print(_totals_table("per scope", out["scopes"], "scope"))
        console.print(_totals_table("per model fingerprint", out["models"], "model"))
    index = out["index"]
    console.print(f"index: {index['status']}")
    if index["files"]:
        table = Table(title="index files")
        for col in ("scope", "embedder", "index vectors", "sql rows", "in sync"):
            table.add_column(col)
        for f in index["files"]:
            table.add_row(f["scope"], f["embedder"], str(f["index_vectors"]), str(f["sql_rows"]),
                          "yes" if f["in_sync"] else "[red]no[/]")
        console.print(table)


def record_json(r: Any, *, ids: bool = True) -> dict[str, Any]:
    """A record as JSON, without its embedding vector."""
    out = {"id": r.id, "scope": r.scope, "model": r.model, "num_tokens": r.num_tokens,
           "hits": r.hits, "accepted_tokens": r.accepted_tokens, "created_at": r.created_at,
           "last_used_at": r.last_used_at, "embedder": r.embedder,
           "dim": 0 if r.embedding is None else int(r.embedding.size),
           "request_text": r.request_text, "key_text": r.key_text,
           "completion_text": r.completion_text}
    if ids:
        out["completion_ids"] = list(r.completion_ids)
    return out


@cache_app.command("ls")
@cache_command
def ls(ctx: typer.Context, scope: ScopeOpt = None,
       model: Annotated[str | None, typer.Option("--model", help="Only this model fingerprint.")] = None,
       sort: Annotated[str, typer.Option("--sort", help="hits, recent, size or accepted.")] = "recent",
       limit: Annotated[int, typer.Option("--limit", "-n", min=0, help="At most this many.")] = 20) -> None:
    """List records, best first by --sort.

    Example: agentspec cache ls --scope support --sort hits --limit 10
    """
    if sort not in ("hits", "recent", "size", "accepted"):
        fail(f"--sort must be hits, recent, size or accepted, got {sort!r}", EXIT_USAGE)
    with open_store(ctx, fresh_empty=True) as store:
        rows = store.list_records(scope=scope, model=model, sort=sort, limit=limit)
    if want_json(ctx):
        print_json([record_json(r, ids=False) for r in rows])
        return
    table = Table()
    for col in ("id", "scope", "model", "tokens", "hits", "accepted", "last used", "request"):
        table.add_column(col, justify="right" if col in ("id", "tokens", "hits", "accepted") else "left")
    for r in rows:
        table.add_row(str(r.id), r.scope, short(r.model, 28), str(r.num_tokens), str(r.hits),
                      str(r.accepted_tokens), age(r.last_used_at), short(r.request_text, 50))
    console.print(table)


@cache_app.command("show")
@cache_command
def show(ctx: typer.Context, record_id: Annotated[int, typer.Argument(metavar="ID")],
         no_color: Annotated[bool, typer.Option(
             "--no-color", help="Mark each token's origin with [tags] instead of colours "
                                "(the form a pipe gets).")] = False) -> None:
    """Show one record: request, completion, token ids, hits, accepted tokens, times, and
    the completion coloured by where each token came from (memory, prompt lookup, suffix,
    the model itself), its steps marked.

    Example: agentspec cache show 42
    """
    with open_store(ctx) as store:
        r = store.get(record_id)
    if r is None:
        fail(f"no record with id {record_id}", EXIT_NOT_FOUND)
    if want_json(ctx):
        out = record_json(r)
        out["origins"] = None if r.origins is None else by_origin.as_json(r.completion_text,
                                                                           r.origins)
        print_json(out)
        return
    import datetime as dt

    def when(t: float) -> str:
        return f"{dt.datetime.fromtimestamp(t):%Y-%m-%d %H:%M:%S} ({age(t)})"

    table = Table(show_header=False)
    for k, v in (("id", r.id), ("scope", r.scope), ("model", r.model),
                 ("tokens", r.num_tokens), ("hits", r.hits), ("accepted tokens", r.accepted_tokens),
                 ("created", when(r.created_at)), ("last used", when(r.last_used_at)),
                 ("embedder", f"{r.embedder or '-'} (dim {record_json(r)['dim']})")):
        table.add_row(k, str(v))
    console.print(table)
    for title, text in (("request", r.request_text), ("key", r.key_text),
                        ("completion", r.completion_text)):
        console.rule(title)
        console.print(text, markup=False)
    by_origin.show(console, r.completion_text, r.origins,
                   color=not no_color and console.is_terminal and not console.no_color)
    console.rule("completion token ids")
    console.print(str(list(r.completion_ids)), markup=False)


def _pick_embedder(store: Any, scope: str | None, name: str | None) -> tuple[Any, int]:
    """The embedder named by most embedded rows (or ``name``), and rows it cannot search;
    ``(None, 0)`` when no row is embedded and no ``name`` is given."""
    groups = store.embedding_groups(scope)
    per_name: dict[str, int] = {}
    for (_, e, _), n in groups.items():
        per_name[e] = per_name.get(e, 0) + n
    if name is None:
        if not per_name:
            return None, 0
        name = max(per_name, key=lambda e: per_name[e])
    embedder = embedder_by_name(name)
    return embedder, sum(per_name.values()) - per_name.get(embedder.name, 0)


@cache_app.command("search")
@cache_command
def search(ctx: typer.Context, text: str,
           k: Annotated[int, typer.Option("-k", min=1, help="How many results.")] = 5,
           scope: ScopeOpt = None,
           embedder: Annotated[str | None, typer.Option(hidden=True)] = None) -> None:
    """Semantic search: the records whose conversation key is most similar to TEXT.

    Uses the embedder named in the rows (MiniLM by default, which loads torch).

    Example: agentspec cache search "weather in Paris" -k 3 --scope support
    """
    from agentspec.memory.completion import CompletionMemory

    hits: list[Any] = []
    with open_store(ctx, fresh_empty=True) as store:
        emb, skipped = _pick_embedder(store, scope, embedder)
        if emb is None:
            err_console.print("note: no embedded records to search"
                              + (f" in scope {scope!r}" if scope else ""), markup=False)
        else:
            if skipped:
                err_console.print(f"note: {skipped} rows embedded by other embedders are not "
                                  f"searched (searching with {emb.name})")
            memory = CompletionMemory(store, embedder=emb, max_tokens_per_scope=None,
                                      max_tokens_total=None)
            hits = memory.search(text, k=k, scope=scope)
    if want_json(ctx):
        print_json([{"similarity": s, **record_json(r, ids=False)} for r, s in hits])
        return
    table = Table()
    for col in ("similarity", "id", "scope", "model", "request", "completion"):
        table.add_column(col)
    for r, s in hits:
        table.add_row(f"{s:.3f}", str(r.id), r.scope, short(r.model, 24),
                      short(r.request_text, 40), short(r.completion_text, 40))
    console.print(table)


@cache_app.command("rm")
@cache_command
def rm(ctx: typer.Context, ids: Annotated[list[int], typer.Argument(metavar="ID...")],
       yes: YesOpt = False) -> None:
    """Delete records by id (indexes drop them on their next sync).

    Example: agentspec cache rm 12 13 --yes
    """
    with open_store(ctx) as store:
        found = {r.id for r in store.get_many(ids)}
        missing = [i for i in ids if i not in found]
        if missing:
            fail(f"no record with id {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                      if len(missing) > 1 else ""), EXIT_NOT_FOUND)
        confirm(f"Delete {len(found)} record(s) from {store.url}?", yes)
        n = store.delete(sorted(found))
    report(ctx, {"deleted": n, "ids": sorted(found)}, f"deleted {n} record(s)")


@cache_app.command("prune")
@cache_command
def prune(ctx: typer.Context,
          older_than: Annotated[str | None, typer.Option(
              "--older-than", metavar="DURATION", help="Unused for this long: 30s, 15m, 12h, 7d, 2w.")] = None,
          scope: ScopeOpt = None,
          max_tokens: Annotated[int | None, typer.Option(
              "--max-tokens", min=0, help="Then evict least recently used rows down to this many tokens.")] = None,
          dry_run: Annotated[bool, typer.Option("--dry-run", help="Only say what would go.")] = False,
          yes: YesOpt = False) -> None:
    """Delete records unused for a while and/or least recently used ones above a token cap.

    Example: agentspec cache prune --older-than 7d --scope support --dry-run
    """
    if older_than is None and max_tokens is None:
        fail("prune needs --older-than DURATION and/or --max-tokens N", EXIT_USAGE)
    seconds = None if older_than is None else parse_duration(older_than)
    with open_store(ctx) as store:
        victims = store.prune(seconds, scope=scope, max_tokens=max_tokens, dry_run=True)
        if dry_run or not victims:
            report(ctx, {"dry_run": dry_run, "deleted": 0, "ids": victims},
                   f"would delete {len(victims)} record(s)" if dry_run else "nothing to prune")
            return
        confirm(f"Delete {len(victims)} record(s) from {store.url}?", yes)
        deleted = store.prune(seconds, scope=scope, max_tokens=max_tokens)
    report(ctx, {"dry_run": False, "deleted": len(deleted), "ids": deleted},
           f"deleted {len(deleted)} record(s)")


def _count_or_fail(store: Any, message: str, group: str, **where: str) -> int:
    """The store's count of rows ``where``; none: fail with ``message`` and the first ten
    names of ``group`` ("scopes", "models") the store holds."""
    n = store.count(**where)
    if n == 0:
        known = ", ".join(sorted(store.stats()[group])[:10]) or "none"
        fail(f"{message} ({group}: {known})", EXIT_NOT_FOUND)
    return int(n)


@cache_app.command("drop-scope")
@cache_command
def drop_scope(ctx: typer.Context, scope: str, yes: YesOpt = False) -> None:
    """Delete every record of SCOPE.

    Example: agentspec cache drop-scope tenant-42 --yes
    """
    with open_store(ctx) as store:
        n = _count_or_fail(store, f"no records in scope {scope!r}", "scopes", scope=scope)
        confirm(f"Delete all {n} record(s) of scope {scope!r} from {store.url}?", yes)
        deleted = store.drop_scope(scope)
    report(ctx, {"scope": scope, "deleted": deleted},
           f"deleted {deleted} record(s) of scope {scope!r}")


@cache_app.command("relabel")
@cache_command
def relabel(ctx: typer.Context,
            old: Annotated[str, typer.Argument(metavar="OLD", help="The fingerprint the rows have.")],
            new: Annotated[str, typer.Argument(metavar="NEW", help="The model's fingerprint now.")],
            yes: YesOpt = False) -> None:
    """Give the records of fingerprint OLD the fingerprint NEW, for the same model.

    A model's fingerprint changes when agentspec changes how it computes one (earlier releases included the folder the model was loaded from): rows recorded under the old one are then never drafted from. `cache stats` lists the fingerprints in the store (the model's current one once a call has recorded under it; in Python, spec.target.fingerprint). A record that NEW already holds is merged into it.

    Example: agentspec cache relabel smollm2-135m-instruct:d6a8aedd513fd07d smollm2-135m-instruct:056b35893f9ba05f --yes
    """
    if old == new:
        fail(f"OLD and NEW are the same fingerprint, {old!r}", EXIT_USAGE)
    if ":" in old and ":" in new and old.split(":")[0] != new.split(":")[0]:  # name:hash
        fail(f"{old!r} and {new!r} name different models; relabel only joins the fingerprints "
             f"of one model", EXIT_USAGE)
    with open_store(ctx) as store:
        n = _count_or_fail(store, f"no records of model {old!r}", "models", model=old)
        confirm(f"Relabel {n} record(s) of {old} as {new} in {store.url}?", yes)
        moved, merged = store.relabel_model(old, new)
    report(ctx, {"old": old, "new": new, "moved": moved, "merged": merged},
           f"relabelled {moved} record(s); merged {merged} into records {new} already had")


def _register_io() -> None:
    from agentspec.cli import cache_io

    cache_io.register(cache_app)


_register_io()
