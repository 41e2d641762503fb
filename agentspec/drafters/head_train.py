"""Training the draft head from the completion memory: distillation from the target.

Every stored completion of a scope is replayed through the target (its request re-encoded,
then the completion), giving at each position the target's final hidden state and its
distribution over the next token. The head (:class:`~agentspec.drafters.head.RecurrentHead`)
learns, from the hidden row that predicted a committed token and that token, to predict the
next ``depth`` tokens, each by the KL divergence from the target's distribution at that
position (restricted to the head's vocabulary) to the head's q; inputs past the first are
the completion's own tokens (teacher forcing). Replays reuse the KV of the longest prefix
shared with the record before (an agent's calls share their system prompt and earlier turns).

A tenth of the records (at least one) is held out, whole groups of equal completions at a
time (an agent repeats itself under many requests; a copy on both sides would be measured on
what was trained), and the vocabulary is the training records' only. The head's acceptance
per depth is measured on the held-out records as the greedy decode loop would see it: the
head's best beam against the target's own greedy tokens (over its whole vocabulary).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentspec.drafters.head import RecurrentHead, beam_search
from agentspec.text import encode_prompt
from agentspec.tree import child_index
from agentspec.types import Record

Progress = Callable[[int, int, str], None]
# A record's kept rows, (tokens [L + 1], rows [L, hidden]), or None (see head_rows).
RowsOf = Callable[[Record], "tuple[torch.Tensor, torch.Tensor] | None"]


@dataclass(frozen=True)
class TrainConfig:
    """How to train. ``depth`` is the deepest token the head learns to draft.

    ``epochs`` passes over the training starts, cut at ``max_steps`` optimiser steps: a
    large memory needs fewer passes, and the distillation's time stays bounded.
    ``max_context``: records longer than this (prompt and completion) are left out; None:
    the target's own context."""

    depth: int = 6
    epochs: int = 8
    lr: float = 2e-3
    batch_starts: int = 64
    held_out: float = 0.1
    max_context: int | None = None
    max_steps: int = 1500
    seed: int = 0

    def __post_init__(self) -> None:
        if self.depth < 1 or self.epochs < 1 or self.batch_starts < 1 or self.max_steps < 1:
            raise ValueError(f"depth, epochs, batch_starts and max_steps must be >= 1, got "
                             f"{self.depth}, {self.epochs}, {self.batch_starts}, {self.max_steps}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be >= 2 or None, got {self.max_context}")
        if not 0.0 <= self.held_out < 1.0:
            raise ValueError(f"held_out must be in [0, 1), got {self.held_out}")


@dataclass
class Replayed:
    """One completion replayed: ``tokens`` = the last prompt token then the completion;
    ``hidden[i]`` the target's final hidden state at the row that predicted ``tokens[i]``;
    ``logp[i]`` the target's log-distribution over the head's vocabulary after ``tokens[i]``."""

    tokens: torch.Tensor  # [L + 1]
    hidden: torch.Tensor  # [L + 1, hidden]
    logp: torch.Tensor  # [L + 1, V] float16
    kept_rows: bool = False  # from the decode loop's kept rows (no forward)


@dataclass
class TrainResult:
    head: RecurrentHead
    stats: dict[str, Any] = field(default_factory=dict)


def prompt_of(record: Record) -> Any:
    """The request a record was generated for: messages (stored as JSON) or a raw prompt."""
    try:
        value = json.loads(record.request_text)
    except ValueError:
        return record.request_text
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return value
    return record.request_text


def vocabulary(records: Sequence[Record], tokenizer: Any, old: Sequence[int] = ()) -> torch.Tensor:
    """The ids the head may draft: ``old`` first (a retrained head keeps its order), then
    every id in the completions, then the tokenizer's end-of-sequence ids."""
    ids = list(dict.fromkeys([*old, *(t for r in records for t in r.completion_ids)]))
    for tok in (getattr(tokenizer, "eos_token_id", None),):
        if isinstance(tok, int) and tok not in ids:
            ids.append(tok)
    return torch.tensor(ids, dtype=torch.long)


