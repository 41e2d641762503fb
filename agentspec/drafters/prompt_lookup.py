"""Prompt lookup (Saxena 2023): copy what followed the latest occurrence of the current suffix.

Sources are the request's own tokens (prompt and generated text) and any extra sequences the
caller provides (a session's earlier outputs and tool results). The longest n-gram match wins;
among equal lengths, the request itself, whose most recent occurrence is preferred.

Where no longer n-gram matches, a single token does (``ngram_min`` 1, the default): a weak
guess, but where a forward's cost is flat over its first few rows (the CPU's narrowest forward
widths, a GPU's one width) a wrong guess costs nothing and a right one a step.

Each proposal carries the acceptance class of its match length (:attr:`Draft.acceptance`
``"prompt_lookup/<n>"``): a longer match is stronger evidence that the text repeats, so the
drafter chain learns each length's acceptance apart and sizes a draft by its own (the replay's
figures are in BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentspec.config import SpecConfig
from agentspec.drafters.ngram import NgramIndex
from agentspec.protocols import DraftContext
from agentspec.types import EMPTY_DRAFT, Draft, Verdict


@dataclass
class _Indexes:
    """One request's n-gram indexes: over its own tokens, and per extra source."""

    own: NgramIndex
    extra: list[tuple[list[int], NgramIndex]]


class PromptLookupDrafter:
    """Longest-suffix n-gram drafts over the prompt, generated tokens and extra sources."""

    name = "prompt_lookup"

    def __init__(self, config: SpecConfig | None = None) -> None:
        self.config = config or SpecConfig()
        # The acceptance class of the last proposal, read by the drafter chain right after
        # ``propose`` within the same step: "prompt_lookup/<match length>".

    def _indexes(self, context: DraftContext) -> _Indexes:
        def make() -> _Indexes:
            lo, hi = self.config.ngram_min, self.config.ngram_max
            return _Indexes(NgramIndex(lo, hi),
                            [(list(seq), NgramIndex(lo, hi)) for seq in context.extra_sources])

        return context.state(self, make)

    def begin(self, context: DraftContext) -> None:
        self._indexes(context)

    def best_match(self, context: DraftContext) -> tuple[int, list[int], int]:
        """``(match length, source tokens, continuation start)`` of the best match."""
        tokens = context.tokens
        indexes = self._indexes(context)
        n, start = indexes.own.match(tokens)
        best: tuple[int, list[int], int] = (n, tokens, start)
        for seq, idx in indexes.extra:
            m, s = idx.match(seq, tokens[-self.config.ngram_max :])
            if m > best[0]:
                best = (m, seq, s)
        return best

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return EMPTY_DRAFT
        n, seq, start = self.best_match(context)
        if n == 0:
            return EMPTY_DRAFT
        # The whole continuation: the drafter chain sizes it from measured costs and acceptance.
        return Draft.chain(seq[start : start + max_tokens], self.name,
                           acceptance=f"{self.name}/{n}")

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        pass

    def end(self, context: DraftContext) -> None:
        pass
