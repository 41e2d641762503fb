"""The seams of agentspec: small Protocols that drafters, memories, stores, indexes, embedders
and decode-loop observers satisfy."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias, TypeVar, runtime_checkable

import numpy as np

from agentspec.config import SamplingParams
from agentspec.types import Draft, Finished, Record, Verdict

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


@dataclass(frozen=True)
class StepShare:
    """The rest of a batched step as one request's draft sizing sees it: the tokens the other
    requests' rows are expected to yield, the rows they take (prompt chunks included) and the
    seconds they add to the forward beyond their rows (their keys read)."""

    tokens: float = 0.0
    rows: int = 0
    seconds: float = 0.0


@dataclass
class DraftContext:
    """What a drafter may look at. Written by the decode loop only: the caller builds it in
    one call, then the loop extends ``tokens`` and hands the hidden rows; drafters read it.

    Attributes:
        tokens: every committed token id: the prompt, then the generated ones.
        prompt_len: how many of ``tokens`` are the prompt.
        scope: the memory scope of the request (tenant / agent role).
        key_text: the text the completion memory is keyed on (the conversation).
        extra_sources: token sequences the caller adds as lookup sources (earlier outputs
            and tool results of a session).
        sampling: the request's sampling parameters, for drafters that sample like the target
            (a small model drafting with probabilities); None: unknown, draft point masses.
        generator: the request's explicit random source, for those drafters.
        hidden: the last step's final hidden rows ``[rows, hidden]`` (row 0 the root's, row
            ``i + 1`` draft node ``i``'s) where the drafter ``wants_hidden``, else None; row
            ``r`` was computed at position ``hidden_position + r``. Read only: never decides
            a token.

    Per-request drafter state lives here (:meth:`state`), not on the drafter: the steps of
    several calls may interleave (streams on several threads take turns on one model). It is
    each drafter's own (what the memory drafter credits, say), asked of the drafter, never
    read from here by others.
    """

    tokens: list[int]
    prompt_len: int
    scope: str = "default"
    key_text: str = ""
    extra_sources: Sequence[Sequence[int]] = field(default_factory=tuple)
    sampling: SamplingParams | None = None
    generator: torch.Generator | None = None
    hidden: torch.Tensor | None = field(default=None, repr=False, compare=False)
    hidden_position: int = -1
    _states: dict[int, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def state(self, owner: object, make: Callable[[], T]) -> T:
        """``owner``'s state for this request, made by ``make()`` on first use.

        It lives as long as the request, so drafters shared by interleaved calls keep each
        call's state apart (state shared on purpose, such as learned acceptance, stays on the
        drafter)."""
        key = id(owner)
        if key not in self._states:
            self._states[key] = make()
        out: T = self._states[key]
        return out


@runtime_checkable
class Drafter(Protocol):
    """A source of drafts.

    ``begin`` is called once per request before the first step, ``propose``/``observe`` once
    per step, ``end`` once after the last step (to flush statistics, credit sources). One
    step (``propose`` to ``observe``) runs without interruption, but the steps of several
    requests may interleave: keep per-request state in :meth:`DraftContext.state`. Drafts
    are untrusted (:mod:`agentspec.decoding.untrusted`): a malformed one is cleaned, and a drafter that
    raises is skipped for the rest of the request.

    Optional: ``wants_hidden = True`` (an attribute) asks the decode loop to keep the target's
    final hidden rows for it (:attr:`DraftContext.hidden`); ``credits(context)`` returns the
    request's :data:`Credits`, which the caller hands to the memories when it ends.
    """

    name: str

    def begin(self, context: DraftContext) -> None: ...

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft: ...

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None: ...

    def end(self, context: DraftContext) -> None: ...


class Proposal(NamedTuple):
    """One step's proposal: the draft, and the tokens it is expected to yield (the accepted
    ones plus the one the verdict adds; 1.0 from a drafter that does not size its drafts),
    which the scheduler weighs when it sizes the step's other rows."""

    draft: Draft
    expected_tokens: float = 1.0


# A request's credits: ``(memory, record id)`` -> the accepted draft tokens that remembered
# completion drafted in it; each memory hears its own when the request ends
# (:meth:`Memory.finish`).
Credits: TypeAlias = Counter[tuple[Any, int]]


@runtime_checkable
class SizingDrafter(Drafter, Protocol):
    """A drafter that sizes its drafts by the step's cost (the drafter chain): in a batched
    step, by what the step's other rows cost and yield (``share``; None: the request is
    alone), each node against its marginal row. It says what its proposal is expected to
    yield."""

    def propose_sized(self, context: DraftContext, *, max_tokens: int,
                      share: StepShare | None) -> Proposal: ...