@torch.inference_mode()
def replay(model: Any, tokenizer: Any, records: Sequence[Record], vocab: torch.Tensor, *,
           max_context: int | None = None, progress: Progress | None = None,
           known: dict[int, Replayed] | None = None,
           rows_of: RowsOf | None = None, sort: bool = True) -> list[Replayed]:
    """Run each record through the target (transformers' own forward; training needs no
    fixed shapes), reusing the KV of the prefix shared with the record before.

    Records are run in the order of their token ids, not the store's: sorted, each shares the
    longest prefix any record can with the one run before it (a depth-first walk of their
    prefix trie), so a token is run once per distinct prefix. A multi-turn agent's
    conversations interleave in a memory; on 329 file-system calls the store's order ran
    128k tokens through the target, sorted 39k. Returned in ``records``' order. ``sort=False``
    runs them in the given order (the baseline of ``python -m agentspec.bench.head_replay``).

    ``known``: replays by record id, over the same ``vocab`` (taken as they are; the new
    ones are added to it), so retraining replays only the records it has not seen.
    ``rows_of``: the decode loop's own hidden rows of a record where they were kept
    (:mod:`agentspec.drafters.head_rows`): such a record needs no forward (see
    :func:`from_rows`)."""
    from agentspec.engine import compat

    if max_context is None:
        max_context = int(getattr(model.config, "max_position_embeddings", 2048))
    done: dict[int, Replayed] = {}  # by index into records
    # only the head's vocabulary rows of the output embedding: the distributions are taken
    # over it anyway, and the full 49k-262k-row product would dominate a replay
    out_rows = model.get_output_embeddings().weight[vocab]  # [V, hidden]
    out_bias = getattr(model.get_output_embeddings(), "bias", None)
    out_bias = None if out_bias is None else out_bias[vocab]

    def keep(n: int, item: Replayed) -> None:
        done[n] = item
        record_id = records[n].id
        if known is not None and record_id is not None:
            known[record_id] = item

    todo: list[tuple[list[int], int, int]] = []  # (prompt + completion ids, prompt length, n)
    for n, record in enumerate(records):
        if known is not None and record.id is not None and record.id in known:
            done[n] = known[record.id]
            continue
        kept = rows_of(record) if rows_of is not None else None
        if kept is not None and kept[1].shape[0] >= 2:
            keep(n, from_rows(*kept, out_rows, out_bias))
            continue
        prompt = encode_prompt(tokenizer, prompt_of(record))
        ids = prompt + list(record.completion_ids)
        if len(prompt) >= 2 and record.completion_ids and len(ids) <= max_context:
            todo.append((ids, len(prompt), n))
    if sort:
        todo.sort(key=lambda item: item[0])
    cache: Any = None
    held: list[int] = []
    for step, (ids, prompt_len, n) in enumerate(todo):
        if progress is not None:
            progress(step, len(todo), "replaying completions through the target")
        first = prompt_len - 2  # the row that predicted the last prompt token
        shared = 0
        while shared < min(len(held), first) and held[shared] == ids[shared]:
            shared += 1
        if cache is None or shared == 0:
            cache, shared = compat.new_dynamic_cache(), 0
        else:
            compat.crop_cache(cache, shared)
        hidden = compat.base_model(model)(input_ids=torch.tensor([ids[shared:]]), past_key_values=cache,
                             use_cache=True).last_hidden_state[0, first - shared :]  # [L + 1, hidden]
        held = ids
        # after the last prompt token, ..., after the last completion token
        logp = _restricted_logp(hidden[1:], out_rows, out_bias)  # [L + 1, V]
        tokens = torch.tensor(ids[prompt_len - 1 :])  # [L + 1]
        keep(n, Replayed(tokens, hidden[:-1].float().clone(), logp))
    if progress is not None:
        progress(len(todo), len(todo), "replaying completions through the target")
    return [done[n] for n in sorted(done)]


def from_rows(tokens: torch.Tensor, rows: torch.Tensor, out_rows: torch.Tensor,
              out_bias: torch.Tensor | None = None) -> Replayed:
    """A replay from kept rows: ``tokens`` = the last prompt token then the completion
    (``L + 1``), ``rows[i]`` the row that processed ``tokens[i]`` (``L`` rows). The row that
    predicted the last prompt token is not kept, so the replay starts one token later:
    tokens ``1 .. L - 1``, each with the row that predicted it and the distribution after it
    (from the next row), over the vocabulary rows ``out_rows``."""
    hidden = rows.to(out_rows.dtype)
    logp = _restricted_logp(hidden[1:], out_rows, out_bias)  # [L - 1, V]
    return Replayed(tokens[1:-1].clone(), hidden[:-1].float().clone(), logp, True)


