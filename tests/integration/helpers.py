"""Test drafters and targets shared by the integration tests."""

from __future__ import annotations

import copy
import functools

import torch

from agentspec.engine.load import load_target
from agentspec.engine.target import HFTarget
from agentspec.protocols import DraftContext
from agentspec.types import Draft, Verdict
from tests.solo import solo


class OracleTreeDrafter:
    """Knows a reference continuation and hides it in the second branch of a small tree.

    Tree per step: node0 = a wrong token, node1 = ref[k], node2 = ref[k+1] (child of 1),
    node3 = a wrong sibling of 2, node4 = ref[k+2] (child of 2). The right path is off the
    spine, so each step's verdict is cut at node 1 (its token is the step's next token).
    ``right_first`` puts the right path first: after the depth-first reorder it is the spine.
    """

    name = "oracle"

    def __init__(self, reference: list[int], vocab_size: int, *, right_first: bool = False) -> None:
        self.reference = reference
        self.vocab = vocab_size
        self.right_first = right_first

    def begin(self, context: DraftContext) -> None:
        pass

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        k = len(context.generated)
        ref = self.reference[k : k + 3]
        if len(ref) < 3 or max_tokens < 3:  # the tail: a chain only where the spine is right
            return Draft.chain(ref[:max_tokens], self.name) if self.right_first else Draft()
        wrong = lambda t: (t + 7) % self.vocab  # noqa: E731
        if self.right_first:  # the right path is the first-child path: the spine
            return Draft((ref[0], wrong(ref[0]), ref[1], wrong(ref[1]), ref[2]),
                         (-1, -1, 0, 0, 2), self.name)
        return Draft((wrong(ref[0]), ref[0], ref[1], wrong(ref[1]), ref[2]), (-1, -1, 1, 1, 2), self.name)

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        pass

    def end(self, context: DraftContext) -> None:
        pass


class CheckingTarget(HFTarget):
    """An HFTarget that checks every scored row against a fresh forward of its full prefix:
    the row's sequence's committed tokens, then the row's ancestors among its forward's rows
    (whatever other sequences share the forward)."""

    def __init__(self, model, tokenizer, atol: float = 1e-4) -> None:
        super().__init__(model, tokenizer, name="checking")
        self.atol = atol
        self.checked_rows = 0

    def _fresh_last_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]

    def run(self, members, **kw):
        out = super().run(members, **kw)
        for member, logits in zip(members, out, strict=True):
            if logits is None:
                continue
            n = len(member.ids)
            for row in range(n):
                path = [member.ids[c] for c in range(n) if member.anc[row, c]]
                fresh = self._fresh_last_logits(member.seq.ids + path)
                torch.testing.assert_close(logits[row], fresh, atol=self.atol, rtol=0)
                self.checked_rows += 1
        return out


@functools.cache
def cached_target(name: str) -> HFTarget:
    """A packaged model loaded once per test session in fp32 (shared by the modules that need
    it)."""
    return load_target(name, dtype="float32")


@functools.cache
def modules_bf16_target(name: str = "smollm2-135m-instruct") -> HFTarget:
    """A packaged model in bfloat16 on the modules' path (bfloat16 parameters, the engine's
    widths and packed products): what a bfloat16 model the native forward does not run takes.
    ``load_target(dtype="bfloat16")`` holds a native family's weights in bfloat16 tables for
    the native forward instead; this is the same model's weights cast as that load would."""
    fp32 = cached_target(name)
    model = copy.deepcopy(fp32.model).to(torch.bfloat16)
    return HFTarget(model, fp32.tokenizer, name=fp32.name)


# Three levels, four leaves; siblings distinct; node order is not a path order.
TREE_PARENTS = (-1, -1, 0, 0, 1, 2, 4, 3)


def leaf_paths(parents: tuple[int, ...]) -> list[list[int]]:
    """Root-to-leaf node paths of a parent-pointer tree."""
    has_child = {p for p in parents if p >= 0}
    paths = []
    for leaf in (i for i in range(len(parents)) if i not in has_child):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def tree_equals_chains(target: HFTarget, prompt_ids: list[int], tokens: tuple[int, ...],
                       atol: float) -> int:
    """Score the tree once and every path as a chain from a fresh prefill; returns rows compared."""
    draft = Draft(tokens, TREE_PARENTS, "test")
    solo(target).start(prompt_ids)
    tree_logits = solo(target).score(prompt_ids[-1], draft).float()  # [num_nodes + 1, vocab_size]
    compared = 0
    for path in leaf_paths(TREE_PARENTS):
        solo(target).start(prompt_ids)
        chain = Draft.chain([tokens[i] for i in path], "test")
        chain_logits = solo(target).score(prompt_ids[-1], chain).float()  # [len(path) + 1, vocab_size]
        rows = [0] + [i + 1 for i in path]
        torch.testing.assert_close(tree_logits[rows], chain_logits, atol=atol, rtol=0)
        compared += len(rows)
    return compared


