"""Prompt lookup (Saxena 2023): copy what followed the latest occurrence of the current suffix.

Sources are the request's own tokens (prompt and generated text) and any extra sequences the
caller provides (a session's earlier outputs and tool results). The longest n-gram match wins;
among equal lengths, the request itself, whose most recent occurrence is preferred.
"""

from __future__ import annotations

from agentspec.config import SpecConfig
from agentspec.drafters.ngram import NgramIndex
from agentspec.protocols import DraftContext
from agentspec.types import EMPTY_DRAFT, Draft, Verdict


class PromptLookupDrafter:
    """Longest-suffix n-gram drafts over the prompt, generated tokens and extra sources."""

    name = "prompt_lookup"

    def __init__(self, config: SpecConfig | None = None) -> None:
        self.config = config or SpecConfig()
        self._index = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        self._extra: list[tuple[list[int], NgramIndex]] = []

    def begin(self, context: DraftContext) -> None:
        self._index = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        self._extra = []
        for seq in context.extra_sources:
            idx = NgramIndex(self.config.ngram_min, self.config.ngram_max)
            self._extra.append((list(seq), idx))

    def best_match(self, context: DraftContext) -> tuple[int, list[int], int]:
        """``(match length, source tokens, continuation start)`` of the best match."""
        tokens = context.tokens
        n, start = self._index.match(tokens)
        best: tuple[int, list[int], int] = (n, tokens, start)
        for seq, idx in self._extra:
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
        return Draft.chain(seq[start : start + max_tokens], self.name)

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        pass

    def end(self, context: DraftContext) -> None:
        pass
