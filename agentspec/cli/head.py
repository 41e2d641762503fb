"""``agentspec head train`` and ``agentspec head stats``: the recurrent draft head.

``train`` replays a scope's stored completions through the target and distils a head
(:mod:`agentspec.drafters.head_train`); the file goes to
``$AGENTSPEC_HOME/heads/<model fingerprint>/<scope>.safetensors``, written atomically, so a
running agent keeps drafting with the old head until the new one is complete, then picks it
up at its next call. Retraining starts from the existing head's weights. ``stats`` reads the
files' metadata only (no torch, no model).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from agentspec.cli.common import (
    APP_SETTINGS,
    cache_command,
    console,
    fail,
    open_store,
    print_json,
    progress,
    report,
    want_json,
)

head_app = typer.Typer(**APP_SETTINGS, help="Train and inspect the recurrent draft head.", no_args_is_help=True)

ModelOpt = Annotated[str, typer.Option("--model", help="Packaged name, model folder, .gguf file or hub id (org/name).")]


def _scopes(store: Any, fingerprint: str, scope: str | None) -> list[str]:
    """The scopes with completions of the model (``scope`` alone when given)."""
    scopes = [s for s in sorted(store.stats().get("scopes", {}))
              if store.count(scope=s, model=fingerprint) > 0]
    if scope is not None:
        if scope not in scopes:
            fail(f"no completions of model {fingerprint} in scope {scope!r} (scopes with some: "
                 f"{', '.join(scopes) or 'none'})")
        return [scope]
    if not scopes:
        fail(f"no completions of model {fingerprint} in {getattr(store, 'url', 'the memory')}")
    return scopes


@head_app.command("train")
@cache_command
def train(ctx: typer.Context,
          scope: Annotated[str | None, typer.Option(
              "--scope", help="Train this scope's head; default every scope of the model.")] = None,
          model: ModelOpt = "smollm2-135m-instruct",
          epochs: Annotated[int, typer.Option(
              "--epochs", min=1, help="Passes over the training positions (cut at --max-steps).")] = 8,
          max_steps: Annotated[int, typer.Option(
              "--max-steps", min=1, help="Optimiser steps at most (64 positions each).")] = 1500,
          depth: Annotated[int, typer.Option("--depth", min=1, max=16)] = 6,
          limit: Annotated[int | None, typer.Option(
              "--limit", min=1, help="Train on the newest N completions only.")] = None,
          fresh: Annotated[bool, typer.Option(
              "--fresh", help="Start from random weights, not the existing head's.")] = False,
          ) -> None:
    """Distil a draft head from the memory's completions (per scope), then save it.

    Example: agentspec head train --scope bfcl-GorillaFileSystem
    """
    from agentspec.drafters.head import head_path, load_head, save_head
    from agentspec.drafters.head_rows import load_rows
    from agentspec.drafters.head_train import TrainConfig, train_head
    from agentspec.engine.load import load_target

    target = load_target(model, device="cpu")
    fingerprint = target.fingerprint
    summaries = []
    with open_store(ctx) as store:
        for name in _scopes(store, fingerprint, scope):
            records = list(store.iter(scope=name, model=fingerprint))
            if limit is not None:
                records = records[-limit:]
            path = head_path(fingerprint, name)
            init = None if fresh else load_head(path, target.model, fingerprint=fingerprint)
            replayed = _load_replays(path) if init is not None else {}
            started = time.perf_counter()
            with progress() as bar:
                task = bar.add_task(f"{name}", total=1)

                def tick(done: int, total: int, label: str, task: Any = task,
                         name: str = name) -> None:
                    bar.update(task, completed=done, total=max(total, 1),
                               description=f"{name}: {label}")

                def rows_of(record: Any) -> Any:
                    return load_rows(fingerprint, record.scope, record.request_text,
                                     record.completion_ids)

                result = train_head(target.model, target.tokenizer, records, rows_of=rows_of,
                                    config=TrainConfig(depth=depth, epochs=epochs,
                                                       max_steps=max_steps),
                                    init=init, progress=tick, replayed=replayed)
            meta = {"fingerprint": fingerprint, "model": target.name, "scope": name,
                    "trained_at": time.time(), "warm_start": init is not None,
                    "stats": result.stats}
            save_head(path, result.head, meta)
            _save_replays(path, replayed)
            summaries.append({"scope": name, "path": str(path), **result.stats,
                              "wall_seconds": round(time.perf_counter() - started, 1)})
    if want_json(ctx):
        print_json({"model": fingerprint, "heads": summaries})
        return
    for s in summaries:
        acc = s["held_out_acceptance"]
        rates = " ".join(f"{r:.2f}" for r in acc.get("rate", []))
        report(ctx, s, f"{s['scope']}: {s['records']} completions, vocabulary {s['vocab']}, "
                       f"{s['seconds']:.0f} s; held-out acceptance by depth {rates or 'n/a'} "
                       f"({acc.get('mean_accepted', 0):.2f} tokens/step drafted right; "
                       f"{acc.get('tree_accepted', 0):.2f} in the whole beam tree) -> {s['path']}")


def _replay_file(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".safetensors") + ".replay.pt")


def _load_replays(path: Path) -> dict[int, Any]:
    """The replays kept beside a head (record id -> Replayed); empty when unreadable."""
    import torch

    from agentspec.drafters.head_train import Replayed

    try:
        raw = torch.load(_replay_file(path), weights_only=True)
        return {int(k): Replayed(*v) for k, v in raw.items()}
    except (OSError, RuntimeError, ValueError, TypeError, AttributeError):
        return {}


def _save_replays(path: Path, replayed: dict[int, Any]) -> None:
    import os

    import torch

    tmp = _replay_file(path).with_suffix(f".tmp-{os.getpid()}")
    # replays from kept rows are rebuilt from them (no forward): not stored twice
    torch.save({k: (r.tokens, r.hidden, r.logp) for k, r in replayed.items() if not r.kept_rows},
               tmp)
    os.replace(tmp, _replay_file(path))


def _head_files(home: Path) -> list[Path]:
    return sorted((home / "heads").glob("*/*.safetensors"))


def _meta(path: Path) -> dict[str, Any]:
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return dict(json.loads((f.metadata() or {}).get("agentspec_head", "{}")))


@head_app.command("stats")
@cache_command
def stats(ctx: typer.Context,
          scope: Annotated[str | None, typer.Option("--scope")] = None) -> None:
    """The trained heads under $AGENTSPEC_HOME: scope, model, data, held-out acceptance.

    Example: agentspec head stats --json
    """
    from agentspec.home import agentspec_home

    rows: list[dict[str, Any]] = []
    for path in _head_files(agentspec_home()):
        try:
            meta = _meta(path)
        except Exception as e:  # noqa: BLE001 - a damaged file is listed, not fatal
            rows.append({"path": str(path), "error": str(e)})
            continue
        if scope is not None and meta.get("scope") != scope:
            continue
        rows.append({"path": str(path), **meta})
    if want_json(ctx):
        print_json({"heads": rows})
        return
    if not rows:
        console.print("no trained heads (agentspec head train)", markup=False)
        return
    table = Table("scope", "model", "completions", "vocab", "held-out acceptance by depth",
                  "tokens/step", "whole tree", "trained")
    for r in rows:
        s: dict[str, Any] = r.get("stats", {})
        acc: dict[str, Any] = s.get("held_out_acceptance", {})
        table.add_row(str(r.get("scope", r.get("error", "?"))), str(r.get("fingerprint", "")),
                      str(s.get("records", "")), str(s.get("vocab", "")),
                      " ".join(f"{x:.2f}" for x in acc.get("rate", [])),
                      f"{acc.get('mean_accepted', 0):.2f}",
                      f"{acc['tree_accepted']:.2f}" if "tree_accepted" in acc else "-",
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(float(r.get("trained_at", 0)))))
    console.print(table)

