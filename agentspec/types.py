"""Frozen data passed between the engine's parts: drafts, verdicts, statistics, records, and
what a memory hears when a request ends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Draft:
    """A token tree proposed by a drafter, in parent-pointer form.

    Node ``i`` carries ``token_ids[i]``; its parent is ``parents[i]`` (``-1`` for a child of the
    last committed token) and ``parents[i] < i``. Sibling token ids are distinct. A chain has
    ``parents == (-1, 0, 1, ...)``. An empty draft means plain decoding for this step.

    Attributes:
        token_ids: draft token per node.
        parents: parent node index per node, -1 for the root's children.
        source: name of the drafter ("prompt_lookup", "memory", "suffix", "model", ...), or a
            per-node tuple of names when candidates from several sources were merged.
        draft_probs: only for probabilistic (model) drafts: q, ``[num_nodes, vocab_size]``.
        support: optionally, per node, how many of the drafter's own candidates (remembered
            completions, past occurrences of the matched suffix) continue the way the path to
            that node goes (each at least 1). The drafter chain learns an acceptance rate per
            level of support (a token several past completions agree on is a safer bet than
            one only a single completion holds); it never changes what a draft's tokens are
            or whether they are accepted.
        acceptance: optionally, the acceptance class the drafter declares for this proposal,
            finer than its source (the memory's ``"memory/follow"``: its best candidate has
            matched every generated token so far; prompt lookup's match length); None: the
            source's own class. Like ``support`` it only sizes drafts.
    """

    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    source: str | tuple[str, ...] = "none"
    draft_probs: torch.Tensor | None = field(default=None, compare=False)
    support: tuple[int, ...] | None = field(default=None, compare=False)
    acceptance: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(
                f"token_ids and parents differ in length: {len(self.token_ids)} != {len(self.parents)}"
            )
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"parents[{i}] must be in [-1, {i}), got {p}")
        if isinstance(self.source, tuple) and len(self.source) != len(self.token_ids):
            raise ValueError(f"per-node source has {len(self.source)} entries for {len(self.token_ids)} nodes")
        if self.support is not None and not support_fits(self.support, len(self.token_ids)):
            if len(self.support) != len(self.token_ids):
                raise ValueError(f"support has {len(self.support)} entries for {len(self.token_ids)} nodes")
            bad = next(s for s in self.support if type(s) is not int or s < 1)
            raise ValueError(f"support counts must be ints >= 1, got {bad!r}")
        if self.acceptance is not None and not (isinstance(self.acceptance, str) and self.acceptance):
            raise ValueError(f"acceptance must be a non-empty str or None, got {self.acceptance!r}")

    @staticmethod
    def chain(token_ids: list[int] | tuple[int, ...], source: str, draft_probs: Any = None,
              support: tuple[int, ...] | None = None, acceptance: str | None = None) -> Draft:
        """A linear draft: each token's parent is the one before it."""
        ids = tuple(int(t) for t in token_ids)
        return Draft(ids, tuple(range(-1, len(ids) - 1)), source, draft_probs, support, acceptance)

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def source_of(self, node: int) -> str:
        """The drafter that proposed ``node``."""
        return self.source[node] if isinstance(self.source, tuple) else self.source


EMPTY_DRAFT = Draft()


def support_fits(support: object, nodes: int) -> bool:
    """Whether ``support`` is what :attr:`Draft.support` may hold for ``nodes`` nodes: a tuple
    of one int >= 1 per node."""
    return (isinstance(support, tuple) and len(support) == nodes
            and all(type(c) is int and c >= 1 for c in support))


@dataclass(frozen=True)
class Verdict:
    """What exact acceptance decided for one draft (vLLM's vocabulary).

    Attributes:
        path: accepted node indices, root to leaf.
        accepted: the accepted draft tokens (``token_ids`` along ``path``).
        next_token: the recovered token (after a rejection) or bonus token (all accepted).
    """

    path: tuple[int, ...]
    accepted: tuple[int, ...]
    next_token: int

    @property
    def new_tokens(self) -> tuple[int, ...]:
        return (*self.accepted, self.next_token)

    @classmethod
    def chain(cls, accepted: Sequence[int], next_token: int = -1) -> Verdict:
        """The verdict that accepts a chain's first ``len(accepted)`` nodes (a prompt chunk's
        rows are committed as one: every token accepted, no next token)."""
        return cls(tuple(range(len(accepted))), tuple(accepted), next_token)


@dataclass(frozen=True)
class GenerationStats:
    """Counters of one generation (or a sum of several).

    ``steps`` counts target forward passes after the prefill; ``drafted``/``accepted`` count
    draft tokens by source; ``first_token_seconds`` is the time from the call's start to its
    first committed token (the prompt's prefill and the first step; summed, like ``seconds``,
    over calls).
    """

    steps: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    # Prompt tokens whose KV rows were not computed by this call: the prefix shared with the
    # target's last call, or restored from its prefix cache.
    cached_tokens: int = 0
    first_token_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def accepted_by_source(self) -> dict[str, int]:
        return dict(self.accepted)

    @property
    def drafted_by_source(self) -> dict[str, int]:
        return dict(self.drafted)

    def __add__(self, other: GenerationStats) -> GenerationStats:
        def merge(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in sorted({*a, *b})}

        return GenerationStats(
            steps=self.steps + other.steps,
            new_tokens=self.new_tokens + other.new_tokens,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            seconds=self.seconds + other.seconds,
            drafted=merge(self.drafted, other.drafted),
            accepted=merge(self.accepted, other.accepted),
            cached_tokens=self.cached_tokens + other.cached_tokens,
            first_token_seconds=self.first_token_seconds + other.first_token_seconds,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "seconds": self.seconds,
            "first_token_seconds": self.first_token_seconds,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_second": self.tokens_per_second,
            "drafted_by_source": dict(self.drafted),
            "accepted_by_source": dict(self.accepted),
        }


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one committed token, and its most likely alternatives.

    Taken from the raw logits of the forward row that decided the token: a log-softmax over
    the whole vocabulary in float32, before a grammar's mask, temperature, top-k or top-p (the
    model's own distribution, as vLLM reports by default). That row's bits do not depend on the
    drafts, so neither do these numbers: they are those plain decoding computes.

    Attributes:
        token_id: the committed token.
        logprob: its log-probability.
        top: the ``k`` most likely tokens at that position as ``(token id, log-probability)``,
            most likely first (``SamplingParams.logprobs`` says ``k``; empty for 0).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# The origin of a token the target chose itself (a step's recovered or bonus token), beside
# the draft sources' names; not "model", which names the small draft model's drafts.
TARGET_ORIGIN = "target"


@dataclass(frozen=True)
class Origins:
    """Where each token of a completion came from, and which verification step committed it.

    Only bookkeeping: it is read off each step's verdict after the tokens are decided, so it
    never changes one.

    Attributes:
        sources: per token, the draft source that proposed it when it was an accepted draft
            token (``"memory"``, ``"prompt_lookup"``, ``"suffix"``, ``"model"`` for a small draft
            model, ``"head"``, ``"grammar"``, ...), or :data:`TARGET_ORIGIN` for the token the
            target chose itself: the one token each step commits beyond its accepted drafts.
        steps: how many tokens each step committed, in order; each at least one, together
            ``len(sources)``.
        text_ends: optionally, for each of :meth:`runs`, the length of the completion's text
            through that run's last token (what slices the text by origin without a
            tokenizer; :func:`agentspec.text.origin_text`); None where not computed.
    """

    sources: tuple[str, ...] = ()
    steps: tuple[int, ...] = ()
    text_ends: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for n in self.steps:
            if type(n) is not int or n < 1:
                raise ValueError(f"every step commits at least one token, got a step of {n!r}")
        if sum(self.steps) != len(self.sources):
            raise ValueError(f"the steps commit {sum(self.steps)} tokens but there are "
                             f"{len(self.sources)} sources; give one source per token")
        for s in set(self.sources):
            if not isinstance(s, str) or not s:
                raise ValueError(f"a token's source must be a non-empty str, got {s!r}")
        if self.text_ends is not None:
            runs = len(self.runs())
            ends = self.text_ends
            if len(ends) != runs or any(type(e) is not int for e in ends) or \
                    any(b < a for a, b in zip((0, *ends), ends, strict=False)):
                raise ValueError(f"text_ends must be {runs} non-decreasing ints >= 0 (one per "
                                 f"run), got {ends!r:.200}")

    def counts(self) -> dict[str, int]:
        """Tokens per origin, sorted by name."""
        out: dict[str, int] = {}
        for s in self.sources:
            out[s] = out.get(s, 0) + 1
        return dict(sorted(out.items()))

    def runs(self) -> tuple[tuple[int, str, int, int], ...]:
        """``(step, source, start, end)`` for each stretch of tokens ``[start, end)`` one step
        committed from one source, in order: a run never spans two steps."""
        out: list[tuple[int, str, int, int]] = []
        start = 0
        for step, size in enumerate(self.steps):
            end = start + size
            at = start
            for i in range(start + 1, end + 1):
                if i == end or self.sources[i] != self.sources[at]:
                    out.append((step, self.sources[at], at, i))
                    at = i
            start = end
        return tuple(out)

    def pieces(self, text: str) -> tuple[tuple[int, str, int, str], ...]:
        """``(step, source, tokens, piece)`` for each of :meth:`runs`: ``text`` (the completion
        these origins describe) cut at :attr:`text_ends`. A piece may be empty (a special
        token, or half a character that the next piece completes).

        Raises:
            ValueError: without ``text_ends`` (:func:`agentspec.text.origin_text` adds them).
        """
        if self.text_ends is None:
            raise ValueError("these origins have no text_ends; add them with "
                             "agentspec.text.origin_text(tokenizer, token_ids, origins, text)")
        out, at = [], 0
        for (step, source, start, end), stop in zip(self.runs(), self.text_ends, strict=True):
            out.append((step, source, end - start, text[at:stop]))
            at = max(at, stop)
        return tuple(out)

    def cut(self, tokens: int) -> Origins:
        """The origins of the first ``tokens`` tokens (a stop string cut the completion
        there); the text's ends are dropped, they belong to the uncut text."""
        if tokens >= len(self.sources):
            return self
        steps, left = [], tokens
        for size in self.steps:
            if left <= 0:
                break
            steps.append(min(size, left))
            left -= size
        return Origins(self.sources[:tokens], tuple(steps))

    def as_json(self) -> str:
        """A compact JSON text of these origins (what the memory's records keep)."""
        import json

        body: dict[str, Any] = {"runs": [[step, source, end - start]
                                         for step, source, start, end in self.runs()]}
        if self.text_ends is not None:
            body["text_ends"] = list(self.text_ends)
        return json.dumps(body, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Origins:
        """Read :meth:`as_json`'s text back.

        Raises:
            ValueError: the text is not such JSON (the message says what is wrong).
        """
        import json

        try:
            body = json.loads(text)
            runs, ends = body["runs"], body.get("text_ends")
            sources: list[str] = []
            steps: list[int] = []
            for step, source, n in runs:
                if type(step) is not int or type(n) is not int or n < 1 or \
                        step not in (len(steps) - 1, len(steps)):
                    raise ValueError(f"bad run {[step, source, n]!r}")
                if step == len(steps):
                    steps.append(0)
                steps[step] += n
                sources.extend([source] * n)
            return Origins(tuple(sources), tuple(steps),
                           None if ends is None else tuple(ends))
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            raise ValueError(f"not the JSON of token origins ({e}): {text!r:.120}") from None


@dataclass(frozen=True)
class Generation:
    """The result of ``Speculator.generate``.

    Attributes:
        text: the decoded completion, cut before any stop string.
        token_ids: the completion's token ids (the stop token itself excluded).
        stats: counters of this generation.
        finish_reason: "stop" (a stop token or string), or "length" (max_new_tokens reached).
        logprobs: one :class:`TokenLogprob` per token of ``token_ids`` when the call's
            ``SamplingParams.logprobs`` asked for them, else None.
        origins: where each token of ``token_ids`` came from and the steps that committed
            them (:class:`Origins`; a Speculator always fills it), else None.
    """

    text: str
    token_ids: tuple[int, ...]
    stats: GenerationStats
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    origins: Origins | None = None


@dataclass(frozen=True)
class Record:
    """One remembered completion: a row of the completion memory's SQL store.

    ``id`` is ``None`` until the store assigns it. ``embedding`` is float32 ``[dim]``,
    L2-normalised, or ``None`` when not embedded yet. Times are Unix seconds. ``origins``:
    where each completion token came from when it was generated (:class:`Origins`), or None
    (recorded without them, or by an older agentspec).
    """

    scope: str
    model: str
    request_text: str
    key_text: str
    completion_text: str
    completion_ids: tuple[int, ...]
    embedding: np.ndarray | None = field(default=None, compare=False)
    embedder: str = ""
    id: int | None = None
    created_at: float = 0.0
    last_used_at: float = 0.0
    hits: int = 0
    accepted_tokens: int = 0
    origins: Origins | None = field(default=None, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.completion_ids)


@dataclass(frozen=True)
class Finished:
    """What a completion memory hears when a request ends, in one call
    (:meth:`agentspec.protocols.Memory.finish`).

    Attributes:
        record: the request's completion (no id, no embedding yet).
        remember: whether to record it (the call's ``record``; an empty completion is not).
        credits: ``(record id, accepted tokens)``: how many of this request's accepted draft
            tokens each remembered completion drafted (the memory's LRU and statistics).
    """

    record: Record
    remember: bool
    credits: tuple[tuple[int, int], ...] = ()
