"""Untrusted drafters and their drafts: what reaches the verifier is well formed, and a drafter
that raises costs its drafts for the rest of the call, never the call.

Drafts are heuristics (a stale memory row, a spurious n-gram, a user's plug-in): they may be
wrong, malformed or missing, and the output must not change. :func:`sanitize` turns whatever a
drafter returned into a valid :class:`~agentspec.types.Draft` (possibly empty);
:class:`Guarded` calls a drafter's ``begin``/``propose``/``observe``/``end`` and, the first
time one raises, logs it (once per drafter, on the ``agentspec`` logger) and skips that drafter
for the rest of the call. The decode loop guards its drafter; the drafter chain guards each
source, so one failing source leaves the others drafting.
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from agentspec.protocols import Credits, DraftContext, Drafter, Proposal, StepShare
from agentspec.tree import preorder, sub_draft
from agentspec.types import EMPTY_DRAFT, Draft, Verdict, support_fits

logger = logging.getLogger("agentspec")

# Nodes of one proposal looked at; a forward verifies at most its width (64) anyway, and this
# bounds the host work a huge draft can cost.
MAX_SCAN = 4096
UNNAMED = "untrusted"  # the source of nodes whose drafter gave no usable name


def sanitize(draft: object, *, vocab_size: int | None, room: int, max_nodes: int) -> Draft:
    """A valid draft made of what is usable in ``draft``; never raises.

    Keeps the nodes whose token id is an int in ``[0, vocab_size)`` (any non-negative int when
    ``vocab_size`` is None), whose parent is an earlier kept node (or -1) and whose depth is at
    most ``room``. A node whose parent already has a child with its token is merged into that
    child (its subtree joins the child's), so sibling token ids are distinct. The nodes are put
    in depth-first order (first children form the spine, :func:`~agentspec.tree.preorder`) and
    cut to ``max_nodes``. Fields that do not fit are dropped: token ids and parents of unequal
    lengths are cut to the shorter, a per-node ``source`` of the wrong length becomes one name,
    ``draft_probs`` is kept only as a float ``[num_nodes, vocab_size]`` tensor on a chain
    (otherwise the draft is verified as point masses, which is exact whatever its tokens), and
    ``support`` only as one int >= 1 per node, ``acceptance`` only as a non-empty str.
    Anything that is not a :class:`Draft` is an empty draft.
    """
    if not isinstance(draft, Draft) or room <= 0 or max_nodes <= 0:
        return EMPTY_DRAFT
    if _fits_as_is(draft, vocab_size, min(room, max_nodes, MAX_SCAN)):  # the common case
        return draft
    ids = _ints(draft.token_ids, MAX_SCAN)
    parents = _ints(draft.parents, len(ids))
    ids = ids[: len(parents)]
    total = _length(draft.token_ids)
    sources = _sources(draft.source, total)
    probs = _probs(draft.draft_probs, total, _length(draft.parents), vocab_size)
    support = _support(draft.support, total)
    rep: dict[int, int] = {-1: -1}  # node -> the kept node it is, or was merged into
    depth = {-1: 0}
    child: dict[tuple[int, int], int] = {}  # (kept parent, token) -> kept node
    kept: list[int] = []
    for i, (tok, par) in enumerate(zip(ids, parents, strict=True)):
        if tok is None or tok < 0 or (vocab_size is not None and tok >= vocab_size):
            continue
        if par is None or par not in rep or depth[rep[par]] >= room:  # rep holds earlier nodes
            continue
        parent = rep[par]
        twin = child.get((parent, tok))
        if twin is not None:
            rep[i] = twin
            continue
        child[(parent, tok)] = rep[i] = i
        depth[i] = depth[parent] + 1
        kept.append(i)
    if not kept:
        return EMPTY_DRAFT
    position = {old: new for new, old in enumerate(kept)}
    dense = Draft(tuple(ids[i] for i in kept),  # type: ignore[misc]  # kept ids are ints
                  tuple(-1 if rep[parents[i]] < 0 else position[rep[parents[i]]]  # type: ignore[index]
                        for i in kept),
                  sources if isinstance(sources, str) else tuple(sources[i] for i in kept),
                  None if probs is None else probs if len(kept) == len(probs) else probs[kept],
                  None if support is None else tuple(support[i] for i in kept),
                  _acceptance(draft.acceptance))
    out = sub_draft(dense, preorder(dense.parents)[:max_nodes])
    return out if out.draft_probs is None or out.is_chain else replace(out, draft_probs=None)


def _acceptance(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _fits_as_is(draft: Draft, vocab_size: int | None, most: int) -> bool:
    """A well-formed chain of at most ``most`` in-vocabulary int ids, with valid sources,
    probabilities and support: what the full pass would rebuild unchanged."""
    ids = draft.token_ids
    if not (isinstance(ids, tuple) and 0 < len(ids) <= most and isinstance(draft.parents, tuple)
            and len(draft.parents) == len(ids)
            and all(type(p) is int and p == i - 1 for i, p in enumerate(draft.parents))):
        return False
    if not all(type(t) is int and 0 <= t and (vocab_size is None or t < vocab_size) for t in ids):
        return False
    if _sources(draft.source, len(ids)) == UNNAMED and draft.source != UNNAMED:
        return False
    if draft.support is not None and not support_fits(draft.support, len(ids)):
        return False
    if draft.acceptance != _acceptance(draft.acceptance):
        return False
    return draft.draft_probs is None or _probs(draft.draft_probs, len(ids), len(ids),
                                               vocab_size) is not None


def _length(seq: object) -> int:
    try:
        return len(seq)  # type: ignore[arg-type]
    except TypeError:
        return 0


def _ints(seq: object, limit: int) -> list[int | None]:
    """The first ``limit`` items of ``seq`` as ints (None where an item is not an integer)."""
    if not isinstance(seq, Iterable) or isinstance(seq, (str, bytes)):
        return []
    out: list[int | None] = []
    try:
        for item in seq:
            if len(out) == limit:
                break
            try:
                out.append(None if isinstance(item, bool) else operator.index(item))
            except TypeError:
                out.append(None)
    except Exception:  # noqa: BLE001 - an iterable that fails midway: keep what came
        pass
    return out


def _sources(source: object, nodes: int) -> str | list[str]:
    if isinstance(source, str):
        return source
    if isinstance(source, tuple) and len(source) == nodes and all(isinstance(s, str) for s in source):
        return list(source)
    return UNNAMED


def _support(support: object, nodes: int) -> tuple[int, ...] | None:
    return support if support_fits(support, nodes) else None  # type: ignore[return-value]


def _probs(probs: object, nodes: int, parents: int, vocab_size: int | None) -> torch.Tensor | None:
    ok = (isinstance(probs, torch.Tensor) and probs.is_floating_point() and probs.dim() == 2
          and probs.shape[0] == nodes == parents
          and (vocab_size is None or probs.shape[1] == vocab_size))
    return probs if ok else None  # type: ignore[return-value]


def report(drafter: object, method: str, exc: BaseException) -> None:
    """Log a drafter's failure, once per drafter."""
    if _reported(drafter):
        return
    logger.warning("drafter %r raised in %s (%s: %s); it is skipped for the rest of the call. "
                   "Outputs are unaffected. Logged once per drafter.", _name(drafter), method,
                   type(exc).__name__, exc, exc_info=exc)


_SEEN: weakref.WeakSet[Any] = weakref.WeakSet()
_SEEN_IDS: set[int] = set()  # drafters that cannot be weakly referenced


def _reported(drafter: object) -> bool:
    try:
        if drafter in _SEEN:
            return True
        _SEEN.add(drafter)
    except TypeError:
        if id(drafter) in _SEEN_IDS:
            return True
        _SEEN_IDS.add(id(drafter))
    return False


def _name(drafter: object) -> str:
    name = getattr(drafter, "name", None)
    return name if isinstance(name, str) else type(drafter).__name__


class Guarded:
    """One drafter for one call, behind the one trust boundary: after it raises once, the call
    goes on without it, and every proposal is sanitised here (:func:`sanitize`).

    ``propose`` returns the drafter's proposal made valid for ``vocab_size`` (None: any
    non-negative id, for a drafter chain that only sizes its sources' trees), ``max_tokens``
    deep and ``max_nodes`` wide, or an empty draft once the drafter has failed; with what it
    is expected to yield where the drafter sizes its drafts
    (:class:`~agentspec.protocols.SizingDrafter`). Only ``Exception`` is caught: an interrupt
    still stops.
    """

    def __init__(self, drafter: Drafter, *, vocab_size: int | None = None,
                 max_nodes: int = MAX_SCAN) -> None:
        self.drafter = drafter
        self.failed = False
        self.name = _name(drafter)
        self.vocab_size, self.max_nodes = vocab_size, max_nodes

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.failed:
            return None
        try:
            return getattr(self.drafter, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - untrusted code: logged, then skipped
            self.failed = True
            report(self.drafter, method, exc)
            return None

    @property
    def wants_hidden(self) -> bool:
        """Whether the drafter reads the target's final hidden rows, so the loop keeps them
        (:func:`wants_hidden`)."""
        return wants_hidden(self.drafter)

    def begin(self, context: DraftContext) -> None:
        self._call("begin", context)

    def propose(self, context: DraftContext, *, max_tokens: int,
                share: StepShare | None = None) -> Proposal:
        """The drafter's proposal, sanitised; sized by ``share`` (the rest of a batched step)
        where the drafter sizes its drafts, whose expected tokens it carries (1.0 otherwise
        and for an empty draft)."""
        if max_tokens <= 0:
            return Proposal(EMPTY_DRAFT)
        expected = 1.0
        if callable(getattr(self.drafter, "propose_sized", None)):
            out = self._call("propose_sized", context, max_tokens=max_tokens, share=share)
            if isinstance(out, Proposal):
                expected = _expected(out.expected_tokens)
                out = out.draft
        else:
            out = self._call("propose", context, max_tokens=max_tokens)
        draft = sanitize(out, vocab_size=self.vocab_size, room=max_tokens, max_nodes=self.max_nodes)
        return Proposal(draft, expected if draft.num_nodes else 1.0)

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        self._call("observe", context, draft, verdict)

    def end(self, context: DraftContext) -> None:
        self._call("end", context)

    def credits(self, context: DraftContext) -> Credits:
        """The request's credits (:data:`~agentspec.protocols.Credits`) from the drafter's
        ``credits`` where it has one, even after it failed (what it earned before stands);
        empty when it has none or it raises here."""
        method = getattr(self.drafter, "credits", None)
        if not callable(method):
            return Counter()
        try:
            out = method(context)
        except Exception as exc:  # noqa: BLE001 - untrusted code: logged, credits lost
            report(self.drafter, "credits", exc)
            return Counter()
        return out if isinstance(out, Counter) else Counter()


def wants_hidden(drafter: object) -> bool:
    """Whether ``drafter`` declares that it reads the target's final hidden rows (its
    ``wants_hidden`` attribute is True: the draft head, a chain holding one)."""
    try:
        return getattr(drafter, "wants_hidden", False) is True
    except Exception:  # noqa: BLE001 - untrusted code: an attribute that raises asks for nothing
        return False


def _expected(value: object) -> float:
    """A sizing drafter's expected tokens as a float of at least 1 (the verdict's own token);
    1.0 for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1.0:
        return float(value) if value != float("inf") else 1.0
    return 1.0
