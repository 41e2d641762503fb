"""Parent-pointer token trees: children, depths, the 4-D tree attention mask, positions,
sub-drafts, and the common prefix of two token paths.

A draft of ``num_nodes`` nodes is scored together with the last committed token (the root,
row 0). Node ``i`` sits in row ``i + 1`` and attends to the whole committed past, the root,
and its own ancestors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from agentspec.types import Draft


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (the depth at which two paths part)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def sub_draft(draft: Draft, keep: Sequence[int]) -> Draft:
    """The draft of the nodes ``keep``, in that order, each one's parent kept before it;
    parents, per-node sources, ``draft_probs`` rows and support counts follow the nodes to
    their new indices; the acceptance class stays."""
    keep = list(keep)
    if keep == list(range(draft.num_nodes)):
        return draft
    remap = {old: new for new, old in enumerate(keep)}
    parents = tuple(-1 if draft.parents[i] < 0 else remap[draft.parents[i]] for i in keep)
    source = draft.source if isinstance(draft.source, str) else tuple(draft.source[i] for i in keep)
    probs = None if draft.draft_probs is None else draft.draft_probs[keep]
    support = None if draft.support is None else tuple(draft.support[i] for i in keep)
    return Draft(tuple(draft.token_ids[i] for i in keep), parents, source, probs, support,
                 draft.acceptance)


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node; children of the root have depth 1."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def child_index(token_ids: Sequence[int], parents: Sequence[int]) -> dict[tuple[int, int], int]:
    """``(parent, token_id) -> node``: the lookup a verification walk needs."""
    index: dict[tuple[int, int], int] = {}
    for node, (tok, par) in enumerate(zip(token_ids, parents, strict=True)):
        key = (par, tok)
        if key in index:
            raise ValueError(f"sibling token ids must be distinct: token {tok} twice under parent {par}")
        index[key] = node
    return index


def spine_length(parents: Sequence[int]) -> int:
    """Length of the draft's spine: the longest prefix of nodes that forms a chain
    (``parents[i] == i - 1``). A spine node's row sits at its own position in the KV; the
    target computes its logits bitwise as plain decoding would (see :mod:`agentspec.engine.forward`)."""
    for i, p in enumerate(parents):
        if p != i - 1:
            return i
    return len(parents)


def spine_prefix(parents: Sequence[int], path: Sequence[int]) -> int:
    """How many leading nodes of an accepted ``path`` lie on the draft's spine, in order: the
    part of a verdict whose rows decide more than one token (``verify.cut_at_spine``)."""
    spine = spine_length(parents)
    for j, node in enumerate(path):
        if node != j or j >= spine:
            return j
    return len(path)


def preorder(parents: Sequence[int]) -> list[int]:
    """Nodes in depth-first preorder, children in index order: the first child of every node
    follows it, so the path of first children becomes the spine."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    order: list[int] = []
    stack = list(reversed(children.get(-1, [])))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children.get(node, [])))
    return order


def ancestor_matrix(parents: Sequence[int]) -> np.ndarray:
    """``[num_nodes, num_nodes]`` bool: ``m[i, j]`` when ``j`` is ``i`` or one of its ancestors."""
    n = len(parents)
    m = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i, : p + 1] = m[p, : p + 1]
        m[i, i] = True
    return m


def tree_attention_mask(parents: Sequence[int], past_len: int, device: torch.device | str) -> torch.Tensor:
    """Boolean 4-D mask ``[1, 1, num_nodes + 1, past_len + num_nodes + 1]``, True = attend.

    ``past_len`` counts the tokens already in the KV (the root is not among them).
    """
    n = len(parents)
    mask = np.zeros((n + 1, past_len + n + 1), dtype=bool)
    mask[:, : past_len + 1] = True  # everyone sees the past and the root
    mask[1:, past_len + 1 :] = ancestor_matrix(parents)
    return torch.from_numpy(mask).to(device)[None, None]


def tree_position_ids(parents: Sequence[int], root_position: int, device: torch.device | str) -> torch.Tensor:
    """``[1, num_nodes + 1]``: the root at ``root_position``, each node at root + depth."""
    pos = [root_position] + [root_position + d for d in depths(parents)]
    return torch.tensor(pos, dtype=torch.long, device=device)[None]


def node_support(token_ids: Sequence[int], parents: Sequence[int],
                 continuations: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """Per node of a tree, how many of ``continuations`` spell the path from the root to it
    (at least 1 for every node: a node no continuation reaches, as after a budget cut,
    counts as its own one). Equal continuations are walked once, weighted by how many there
    are (a suffix's occurrences mostly repeat one continuation)."""
    index = child_index(token_ids, parents)
    counts = [0] * len(token_ids)
    for cont, weight in Counter(map(tuple, continuations)).items():
        node = -1
        for tok in cont:
            node = index.get((node, tok), -1)
            if node < 0:
                break
            counts[node] += weight
    return tuple(max(c, 1) for c in counts)


def merge_chains(chains: list[tuple[list[int], str]], max_nodes: int) -> tuple[list[int], list[int], list[str]]:
    """Merge candidate continuations into one prefix tree, best candidate first.

    Shared prefixes become shared nodes; nodes are added in candidate order until ``max_nodes``.

    Returns:
        ``(token_ids, parents, sources)`` of the tree's nodes.
    """
    token_ids: list[int] = []
    parents: list[int] = []
    sources: list[str] = []
    index: dict[tuple[int, int], int] = {}
    for tokens, source in chains:
        node = -1
        for tok in tokens:
            child = index.get((node, tok))
            if child is None:
                if len(token_ids) >= max_nodes:
                    break
                child = len(token_ids)
                index[(node, tok)] = child
                token_ids.append(tok)
                parents.append(node)
                sources.append(source)
            node = child
    return token_ids, parents, sources
