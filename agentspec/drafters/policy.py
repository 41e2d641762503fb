"""Draft-length policies."""

from __future__ import annotations

from agentspec.config import SpecConfig


class AdaptiveLength:
    """Grow the draft after full acceptance, shrink it after a rejection.

    The same additive-increase rule transformers uses for its assistant drafts (+2 when all
    were accepted, -1 otherwise), bounded by ``SpecConfig``'s min and max.
    """

    def __init__(self, config: SpecConfig, initial: int = 10) -> None:
        self.config = config
        self.initial = max(config.min_draft_tokens, min(initial, config.max_draft_tokens))
        self.current = self.initial

    def reset(self) -> None:
        self.current = self.initial

    def update(self, drafted: int, accepted: int) -> None:
        if not self.config.adaptive:
            return
        if accepted == drafted:
            self.current = min(self.config.max_draft_tokens, self.current + 2)
        else:
            self.current = max(self.config.min_draft_tokens, self.current - 1)