@runtime_checkable
class Memory(Protocol):
    """What a :class:`~agentspec.Speculator` and its drafters ask of a completion memory.

    :class:`~agentspec.memory.CompletionMemory` is one; a memory of the user's with only
    ``lookup``, ``record`` and ``credit`` is wrapped into one (:func:`agentspec.memory.as_memory`).
    A memory is an accelerator: none of these may fail a generation that is otherwise done.
    """

    def lookup(self, key_text: str, *, scope: str, model: str, k: int = 8,
               min_similarity: float | None = None) -> list[tuple[Record, float]]:
        """Up to ``k`` remembered completions of ``scope`` and ``model``, most similar first."""
        ...

    def completions(self, *, scope: str, model: str, after_id: int = 0) -> Iterator[Record]:
        """Records of ``scope`` and ``model`` with ``id > after_id``, in id order."""
        ...

    def finish(self, done: Finished, *, behind: bool) -> Future[int] | int:
        """The one end-of-request call: the credits, then the record. ``behind``: hand the
        writes to a worker thread and return its future (where the memory has one)."""
        ...

    def prefetch(self, key_text: str, *, scope: str | None = None, model: str | None = None,
                 k: int = 8, min_similarity: float | None = None) -> None:
        """Start the work of a lookup that comes soon (with ``scope`` and ``model``: the
        whole lookup, whose answer the lookup with the same arguments takes; without: the
        key's embedding); a failure costs nothing here."""
        ...

    def warmup(self) -> None:
        """Do the one-time work (load the embedder) now."""
        ...


@runtime_checkable
class StepObserver(Protocol):
    """Watches each step of the decode loop, read only (never decides a token).

    ``wants_hidden``: the step's forward keeps the target's final hidden rows, handed to
    :meth:`step` (``[rows, hidden]``: row 0 the root's, row ``i + 1`` node ``i``'s; None
    where the forward could not keep them).
    """

    wants_hidden: bool

    def step(self, hidden: torch.Tensor | None, draft: Draft, verdict: Verdict) -> None: ...


@runtime_checkable
class RecordStore(Protocol):
    """The completion memory's source of truth (SQL or in-memory)."""

    def add(self, record: Record) -> tuple[int, bool]:
        """Insert ``record``; an exact duplicate (same scope, model, key and completion) bumps
        its ``hits`` instead. Returns ``(id, created)``."""
        ...

    def get(self, record_id: int) -> Record | None: ...

    def get_many(self, ids: Sequence[int]) -> list[Record]: ...

    def iter(self, *, scope: str | None = None, model: str | None = None,
             after_id: int = 0) -> Iterator[Record]: ...

    def delete(self, ids: Iterable[int]) -> int: ...

    def touch(self, record_id: int, *, accepted_tokens: int = 0) -> None:
        """Mark a record used now: bump ``hits``, add ``accepted_tokens``, set ``last_used_at``."""
        ...

    def max_id(self) -> int: ...

    def __len__(self) -> int: ...


class MemoryStore(RecordStore, Protocol):
    """A RecordStore with the queries the memory needs (SQLStore and InMemoryStore have them)."""

    def count(self, *, scope: str | None = None, model: str | None = None,
              embedder: str | None = None) -> int: ...

    def ids(self, *, scope: str | None = None, embedder: str | None = None) -> np.ndarray: ...

    def add_many(self, records: Iterable[Record]) -> int: ...

    def ids_after(self, after_id: int, *, scope: str | None = None, model: str | None = None,
                  embedder: str | None = None,
                  among: Sequence[int] | None = None) -> list[tuple[int, np.ndarray]]: ...

    def ids_since(self, after_id: int) -> np.ndarray: ...

    def evict_to_caps(self, max_tokens_per_scope: int | None, max_tokens_total: int | None,
                      *, scope: str | None = None) -> list[int]: ...

    def token_total(self, scope: str | None = None) -> int: ...

    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class VectorIndex(Protocol):
    """Inner-product search over L2-normalised vectors whose ids are store ids."""

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None: ...

    def search(self, vector: np.ndarray, k: int) -> list[tuple[int, float]]: ...

    def remove(self, ids: Iterable[int]) -> int: ...

    def __len__(self) -> int: ...


@runtime_checkable
class Embedder(Protocol):
    """Text to L2-normalised float32 vectors ``[n, dim]``."""

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...
