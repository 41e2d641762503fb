"""Frozen, validated configuration: how to sample and how to speculate."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentspec.grammar import Grammar

# The most alternatives a committed token's log-probability may carry (OpenAI's bound).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is processed and sampled.

    ``temperature == 0`` is greedy decoding (argmax), token-identical to plain decoding.
    With ``temperature > 0`` the output is distributed exactly as plain sampling with the same
    temperature, ``top_k`` and ``top_p``. ``seed`` seeds the explicit ``torch.Generator`` of a
    generation; ``None`` draws a fresh seed.

    ``grammar`` (:class:`agentspec.grammar.Grammar`: a JSON schema, tool calls, a regex or a
    Lark grammar) constrains the output: the target distribution is the model's masked by the
    grammar's state after each prefix, applied before temperature, top-k and top-p.

    ``repetition_penalty`` is accepted only at 1.0: a history-dependent processor would have to
    be applied per tree path, which the verifier does not do yet.

    ``logprobs`` (None: off) asks for the log-probability of every committed token and its
    ``logprobs`` most likely alternatives (0 to :data:`MAX_LOGPROBS`), in
    ``Generation.logprobs``: the model's own distribution (raw logits, before the grammar's
    mask, temperature, top-k and top-p; see :class:`~agentspec.types.TokenLogprob`). It changes
    no token, and costs one device-to-host copy a step only when asked.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    grammar: Grammar | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.grammar is not None:
            from agentspec.grammar import Grammar

            if not isinstance(self.grammar, Grammar):
                raise TypeError(f"grammar must be an agentspec.grammar.Grammar or None, got "
                                f"{type(self.grammar).__name__} {self.grammar!r:.80}")
        if self.logprobs is not None and (type(self.logprobs) is not int
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}] (the "
                             f"alternatives shown per token), got {self.logprobs!r}")
        if self.repetition_penalty != 1.0:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty!r} is not supported: a "
                "history-dependent logits processor cannot yet be applied per draft path, "
                "and agentspec never changes an output silently"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SpecConfig:
    """How much to speculate (the cost-aware policy sizes each draft within these bounds).

    Attributes:
        max_draft_tokens: upper bound on a draft's depth (tokens along one path).
        ngram_min / ngram_max: prompt lookup match lengths (in tokens); one-token matches
            (``ngram_min`` 1) are drafted only where nothing longer matches.
        max_tree_nodes: node budget when several candidates merge into a tree.
        memory_neighbours: how many remembered completions of similar requests (same scope
            and model) a call drafts from. They merge into one tree, and each node counts how
            many of them back it (:attr:`~agentspec.types.Draft.support`). More than the
            default did not repay the larger lookup and merge (BENCHMARKS.md).
        trees: verify tree drafts where the target's attention can take a tree mask; False
            verifies each step's best chain only.
        grammar_drafts: under a grammar (``SamplingParams.grammar``), append the tokens it
            forces to every draft (free drafts: accepted with probability one).
        lazy_masks: under a grammar with greedy decoding, compute a row's mask only where the
            model's argmax is a token the grammar forbids (the draft's tokens are checked one
            by one instead); the same outputs, a fraction of the grammar's cost. False
            computes every row's mask (sampling always does).
        draft_head: draft with a trained recurrent head (``agentspec head train``) where one
            exists for the model and the request's scope under ``$AGENTSPEC_HOME``.
        head_rows: keep the target's hidden rows of every completion recorded into the memory
            (:mod:`agentspec.drafters.head_rows`, float16 files under ``$AGENTSPEC_HOME``), so
            that ``agentspec head train`` need not replay it through the target. Off by
            default (2 bytes per hidden unit per generated token on disk: 1.15 KiB for
            SmolLM2-135M).
        prefetch_key: start a call's memory lookup (the key's embedding, the index search,
            the rows' fetch) on a worker thread as the call starts, while the prompt is
            tokenised and prefilled, instead of after them. ``None`` (the default): where the
            target runs on an accelerator, whose prefill leaves the host waiting (an embedder
            on the GPU embeds on a CUDA stream of its own, beside the prefill); on a CPU
            target the lookup and the prefill would share the same cores.
        write_behind: hand a call's memory writes (its completion's record, the credits of
            the remembered drafts it accepted) to the memory's worker thread and return
            without waiting for the database; the next read of the memory waits for them, so
            every call still drafts from every completion recorded before it
            (:meth:`~agentspec.memory.completion.CompletionMemory.record_behind`). False writes them
            before the call returns.
        record: whether a call records its completion into the memory when the call does not
            say (``generate``/``stream``'s ``record=``); ``AGENTSPEC_RECORD=0`` in the
            environment turns recording off above both.
        max_batch: the most calls one :class:`~agentspec.Speculator` steps at once, each a
            sequence of the target's KV pool and rows of the same forwards; more wait, first
            come first served.
    """

    max_draft_tokens: int = 64
    ngram_min: int = 1
    ngram_max: int = 4
    max_tree_nodes: int = 64
    memory_neighbours: int = 8
    trees: bool = True
    grammar_drafts: bool = True
    lazy_masks: bool = True
    draft_head: bool = True
    head_rows: bool = False
    prefetch_key: bool | None = None
    write_behind: bool = True
    record: bool = True
    max_batch: int = 16

    def __post_init__(self) -> None:
        if self.max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min}, "
                f"ngram_max={self.ngram_max}"
            )
        if self.max_tree_nodes < 1:
            raise ValueError(f"max_tree_nodes must be >= 1, got {self.max_tree_nodes}")
        if type(self.memory_neighbours) is not int or self.memory_neighbours < 1:
            raise ValueError(f"memory_neighbours must be an int >= 1, got {self.memory_neighbours!r}")
        if self.prefetch_key not in (None, True, False):
            raise ValueError(f"prefetch_key must be True, False or None, got {self.prefetch_key!r}")
        if self.write_behind not in (True, False):
            raise ValueError(f"write_behind must be True or False, got {self.write_behind!r}")
        if self.record not in (True, False):
            raise ValueError(f"record must be True or False, got {self.record!r}")
        if type(self.max_batch) is not int or self.max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {self.max_batch!r}")
