"""``agentspec cache export|import|reindex|verify``: move, rebuild and check the memory.

Export writes one JSON object per record (JSON Lines): every field, token ids as a list, the
embedding as base64 of little-endian float32 (``embedding_b64``; import also takes a plain
``embedding`` list), the tokens' origins as their JSON object (or null). Floats go through
``repr``, so times round-trip exactly. No pickle.
"""

from __future__ import annotations

import base64
import binascii
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Annotated, Any

import numpy as np
import typer

from agentspec.cli.common import (
    EXIT_USAGE,
    cache_command,
    confirm,
    err_console,
    fail,
    open_store,
    print_json,
    progress,
    report,
    want_json,
)
from agentspec.types import Origins, Record

_BATCH = 1000
_FIELDS = ("scope", "model", "request_text", "key_text", "completion_text")
_COUNTERS = ("hits", "accepted_tokens")
_TIMES = ("created_at", "last_used_at")


def to_line(r: Record) -> str:
    """One record as a JSON line (no trailing newline)."""
    emb = None if r.embedding is None else np.asarray(r.embedding, "<f4")
    obj = {"id": r.id, **{f: getattr(r, f) for f in _FIELDS},
           "completion_ids": list(r.completion_ids), "embedder": r.embedder,
           "dim": 0 if emb is None else int(emb.size),
           "embedding_b64": None if emb is None else base64.b64encode(emb.tobytes()).decode(),
           **{f: getattr(r, f) for f in _TIMES + _COUNTERS},
           "origins": None if r.origins is None else json.loads(r.origins.as_json())}
    return json.dumps(obj, ensure_ascii=False)


def _origins(obj: dict[str, Any], tokens: int) -> Origins | None:
    """The exported origins (Origins.as_json's object), or None without them."""
    raw = obj.get("origins")
    if raw is None:
        return None
    origins = Origins.from_json(json.dumps(raw))
    if len(origins.sources) != tokens:
        raise ValueError(f"origins name {len(origins.sources)} tokens for {tokens} completion ids")
    return origins


def _embedding(obj: dict[str, Any]) -> np.ndarray | None:
    raw, listed = obj.get("embedding_b64"), obj.get("embedding")
    if raw is not None:
        if not isinstance(raw, str):
            raise ValueError(f"embedding_b64 must be a base64 string, got {type(raw).__name__}")
        try:
            data = base64.b64decode(raw, validate=True)
        except binascii.Error as e:
            raise ValueError(f"embedding_b64 is not base64: {e}") from None
        if len(data) % 4:
            raise ValueError(f"embedding_b64 holds {len(data)} bytes, not a float32 array")
        vec = np.frombuffer(data, "<f4").astype(np.float32)
    elif listed is not None:
        if not isinstance(listed, list) or not all(
                isinstance(x, int | float) and not isinstance(x, bool) for x in listed):
            raise ValueError("embedding must be a list of numbers")
        vec = np.asarray(listed, np.float32)
    else:
        return None
    if "dim" in obj and obj["dim"] != vec.size:
        raise ValueError(f"dim is {obj['dim']!r} but the embedding has {vec.size} values")
    if not vec.size or not np.all(np.isfinite(vec)):
        raise ValueError("embedding must be non-empty and finite")
    return vec


