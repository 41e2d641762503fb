"""One sequence of an engine, driven step by step through the engine's public door.

Many tests look at the forwards of a single request: prefill a prompt, score a draft, commit
a verdict, roll back. :func:`solo` gives each engine (:class:`~agentspec.engine.target.HFTarget`)
one such sequence, kept across calls as a request's would be, and drives it with the engine's
verbs only (``new_sequence``, ``prefill``, ``run``) and the sequence's own ``commit`` and
``truncate``: the same calls the scheduler and the model drafter make.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from agentspec.engine.plan import draft_member
from agentspec.types import Draft, Verdict

_SOLOS: weakref.WeakKeyDictionary[Any, Solo] = weakref.WeakKeyDictionary()


class Solo:
    """One sequence of ``target``'s pool and the last step scored on it."""

    def __init__(self, target: Any, *, cached: bool = True) -> None:
        self.target = target
        self.seq = target.new_sequence(cached=cached)
        self.hidden: torch.Tensor | None = None
        self.hidden_position = -1
        self._root = -1

    def start(self, prompt_ids: list[int]) -> None:
        """Hold every prompt token but the last (what is cached or held is kept)."""
        self.target.prefill(self.seq, prompt_ids)

    def score(self, last_token: int, draft: Draft, *, keep_hidden: bool = False) -> torch.Tensor:
        """One forward over the last committed token and ``draft``: its logits."""
        self._root = last_token
        scored = self.target.run([draft_member(self.seq, last_token, draft)], hidden=keep_hidden)
        self.hidden = scored.hidden[0]
        self.hidden_position = self.seq.kv_len if keep_hidden else -1
        out = scored[0]
        assert out is not None
        return out

    def commit(self, draft: Draft, verdict: Verdict) -> None:
        """Keep the scored root and the verdict's accepted path."""
        self.seq.commit(self._root, verdict)

    def crop(self, num_tokens: int) -> None:
        self.seq.truncate(num_tokens)

    def holds(self, tokens: list[int]) -> bool:
        return self.seq.kv_len == len(tokens) - 1 and self.seq.ids == tokens[:-1]

    @property
    def kv_len(self) -> int:
        return self.seq.kv_len

    @property
    def reused_tokens(self) -> int:
        return self.seq.reused_tokens


def solo(target: Any) -> Solo:
    """``target``'s one test sequence (made on first use)."""
    own = _SOLOS.get(target)
    if own is None:
        own = _SOLOS[target] = Solo(target)
    return own


def commit_tokens(seq: Any, ids: list[int]) -> None:
    """Commit ``ids`` after ``seq``'s committed rows, as a prefill chunk's forward commits
    them (their rows written by the caller)."""
    if ids:
        seq.commit(ids[0], Verdict.chain(ids[1:]))


def verified_and_alone(target: Any, prompt: list[int],
                       chain: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``chain`` verified in one forward after ``prompt``, and each of those rows
    scored alone (the prompt and the chain up to it started, its last token scored with no
    draft; the KV keeps what matches of the last start): ``[len(chain) + 1, vocab]`` each."""
    solo(target).start(prompt)
    verified = solo(target).score(prompt[-1], Draft.chain(chain, "ref")).clone()
    alone = []
    for i in range(len(chain) + 1):
        ids = prompt + chain[:i]
        solo(target).start(ids)
        alone.append(solo(target).score(ids[-1], Draft())[0].clone())
    return verified, torch.stack(alone)
