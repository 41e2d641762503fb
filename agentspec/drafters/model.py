"""A small causal LM as the fallback drafter (Leviathan et al. 2023; Chen et al. 2023).

Two modes, chosen by comparing vocabularies:

* Same tokenizer: the draft model drafts a chain of target token ids autoregressively. Under
  sampling it draws each token from q, its own distribution processed with the request's
  :class:`~agentspec.config.SamplingParams` (:func:`agentspec.decoding.sampling.logits_to_probs`), and
  attaches q as ``draft_probs``: the verifier runs the ratio test. Greedy drafts are argmaxes
  without probabilities: the point-mass walk.
* Different tokenizer: the draft model continues the text greedily from its own encoding of
  the target's context; the drafted text is re-tokenized with the target's tokenizer and
  verified as a point-mass draft, which is exact whatever the draft is.

The draft model runs on an engine of its own (a second :class:`~agentspec.engine.target.HFTarget`),
where the drafter keeps one sequence, in step with the target lazily: each proposal truncates
it to the longest prefix it shares with the committed context, then feeds the missing tokens
in one forward.
"""

from __future__ import annotations

from typing import Any

import torch

from agentspec.decoding.sampling import logits_to_probs
from agentspec.engine.plan import draft_member
from agentspec.engine.target import HFTarget
from agentspec.protocols import DraftContext
from agentspec.tree import common_prefix_len
from agentspec.types import EMPTY_DRAFT, Draft, Verdict

_TAIL_TOKENS = 4  # target tokens re-encoded with the drafted text, to align token boundaries


def same_vocabulary(a: Any, b: Any) -> bool:
    """True when two tokenizers map the same strings to the same ids."""
    return bool(a.get_vocab() == b.get_vocab())


