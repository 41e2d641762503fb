"""A recurrent draft head over the target's last hidden state (ReDrafter, Zhang et al. 2024).

One small recurrent network drafts the next tokens from the target's final hidden state
``h`` (the input of its output embedding, at the row that predicted the last committed
token) and the embedding of that token::

    s_k = silu(W x_k + U s_{k-1} + b)         x_k: the k-th input token's embedding, s_0 = 0
    z_k = h + M [s_k; h]                      M zero at initialisation
    logits_k = z_k E_V^T                      E_V: the target's output embedding, rows V only

``V`` is the vocabulary the scope's completions use (a few hundred to a few thousand ids),
so drafting costs a few small products, not a pass over the 49k-262k row output embedding.
The parameters (``W``, ``U``, ``b``, ``M``) do not depend on ``V``: a retrained head may
use a larger vocabulary and keep its weights. Trained by
:mod:`agentspec.drafters.head_train` (distilled from the target on the memory's completions).

Drafting (:class:`HeadDrafter`):

* greedy (and by default under sampling): beam search of width ``w`` and depth ``d`` over
  log q; the beams merged into one prefix tree, best beam first, so its path is the spine.
  A deterministic draft is a point-mass draft: the walk is exact for it whatever q is.
  The engine decides tokens only along the spine (an accepted off-spine node ends the step
  with its token, which is the recovered token the spine's rejection would give anyway), so
  by default only the best beam is proposed (``branches=False``): alternatives cost width
  and cannot add tokens.
* under sampling with ``sampling_aware=True``: a chain drawn from q, processed with the
  request's :class:`~agentspec.config.SamplingParams`, with q attached as ``draft_probs``:
  Leviathan et al.'s ratio test (the token must really be drawn from the q it carries, so
  beam-searched tokens never carry q).

A head that is missing, or trained for another model, drafts nothing: the drafter is absent.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agentspec.decoding.sampling import logits_to_probs
from agentspec.home import agentspec_home
from agentspec.protocols import DraftContext
from agentspec.types import EMPTY_DRAFT, Draft, Verdict

FORMAT_VERSION = 1


class RecurrentHead(nn.Module):
    """The head's parameters and one recurrent step; the embeddings are the target's (frozen).

    Args:
        embed: the target's input embedding ``[vocab_size, hidden]`` (rows looked up per token).
        out_embed: the target's output embedding ``[vocab_size, hidden]``.
        vocab: the token ids the head can draft ``[V]``.
    """

    def __init__(self, embed: torch.Tensor, out_embed: torch.Tensor, vocab: torch.Tensor) -> None:
        super().__init__()
        hidden = int(embed.shape[1])
        self.hidden = hidden
        self.w_in = nn.Linear(hidden, hidden)
        self.u = nn.Linear(hidden, hidden, bias=False)
        self.mix = nn.Linear(2 * hidden, hidden)
        nn.init.zeros_(self.mix.weight)
        nn.init.zeros_(self.mix.bias)
        nn.init.normal_(self.u.weight, std=0.5 / hidden**0.5)
        self.embed = embed.detach()
        self.out_embed = out_embed.detach()
        self.set_vocab(vocab)

    def set_vocab(self, vocab: torch.Tensor) -> None:
        """Draft from ``vocab`` (ids, ``[V]``) from now on."""
        self.vocab = vocab.to(torch.long).detach()  # [V]
        self.out_rows = self.out_embed[self.vocab].detach()  # [V, hidden]

    def step(self, state: torch.Tensor, tokens: torch.Tensor,
             h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``state`` ``[B, hidden]``, input ``tokens`` ``[B]`` (target ids), ``h`` ``[B, hidden]``
        -> (next state ``[B, hidden]``, logits over the vocabulary ``[B, V]``)."""
        s = torch.nn.functional.silu(self.w_in(self.embed[tokens]) + self.u(state))
        z = h + self.mix(torch.cat([s, h], dim=-1))  # [B, hidden]
        return s, z @ self.out_rows.T

    def param_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}


@dataclass(frozen=True)
class BeamTree:
    """The merged beams: a draft tree (best beam = first-child path) and each node's q."""

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    q: tuple[float, ...]  # q(token | parent's path) per node
    spine: int  # nodes on the best beam's path (they come first)


