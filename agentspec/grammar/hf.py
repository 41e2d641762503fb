"""The grammar as a ``transformers`` logits processor: the same constraint for
``model.generate`` (the reference plain decoding of the grammar tests, and a way to constrain
a model's own ``generate`` with a :class:`~agentspec.grammar.Grammar`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agentspec.grammar.spec import Grammar, GrammarError
from agentspec.grammar.state import GrammarState
from agentspec.tree import common_prefix_len


class GrammarLogitsProcessor:
    """The same constraint for ``transformers.generate`` (batch size 1): each call consumes
    the tokens generated since the last one and masks the scores. The reference plain
    decoding of the equivalence tests and the bench's ``hf-*`` baselines.

    Args:
        grammar, tokenizer, vocab_size, eos_ids: as :class:`GrammarState`.
        prompt_len: the prompt's length in ``input_ids``.
    """

    def __init__(self, grammar: Grammar, tokenizer: Any, *, vocab_size: int,
                 eos_ids: Sequence[int], prompt_len: int) -> None:
        self._args = (grammar, tokenizer, vocab_size, tuple(eos_ids))
        self.state = self._fresh()
        self.prompt_len = prompt_len
        self.consumed: list[int] = []

    def _fresh(self) -> GrammarState:
        grammar, tokenizer, vocab_size, eos_ids = self._args
        return GrammarState(grammar, tokenizer, vocab_size=vocab_size, eos_ids=eos_ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise ValueError(f"GrammarLogitsProcessor takes batch size 1, got {input_ids.shape[0]}")
        # Assisted generation (prompt lookup) calls with candidate prefixes it may reject: on
        # a rejected token start over from a fresh matcher and consume the kept prefix.
        generated = input_ids[0, self.prompt_len:].tolist()
        keep = common_prefix_len(self.consumed, generated)
        if keep < len(self.consumed):
            self.state.close()
            self.state, self.consumed, keep = self._fresh(), [], 0
        try:
            self.state.advance(generated[keep:])
        except GrammarError as exc:
            raise GrammarError(f"generate produced tokens the grammar forbids: {exc}") from exc
        self.consumed = generated
        allowed = self.state.allowed_now()  # [1, vocab_size] or None: free text
        if allowed is None:
            return scores
        allowed = allowed.to(scores.device)
        width = min(scores.shape[-1], allowed.shape[-1])
        out = scores.clone()
        out[:, :width] = scores[:, :width].masked_fill(~allowed[:, :width], float("-inf"))
        out[:, width:] = float("-inf")
        return out