class ModelDrafter:
    """Drafts with a small causal LM; goes last in a :class:`~agentspec.drafters.chain.DrafterChain`.

    Args:
        draft_target: the draft model's engine (an ``HFTarget``): the drafter keeps one
            sequence of its pool.
        target_tokenizer: the target's tokenizer; equal vocabularies select token drafting,
            different ones text drafting.
        max_draft: draft tokens per proposal (the chain trims further by expected rate).
        min_confidence: stop drafting when the draft model's top probability falls below this
            (decided from q before sampling, so the chain length never depends on a drawn token).
        sampling_aware: under sampling, draw from q and attach it for the ratio test; False
            drafts argmaxes as point masses (exact too, usually accepted less often).
    """

    name = "model"

    def __init__(self, draft_target: HFTarget, target_tokenizer: Any, *, max_draft: int = 6,
                 min_confidence: float = 0.3, sampling_aware: bool = True) -> None:
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.draft = draft_target
        self.target_tokenizer = target_tokenizer
        self.max_draft = max_draft
        self.min_confidence = min_confidence
        self.sampling_aware = sampling_aware
        self.same_tokenizer = same_vocabulary(draft_target.tokenizer, target_tokenizer)
        self.target_vocab = len(target_tokenizer)
        # The draft KV: one sequence, shared by the requests (each proposal syncs it to its
        # own context); its ids are the draft-model tokens whose rows it holds.
        self._seq = draft_target.new_sequence()

    @property
    def fed(self) -> int:
        """Draft-model tokens whose rows its KV holds now."""
        return self._seq.kv_len

    def begin(self, context: DraftContext) -> None:
        self._prompt_ids(context)

    def _prompt_ids(self, context: DraftContext) -> list[int]:
        """Cross-tokenizer: this request's prompt in draft-model ids (per request)."""
        def make() -> list[int]:
            if self.same_tokenizer:
                return []
            return self._encode_draft(self.target_tokenizer.decode(context.tokens[: context.prompt_len]))

        return context.state(self, make)

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        n = min(max_tokens, self.max_draft)
        if n <= 0:
            return EMPTY_DRAFT
        if self.same_tokenizer:
            return self._propose_tokens(context, n)
        return self._propose_text(context, n)

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        pass  # the KV is cropped to the committed prefix on the next proposal

    def end(self, context: DraftContext) -> None:
        pass  # the draft KV stays: the next request keeps the prefix it shares

    # -- same tokenizer -------------------------------------------------------------------

    def _propose_tokens(self, context: DraftContext, n: int) -> Draft:
        sampling = context.sampling
        with_probs = self.sampling_aware and sampling is not None and not sampling.greedy
        logits = self._sync(context.tokens)  # [vocab_size]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        while True:
            logits = self._to_target_vocab(logits)
            if with_probs:
                assert sampling is not None
                q = logits_to_probs(logits[None], sampling)[0]  # [target vocab_size]
                if tokens and float(q.max()) < self.min_confidence:
                    break
                tok = _draw(q, context.generator)
                rows.append(q)
            else:
                if tokens and float(logits.softmax(-1).max()) < self.min_confidence:
                    break
                tok = int(logits.argmax())
            tokens.append(tok)
            if len(tokens) == n:
                break
            logits = self._feed([tok])
        return Draft.chain(tokens, self.name, torch.stack(rows) if with_probs else None)

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's ids: extra ids cut, missing ones at -inf (q is
        whatever distribution the draft token is really drawn from, so this stays exact)."""
        v = self.target_vocab
        if logits.shape[-1] >= v:
            return logits[:v]
        pad = logits.new_full((v - logits.shape[-1],), float("-inf"))
        return torch.cat([logits, pad])

    # -- different tokenizers ---------------------------------------------------------------

    def _propose_text(self, context: DraftContext, n: int) -> Draft:
        generated = self.target_tokenizer.decode(context.generated)
        logits = self._sync(self._prompt_ids(context) + self._encode_draft(generated))
        drafted: list[int] = []
        # The draft model's tokens are usually shorter than the target's: draft a few more.
        for _ in range(n + 2):
            if drafted and float(logits.softmax(-1).max()) < self.min_confidence:
                break
            drafted.append(int(logits.argmax()))
            logits = self._feed([drafted[-1]])
        text = self.draft.tokenizer.decode(drafted)
        ids = self._retokenize(context.tokens, text)
        # The last piece may be a word cut short: the target would tokenize it differently.
        return Draft.chain(ids[: min(n, max(len(ids) - 1, 1))], self.name) if ids else EMPTY_DRAFT

    def _retokenize(self, tokens: list[int], text: str) -> list[int]:
        """Target ids of ``text`` as it continues ``tokens``: the tail is re-encoded with it and
        stripped again, so the first drafted token follows the target's own boundaries."""
        tail = tokens[-_TAIL_TOKENS:]
        ids = self.target_tokenizer(self.target_tokenizer.decode(tail) + text,
                                    add_special_tokens=False)["input_ids"]
        if ids[: len(tail)] == tail:
            return list(ids[len(tail) :])
        return list(self.target_tokenizer(text, add_special_tokens=False)["input_ids"])

    def _encode_draft(self, text: str) -> list[int]:
        return list(self.draft.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    # -- the draft model's KV -----------------------------------------------------------------

    def _sync(self, ids: list[int]) -> torch.Tensor:
        """Bring the draft KV to exactly ``ids`` and return the logits after them ``[vocab]``.

        Keeps the longest shared prefix (at least one token is fed, for its logits)."""
        keep = min(common_prefix_len(self._seq.ids, ids), len(ids) - 1)
        self._seq.truncate(keep)
        return self._feed(ids[keep:])

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Append ``ids`` to the draft KV, one forward per widest width of the draft model;
        logits after the last ``[vocab]``."""
        width = self.draft.max_draft_nodes + 1
        last = None
        for start in range(0, len(ids), width):
            piece = ids[start : start + width]
            chain = Draft.chain(piece[1:], self.name)
            last = self.draft.run([draft_member(self._seq, piece[0], chain)])[0]
            self._seq.commit(piece[0], Verdict.chain(piece[1:]))
        assert last is not None  # [len(piece), vocab_size]: at least one token is fed
        return last[-1].float()


def _draw(q: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from q ``[vocab_size]`` with the request's generator (on its device)."""
    if generator is not None and generator.device != q.device:
        q = q.to(generator.device)
    return int(torch.multinomial(q, 1, generator=generator))