def from_line(line: str) -> Record:
    """Parse and validate one exported line; ValueError names what is wrong."""
    from agentspec.stores.memory_store import check_record

    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in (*_FIELDS, "completion_ids") if f not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    for f in (*_FIELDS, "embedder"):
        if not isinstance(obj.get(f, ""), str):
            raise ValueError(f"{f} must be a string, got {obj[f]!r:.40}")
    ids = obj["completion_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"completion_ids must be a list of integers, got {ids!r:.60}")
    for f in _COUNTERS:
        v = obj.get(f, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{f} must be an integer >= 0, got {v!r}")
    for f in _TIMES:
        v = obj.get(f, 0.0)
        if not isinstance(v, int | float) or isinstance(v, bool) or not v >= 0:
            raise ValueError(f"{f} must be a Unix time >= 0, got {v!r}")
    emb = _embedding(obj)
    record = Record(**{f: obj[f] for f in _FIELDS}, completion_ids=tuple(ids), embedding=emb,
                    embedder=obj.get("embedder", "") if emb is not None else "",
                    created_at=float(obj.get("created_at", 0.0)),
                    last_used_at=float(obj.get("last_used_at", 0.0)),
                    hits=int(obj.get("hits", 0)), accepted_tokens=int(obj.get("accepted_tokens", 0)),
                    origins=_origins(obj, len(ids)))
    check_record(record)
    return record


@contextmanager
def _output(file: str) -> Iterator[IO[str]]:
    if file == "-":
        yield sys.stdout
        return
    try:
        with open(file, "w", encoding="utf-8") as f:
            yield f
    except OSError as e:
        fail(f"cannot write {file}: {e.strerror}")


@cache_command
def export(ctx: typer.Context, file: Annotated[str, typer.Argument(
        metavar="FILE.jsonl", help="Output file; - for stdout.")],
        scope: Annotated[str | None, typer.Option("--scope", help="Only this scope.")] = None) -> None:
    """Write every record (all fields, token ids, embeddings) as JSON Lines.

    With --json the summary is a JSON object: on stdout, or on stderr when FILE is - (stdout
    then holds the records).

    Example: agentspec cache export backup.jsonl
    """
    n = 0
    with open_store(ctx) as store, _output(file) as out, progress() as bar:
        task = bar.add_task("export", total=store.count(scope=scope))
        for r in store.iter(scope=scope):
            out.write(to_line(r) + "\n")
            n += 1
            bar.advance(task)
    summary = {"exported": n, "file": file}
    if not want_json(ctx):
        err_console.print(f"exported {n} record(s) to {file}", markup=False)
    elif file == "-":  # stdout holds the records
        sys.stderr.write(json.dumps(summary) + "\n")
    else:
        print_json(summary)


def _read_lines(file: Path) -> tuple[list[Record], list[tuple[int, str]]]:
    good, bad = [], []
    try:
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    good.append(from_line(line))
                except (ValueError, TypeError) as e:
                    bad.append((number, str(e)))
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read {file}: {e}", EXIT_USAGE)
    return good, bad


@cache_command
def import_(ctx: typer.Context, file: Annotated[Path, typer.Argument(metavar="FILE.jsonl")],
            yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False) -> None:
    """Add the records of an exported file; bad lines are reported by number and skipped.

    Records already present (same scope, model, key and completion) are skipped. Exits 2 when
    some lines were bad (the good ones are imported).

    Example: agentspec cache import backup.jsonl --yes
    """
    good, bad = _read_lines(file)
    for number, reason in bad[:20]:
        err_console.print(f"{file}:{number}: {reason}", markup=False)
    if len(bad) > 20:
        err_console.print(f"... and {len(bad) - 20} more bad line(s)")
    added = 0
    if good:
        with open_store(ctx, create=True) as store:
            confirm(f"Import {len(good)} record(s) into {store.url}?", yes)
            with progress() as bar:
                task = bar.add_task("import", total=len(good))
                for i in range(0, len(good), _BATCH):
                    added += store.add_many(good[i : i + _BATCH])
                    bar.advance(task, len(good[i : i + _BATCH]))
    report(ctx, {"imported": added, "already_present": len(good) - added,
                 "bad_lines": [{"line": n, "error": e} for n, e in bad]},
           f"imported {added} record(s), {len(good) - added} already present, "
           f"{len(bad)} bad line(s)")
    if bad:
        raise typer.Exit(EXIT_USAGE)


def register(app: typer.Typer) -> None:
    """Add these commands to the ``cache`` app."""
    from agentspec.cli.verify import reindex, verify

    app.command("export")(export)
    app.command("import")(import_)
    app.command("reindex")(reindex)
    app.command("verify")(verify)