@torch.inference_mode()
def _restricted_logp(hidden: torch.Tensor, out_rows: torch.Tensor,
                     out_bias: torch.Tensor | None) -> torch.Tensor:
    """The target's log-distribution over the head's vocabulary after each hidden row,
    float16: only the vocabulary's rows of the output embedding are multiplied."""
    logits = torch.nn.functional.linear(hidden, out_rows, out_bias)
    return torch.log_softmax(logits.float(), dim=-1).half()


class _Starts:
    """Every training start of the replays, laid out once: start ``g`` (a flat row index)
    takes ``h = hidden[g]`` and inputs/targets at rows ``g .. g + depth - 1``, clipped to its
    record's last row (``mask`` False past it)."""

    def __init__(self, data: Sequence[Replayed], depth: int) -> None:
        self.depth = depth
        self.starts = self.last = torch.zeros(0, dtype=torch.long)
        if not data:  # every record dropped or held out: nothing to train on
            return
        self.hidden = torch.cat([d.hidden for d in data])  # [rows, hidden]
        self.tokens = torch.cat([d.tokens for d in data])  # [rows]
        self.logp = torch.cat([d.logp for d in data])  # [rows, V] float16
        starts, lasts, offset = [], [], 0
        for d in data:
            rows = int(d.tokens.shape[0])
            starts.append(torch.arange(offset, offset + rows - 1))
            lasts.append(torch.full((rows - 1,), offset + rows - 1))
            offset += rows
        self.starts, self.last = torch.cat(starts), torch.cat(lasts)

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    def batch(self, which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
        """(h [B, hidden], inputs [B, depth], targets [B, depth, V], mask [B, depth])."""
        g = self.starts[which]
        ahead = g[:, None] + torch.arange(self.depth)  # [B, depth]
        last = self.last[which][:, None]
        rows = torch.minimum(ahead, last)
        return self.hidden[g], self.tokens[rows], self.logp[rows].float(), ahead <= last


def distill_loss(head: RecurrentHead, h: torch.Tensor, inputs: torch.Tensor,
                 targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over (start, depth) of KL(p || q): p the target's restricted distribution."""
    state = torch.zeros_like(h)
    total = torch.zeros(())
    for k in range(inputs.shape[1]):
        state, logits = head.step(state, inputs[:, k], h)
        logq = torch.log_softmax(logits, dim=-1)  # [B, V]
        p = targets[:, k].exp()
        kl = (p * (targets[:, k] - logq)).sum(-1)  # [B]
        total = total + (kl * mask[:, k]).sum()
    return total / mask.sum().clamp_min(1)


@torch.inference_mode()
def acceptance_by_depth(head: RecurrentHead, data: Sequence[Replayed], *, width: int = 4,
                        depth: int = 6) -> dict[str, Any]:
    """Held-out acceptance as the greedy loop sees it: at each start, the head's best beam
    against the target's own greedy tokens along the record, each the argmax of the target's
    whole output embedding at its row (not of the head's vocabulary: a token the head cannot
    draft is a miss). ``rate[k]``: P(token k accepted | tokens before it were);
    ``mean_accepted``: accepted draft tokens per step.

    ``tree_accepted``: accepted tokens per step if the walk could go down every branch of the
    merged beam tree, not only its best beam. The decode loop stops at the first node off the
    spine (``verify.cut_at_spine``: an off-spine row does not attend the slots plain decoding
    would), so this is what verifying whole trees exactly would be worth, not what a step gets."""
    reached = [0] * (depth + 1)
    steps = in_tree = 0
    for item in data:
        # the target's greedy token after tokens[i] is the argmax at row i + 1 (which
        # predicted tokens[i + 1]): [L] full-vocabulary ids
        greedy = (item.hidden[1:] @ head.out_embed.T).argmax(-1).tolist()
        n = len(greedy)
        for j in range(n):
            tree = beam_search(head, item.hidden[j], int(item.tokens[j]), width=width,
                               depth=min(depth, n - j))
            beam = tree.token_ids[: tree.spine]
            k = 0
            while k < len(beam) and beam[k] == greedy[j + k]:
                k += 1
            steps += 1
            for d in range(k + 1):
                reached[d] += 1
            children = child_index(tree.token_ids, tree.parents)
            node, walked = -1, 0
            while j + walked < n and (node, greedy[j + walked]) in children:
                node = children[(node, greedy[j + walked])]
                walked += 1
            in_tree += walked
    rate = [reached[d] / reached[d - 1] if reached[d - 1] else 0.0 for d in range(1, depth + 1)]
    return {"steps": steps, "rate": rate,
            "mean_accepted": sum(reached[1:]) / steps if steps else 0.0,
            "tree_accepted": in_tree / steps if steps else 0.0, "width": width}


def split_held_out(records: Sequence[Record], fraction: float,
                   rng: random.Random) -> tuple[list[Record], list[Record]]:
    """``(train, held)``: at most ``fraction`` of the records held out (at least one group),
    whole groups of equal completions at a time, in random order. An agent says the same
    thing under many requests ("file not found"); a completion on both sides would be
    measured on what the head was trained on."""
    keys_of = [tuple(record.completion_ids) for record in records]
    groups: dict[tuple[int, ...], list[Record]] = {}
    for key, record in zip(keys_of, records, strict=True):
        groups.setdefault(key, []).append(record)
    if fraction <= 0 or len(groups) < 2:
        return list(records), []
    want = max(1, int(len(records) * fraction))
    keys = list(groups)
    rng.shuffle(keys)
    held: set[tuple[int, ...]] = set()
    count = 0
    for key in keys:  # in random order, each group that still fits in the share
        if count + len(groups[key]) <= want:
            held.add(key)
            count += len(groups[key])
    if not held:  # every group is larger than the share: the smallest one
        held.add(min(keys, key=lambda k: len(groups[k])))
    return ([r for r, key in zip(records, keys_of, strict=True) if key not in held],
            [r for r, key in zip(records, keys_of, strict=True) if key in held])


def train_head(model: Any, tokenizer: Any, records: Sequence[Record], *,
               config: TrainConfig = TrainConfig(), init: RecurrentHead | None = None,
               progress: Progress | None = None,
               replayed: dict[int, Replayed] | None = None,
               rows_of: RowsOf | None = None) -> TrainResult:
    """Distil a head from ``records`` (of one scope and model), starting from ``init``.

    ``replayed``: earlier replays by record id over ``init``'s vocabulary (see :func:`replay`);
    used only when the vocabulary is unchanged, and filled with the new ones. ``rows_of``:
    kept hidden rows, used instead of a replay (:func:`replay`)."""
    if not records:
        raise ValueError("no completions to train on: the memory has none for this scope and model")
    started = time.perf_counter()
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    old = init.vocab.tolist() if init is not None else []
    train_records, held_records = split_held_out(records, config.held_out, rng)
    # the vocabulary of what is trained on: a held-out token outside it is a miss, as a
    # token of a request never seen is while drafting
    vocab = vocabulary(train_records, tokenizer, old)
    if replayed is not None and (init is None or vocab.tolist() != old):
        replayed.clear()  # replays over another vocabulary: their distributions do not fit
    train = replay(model, tokenizer, train_records, vocab, max_context=config.max_context,
                   progress=progress, known=replayed, rows_of=rows_of)
    held = replay(model, tokenizer, held_records, vocab, max_context=config.max_context,
                  known=replayed, rows_of=rows_of)
    replay_s = time.perf_counter() - started
    embed = model.get_input_embeddings().weight.detach().float()
    out = model.get_output_embeddings().weight.detach().float()
    head = RecurrentHead(embed, out, vocab)
    if init is not None:
        head.load_state_dict(init.param_tensors())
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    starts = _Starts(train, config.depth)
    per_epoch = max(1, math.ceil(len(starts) / config.batch_starts))
    total_batches = min(config.epochs * per_epoch, config.max_steps) if len(starts) else 0
    shuffle = torch.Generator().manual_seed(config.seed)
    done, losses = 0, []
    while done < total_batches:
        shuffled = torch.randperm(len(starts), generator=shuffle)
        for b in range(0, len(starts), config.batch_starts):
            if done >= total_batches:
                break
            loss = distill_loss(head, *starts.batch(shuffled[b : b + config.batch_starts]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            done += 1
            if progress is not None:
                progress(done, total_batches, f"distilling (KL {losses[-1]:.3f})")
    head.eval()
    acceptance = acceptance_by_depth(head, held, depth=config.depth) if held else {}
    stats = {
        "records": len(records), "replayed": len(train) + len(held),
        "from_kept_rows": sum(d.kept_rows for d in (*train, *held)), "train_records": len(train),
        "held_out_records": len(held), "vocab": int(vocab.shape[0]),
        "positions": sum(d.tokens.shape[0] - 1 for d in train),
        "epochs": round(done / per_epoch, 2) if len(starts) else 0, "steps": done,
        "depth": config.depth,
        "final_kl": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "replay_seconds": round(replay_s, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "held_out_acceptance": acceptance,
        "max_record_id": max((r.id or 0) for r in records),
    }
    return TrainResult(head, stats)
