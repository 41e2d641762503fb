"""Logits to probabilities: temperature, top-k, top-p. The ONE place this happens.

The verifier and the plain baseline both call :func:`logits_to_probs`, so the distribution the
verifier preserves is, by construction, the distribution plain decoding samples from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from agentspec.config import SamplingParams
from agentspec.types import TokenLogprob


class RowMasks(Protocol):
    """A grammar's masks of a step's rows, computed on demand
    (:class:`agentspec.grammar.state.LazyMasks`)."""

    def forbidding(self, tokens: Sequence[int]) -> dict[int, torch.Tensor]:
        """``{row: bool [vocab_size] mask}`` for each row whose token the grammar forbids."""
        ...

    def full(self) -> torch.Tensor:
        """Every row's mask, bool ``[num_rows, vocab_size]``."""
        ...


# A grammar's masks: bool ``[num_rows, vocab_size]`` (True = allowed), on demand, or None.
Mask = torch.Tensor | RowMasks | None


def apply_mask(logits: torch.Tensor, allowed: Mask) -> torch.Tensor:
    """``logits`` ``[num_rows, vocab_size]`` with the tokens a grammar forbids at ``-inf``
    (``allowed``: bool, same shape; None: unconstrained, ``logits`` as they are)."""
    if allowed is None:
        return logits
    if not isinstance(allowed, torch.Tensor):
        allowed = allowed.full()
    return logits.masked_fill(~allowed, float("-inf"))


def greedy_tokens(logits: torch.Tensor, allowed: Mask = None) -> torch.Tensor:
    """The argmax of each row among its allowed tokens -> ``[num_rows]`` (on device).

    With masks on demand (:class:`RowMasks`) only rows whose plain argmax the grammar forbids
    are masked: where the grammar allows a row's argmax (the first maximum of the row), it is
    also the first maximum among the allowed tokens, so the result is the same."""
    if allowed is None or isinstance(allowed, torch.Tensor):
        return apply_mask(logits, allowed).argmax(dim=-1)
    return torch.tensor(greedy_host(logits, allowed), device=logits.device)


def greedy_host(logits: torch.Tensor, allowed: Mask = None) -> list[int]:
    """:func:`greedy_tokens` as a host list, in one device-to-host copy: with masks on demand
    the rows' argmax come over once and only a row whose argmax the grammar forbids is
    masked and copied again (the verifier's path: it walks the draft on the host)."""
    if allowed is None or isinstance(allowed, torch.Tensor):
        return greedy_tokens(logits, allowed).tolist()
    top = logits.argmax(dim=-1).tolist()
    for row, mask in allowed.forbidding(top).items():
        top[row] = int(logits[row].masked_fill(~mask, float("-inf")).argmax())
    return top


def logits_to_probs(logits: torch.Tensor, sampling: SamplingParams,
                    allowed: Mask = None) -> torch.Tensor:
    """Processed target distribution, row by row.

    Order as in vLLM and SGLang: the grammar's mask first (``allowed``), then as transformers'
    warpers: temperature, top-k, top-p (the smallest set of most likely tokens whose mass
    reaches ``top_p``; the most likely token always stays).

    Args:
        logits: ``[num_rows, vocab_size]`` raw logits.
        sampling: must have ``temperature > 0`` (greedy decoding takes the argmax instead).
        allowed: bool ``[num_rows, vocab_size]``, the grammar's mask per row, or None.

    Returns:
        float32 probabilities ``[num_rows, vocab_size]``, each row summing to 1.
    """
    if sampling.greedy:
        raise ValueError("logits_to_probs needs temperature > 0; greedy decoding uses argmax")
    scores = apply_mask(logits.float(), allowed) / sampling.temperature  # [num_rows, vocab_size]
    if sampling.top_k is not None and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]  # [num_rows, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        # Mass strictly before each token: a token is kept while that is still < top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= sorted_probs.new_tensor(sampling.top_p)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs`` ``[num_rows, vocab_size]`` -> ``[num_rows]`` (on device)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs`` ``[num_rows, vocab_size]`` from its uniform in [0, 1)
    ``[num_rows]``: the first token whose cumulative mass exceeds ``u`` times the row's total
    (float64 sums; a token of zero probability is never drawn). -> ``[num_rows]`` on device."""
    cdf = probs.double().cumsum(dim=-1)  # [num_rows, vocab_size]
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)  # [num_rows, 1]
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return drawn.clamp_max(probs.shape[-1] - 1)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """An explicit generator: the library never seeds torch's global state."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int],
                   top: int) -> tuple[TokenLogprob, ...]:
    """The log-probability of ``tokens[i]`` at row ``rows[i]`` of ``logits``
    ``[num_rows, vocab_size]``, and that row's ``top`` most likely tokens, in one
    device-to-host copy.

    The distribution is the model's own: a float32 log-softmax of the raw logits over the whole
    vocabulary, before any grammar mask, temperature, top-k or top-p, so that the figure
    describes the model rather than the sampler (vLLM's default) and is the same whether the
    token was drawn greedily or sampled. Each row is reduced on its own, so a row's numbers
    are a function of that row's logits only.
    """
    if not tokens:
        return ()
    picked = logits[torch.tensor(list(rows), device=logits.device)].float()  # [n, vocab_size]
    logp = torch.log_softmax(picked, dim=-1)  # [n, vocab_size]
    ids = torch.tensor(list(tokens), device=logits.device)  # [n]
    chosen = logp.gather(1, ids[:, None]).squeeze(1)  # [n]
    if top:
        best = torch.topk(logp, top, dim=-1)  # values, indices: [n, top]
        host = torch.cat([chosen[:, None], best.values, best.indices.float()], dim=1).tolist()
    else:
        host = chosen[:, None].tolist()
    return tuple(TokenLogprob(int(t), row[0], tuple(
        (int(i), v) for v, i in zip(row[1:1 + top], row[1 + top:], strict=True)))
        for t, row in zip(tokens, host, strict=True))