@torch.inference_mode()
def beam_search(head: RecurrentHead, h: torch.Tensor, token: int, *, width: int,
                depth: int) -> BeamTree:
    """Beam search of ``width`` beams, ``depth`` tokens, over the head's log q.

    Args:
        h: the target's last hidden state ``[hidden]`` (the row that predicted ``token``).
        token: the last committed token (the first input).
    """
    h1 = h.reshape(1, -1)  # [1, hidden]
    state = torch.zeros(1, head.hidden, dtype=h.dtype)
    tokens = torch.tensor([token])
    scores = torch.zeros(1)  # [beams] sum of log q
    hist = torch.zeros(1, 0, dtype=torch.long)  # [beams, k] vocabulary indices
    cond = torch.zeros(1, 0)  # [beams, k] log q of each token given its prefix
    v = int(head.vocab.shape[0])
    for _ in range(depth):
        beams = tokens.shape[0]
        state, logits = head.step(state, tokens, h1.expand(beams, -1))
        logq = torch.log_softmax(logits.float(), dim=-1)  # [beams, V]
        top = (logq + scores[:, None]).flatten().topk(min(width, beams * v))
        src, idx = top.indices // v, top.indices % v
        state, scores = state[src], top.values
        cond = torch.cat([cond[src], logq[src, idx][:, None]], dim=1)
        hist = torch.cat([hist[src], idx[:, None]], dim=1)
        tokens = head.vocab[idx]
    ids, logq_host = head.vocab[hist].tolist(), cond.exp().tolist()  # one host sync
    return merge_beams(ids, logq_host)


def merge_beams(beams: list[list[int]], q: list[list[float]]) -> BeamTree:
    """Merge token sequences (best first) into one prefix tree; the first beam is the spine."""
    children: dict[tuple[int, int], int] = {}
    token_ids: list[int] = []
    parents: list[int] = []
    node_q: list[float] = []
    for beam, probs in zip(beams, q, strict=True):
        parent = -1
        for tok, prob in zip(beam, probs, strict=True):
            key = (parent, tok)
            if key not in children:
                children[key] = len(token_ids)
                token_ids.append(tok)
                parents.append(parent)
                node_q.append(prob)
            parent = children[key]
    return BeamTree(tuple(token_ids), tuple(parents), tuple(node_q), len(beams[0]) if beams else 0)


# --- Files ----------------------------------------------------------------------------------

def safe_name(text: str) -> str:
    """``text`` as a file or folder name (a fingerprint, a scope)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def head_path(fingerprint: str, scope: str, home: Path | None = None) -> Path:
    """Where the head of a model (fingerprint) and scope lives under ``$AGENTSPEC_HOME``."""
    return (home or agentspec_home()) / "heads" / safe_name(fingerprint) / f"{safe_name(scope)}.safetensors"


def heads_exist(fingerprint: str, home: Path | None = None) -> bool:
    """Whether any scope has a trained head for the model (the drafter is worth adding)."""
    return head_path(fingerprint, "x", home).parent.is_dir()


def save_head(path: Path, head: RecurrentHead, meta: dict[str, Any]) -> None:
    """Write the head's weights, vocabulary and ``meta`` (fingerprint, stats) atomically."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {**head.param_tensors(), "vocab": head.vocab.contiguous()}
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"agentspec_head": json.dumps(
        {"format": FORMAT_VERSION, **meta})})
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def read_meta(path: Path) -> dict[str, Any]:
    """The metadata of a head file (no weights loaded)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("agentspec_head", "{}"))
    return dict(meta)


def load_head(path: Path, model: Any, *, fingerprint: str | None = None) -> RecurrentHead | None:
    """The head in ``path`` on ``model``'s embeddings; None when missing, unreadable or made
    for another model fingerprint (a head that does not fit is simply absent)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        meta = read_meta(path)
        tensors = load_file(str(path))
    except (OSError, ValueError, RuntimeError, SafetensorError):
        return None
    if meta.get("format") != FORMAT_VERSION:
        return None
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        return None
    embed = model.get_input_embeddings().weight.detach().float()
    out = model.get_output_embeddings().weight.detach().float()
    vocab = tensors.pop("vocab")
    if int(vocab.max()) >= out.shape[0] or tensors["w_in.weight"].shape[1] != embed.shape[1]:
        return None
    head = RecurrentHead(embed, out, vocab)
    head.load_state_dict(tensors)
    return head.eval()


# --- The drafter ----------------------------------------------------------------------------

