"""The target's hidden rows of recorded completions, kept for training the draft head.

Training a head (:mod:`agentspec.drafters.head_train`) needs, at every position of a
completion, the target's final hidden state. Replaying a completion through the target costs
a forward over everything its prompt does not share with the record before (a few hundred
tokens of an agent's call on average), which dominates training on a CPU. The decode loop has
already computed those rows: with ``SpecConfig(head_rows=True)`` the
:class:`~agentspec.Speculator` watches each call it records with a :class:`RowKeeper` (a
decode-loop observer) and keeps the row of the last prompt token and of every completion
token but the last (float16, one file per completion); ``agentspec head train`` takes them
instead of replaying that completion.

Files live under ``$AGENTSPEC_HOME/head-rows/<model fingerprint>/<scope>/``, named by a hash
of the request and the completion's token ids: a record of the same request and completion
in any memory (another database, another machine's rows) finds them; anything else does not.
The rows are used for training only (never to decide a token); a file that is missing,
unreadable or does not match the record is ignored and the completion is replayed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from agentspec.drafters.head import safe_name
from agentspec.errors import warn_once
from agentspec.home import agentspec_home
from agentspec.types import Draft, Verdict


def rows_dir(fingerprint: str, scope: str, home: Path | None = None) -> Path:
    """The folder of a model's (fingerprint) and scope's kept rows."""
    return (home or agentspec_home()) / "head-rows" / safe_name(fingerprint) / safe_name(scope)


def rows_key(request_text: str, completion_ids: Sequence[int]) -> str:
    """The file name of a completion's rows: a hash of its request and its token ids."""
    digest = hashlib.sha256(request_text.encode("utf-8"))
    digest.update(b"\0" + ",".join(str(int(t)) for t in completion_ids).encode("ascii"))
    return digest.hexdigest()[:32]


def save_rows(fingerprint: str, scope: str, request_text: str, last_prompt_token: int,
              completion_ids: Sequence[int], rows: torch.Tensor, *,
              home: Path | None = None) -> Path:
    """Keep a completion's rows: ``rows[i]`` the target's final hidden state at the row that
    processed token ``i`` of ``[last_prompt_token, *completion_ids]`` (so ``len(completion_ids)``
    rows). Written atomically; returns the file.

    Raises:
        ValueError: the row count does not match the completion.
    """
    if rows.ndim != 2 or rows.shape[0] != len(completion_ids):
        raise ValueError(f"need one row per completion token ({len(completion_ids)}), got rows "
                         f"of shape {tuple(rows.shape)}")
    folder = rows_dir(fingerprint, scope, home)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{rows_key(request_text, completion_ids)}.pt"
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tokens = torch.tensor([int(last_prompt_token), *(int(t) for t in completion_ids)])
    torch.save({"tokens": tokens, "rows": rows.detach().to("cpu", torch.float16).contiguous()}, tmp)
    os.replace(tmp, path)
    return path


def load_rows(fingerprint: str, scope: str, request_text: str, completion_ids: Sequence[int], *,
              home: Path | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(tokens [L + 1], rows [L, hidden])`` kept for this request and completion, or None
    when there are none (or the file is unreadable or another completion's)."""
    path = rows_dir(fingerprint, scope, home) / f"{rows_key(request_text, completion_ids)}.pt"
    try:
        # weights_only: tensors and plain containers only, no arbitrary object is built
        kept = torch.load(path, weights_only=True)
        tokens, rows = kept["tokens"], kept["rows"]
    except Exception:  # missing, truncated or foreign: the completion is replayed instead
        return None
    if not isinstance(tokens, torch.Tensor) or not isinstance(rows, torch.Tensor):
        return None
    if tokens[1:].tolist() != [int(t) for t in completion_ids] or rows.ndim != 2 \
            or rows.shape[0] != len(completion_ids):
        return None
    return tokens, rows


class RowKeeper:
    """One request's hidden rows, kept step by step for head training (a
    :class:`~agentspec.protocols.StepObserver` of the decode loop): each step's root row, then
    its accepted path's, float16 on the CPU. Read only: no token depends on them."""

    wants_hidden = True

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def step(self, hidden: torch.Tensor | None, draft: Draft, verdict: Verdict) -> None:
        # hidden: [num_nodes + 1, hidden], or None where it was not kept
        if hidden is not None:
            self.rows.append(hidden[[0, *(i + 1 for i in verdict.path)]].to("cpu", torch.float16))

    def save(self, fingerprint: str, scope: str, request_text: str, last_prompt_token: int,
             completion_ids: Sequence[int]) -> None:
        """Keep the completion's rows (:func:`save_rows`); never fails the call: a step that
        gave no rows leaves the completion to be replayed, and so does a file not written."""
        rows = torch.cat(self.rows) if self.rows else None
        if rows is None or rows.shape[0] < len(completion_ids):
            return
        try:
            save_rows(fingerprint, scope, request_text, last_prompt_token, completion_ids,
                      rows[: len(completion_ids)])
        except OSError as e:
            warn_once(f"cannot keep hidden rows for head training ({e}); "
                      "agentspec head train will replay these completions")