@dataclass
class _Hidden:
    """One request's view: the target's last hidden row and the position it was computed at."""

    h: torch.Tensor | None = None
    position: int = -1  # the position of the token the row processed


class HeadDrafter:
    """Drafts with a trained :class:`RecurrentHead` per scope; absent where none is trained.

    Args:
        target: the :class:`~agentspec.engine.target.HFTarget` (its last hidden rows are read after
            each step; they are used for drafting only, never to decide a token).
        heads: a head per scope; scopes not in it are looked up under ``home``
            (:func:`head_path`) on first use, and again when the file changes (retraining
            writes a new file; generation never waits for it).
        width, depth: beam search width and depth.
        branches: propose the merged beam tree; False (default) its best beam (see the
            module docstring).
        sampling_aware: under sampling draw a chain from q and attach q (ratio test).
    """

    name = "head"
    wants_hidden = True  # the decode loop keeps each step's final hidden rows for it

    def __init__(self, target: Any, heads: dict[str, RecurrentHead] | None = None, *,
                 home: Path | None = None, width: int = 4, depth: int = 6,
                 branches: bool = False, sampling_aware: bool = False) -> None:
        if width < 1 or depth < 1:
            raise ValueError(f"width and depth must be >= 1, got {width}, {depth}")
        self.target = target
        self.width, self.depth = width, depth
        self.branches, self.sampling_aware = branches, sampling_aware
        self.home = home
        self._fixed = dict(heads or {})
        self._files: dict[str, tuple[float, RecurrentHead | None]] = {}

    def head_for(self, scope: str) -> RecurrentHead | None:
        """The head of ``scope``: given, or loaded from its file (reloaded when it changes)."""
        if scope in self._fixed:
            return self._fixed[scope]
        path = head_path(self.target.fingerprint, scope, self.home)
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return None
        known = self._files.get(scope)
        if known is None or known[0] != mtime:
            head = load_head(path, self.target.model, fingerprint=self.target.fingerprint)
            self._files[scope] = (mtime, head)
        return self._files[scope][1]

    def _state(self, context: DraftContext) -> _Hidden:
        return context.state(self, _Hidden)

    def begin(self, context: DraftContext) -> None:
        self.head_for(context.scope)  # a (re)load happens here, before the timed steps

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        state = self._state(context)
        head = self.head_for(context.scope)
        # The row must be the one that processed the token before the last committed one.
        if head is None or state.h is None or state.position != len(context.tokens) - 2:
            return EMPTY_DRAFT
        depth = min(self.depth, max_tokens)
        if depth < 1:
            return EMPTY_DRAFT
        sampling = context.sampling
        if self.sampling_aware and sampling is not None and not sampling.greedy:
            return self._sampled_chain(head, state.h, context, depth)
        tree = beam_search(head, state.h, context.tokens[-1], width=self.width, depth=depth)
        if not self.branches:
            return Draft.chain(tree.token_ids[: tree.spine], self.name)
        return Draft(tree.token_ids, tree.parents, self.name)

    @torch.inference_mode()
    def _sampled_chain(self, head: RecurrentHead, h: torch.Tensor, context: DraftContext,
                       depth: int) -> Draft:
        """A chain drawn from q (processed like the target's p), q attached: the ratio test."""
        assert context.sampling is not None
        vocab_size = int(self.target.vocab_size)
        state = torch.zeros(1, head.hidden)
        token = torch.tensor([context.tokens[-1]])
        toks: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(depth):
            state, logits = head.step(state, token, h.reshape(1, -1))
            full = torch.full((1, vocab_size), float("-inf"))
            full[0, head.vocab] = logits[0].float()
            q = logits_to_probs(full, context.sampling)[0]  # [vocab_size]
            token = torch.multinomial(q, 1, generator=context.generator)
            toks.append(int(token))
            rows.append(q)
        return Draft.chain(toks, self.name, torch.stack(rows))

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        """Keep the hidden row that predicted the step's last token (a spine row)."""
        state = self._state(context)
        hidden, start = context.hidden, context.hidden_position
        # Row 0 is the root; node i is row i + 1 (a verdict's path is on the spine).
        row = verdict.path[-1] + 1 if verdict.path else 0
        if hidden is None or row >= hidden.shape[0]:
            state.h, state.position = None, -1
            return
        state.h = hidden[row].detach().float().clone()
        state.position = start + row

    def end(self, context: DraftContext) -> None:
        pass
