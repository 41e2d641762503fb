"""Exactness of grammar-constrained speculation, statistically, through the real decode loop.

The target is a table: a fixed random logit vector over SmolLM2's real vocabulary for every
prefix (a "model" whose distributions are known exactly). The grammar is ``[ab]{1,3}`` on the
real tokenizer, so the output is one of a few dozen token sequences ("a", "ab", "b" + "ba",
...) and the stop token is allowed exactly where the text may end. Drafts are trees mixing
allowed and forbidden tokens, so pruning, forced tokens and per-node masks all run. The joint
distribution of the outputs is compared with the exact one (the product of the masked,
tempered conditionals) by a chi-square test, p > 0.001; the same test rejects, in this file, a
verifier that ignores the masks and one that applies the first row's mask to every row.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

from agentspec.config import SamplingParams
from agentspec.decoding import verify as verify_module
from agentspec.decoding.sampling import logits_to_probs
from agentspec.engine.forward import Scored
from agentspec.engine.plan import Prefill
from agentspec.grammar import Grammar
from agentspec.grammar.state import GrammarState
from agentspec.protocols import DraftContext
from agentspec.scheduler import decode
from agentspec.tree import depths
from agentspec.types import Draft
from tests.stats import p_value as chi_square_p

pytest.importorskip("llguidance")

GRAMMAR_TEXT = "[ab]{1,3}"
EOS = 2
DRAWS, WRONG_DRAWS, ALPHA = 2000, 400, 1e-3
SAMPLING = SamplingParams(temperature=1.3)


# Tiny tensors: intra-op threads only add synchronisation cost (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from agentspec.engine.load import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct")[1]))


@functools.cache
def grammar() -> Grammar:
    return Grammar.regex(GRAMMAR_TEXT)


def letter_tokens() -> list[int]:
    """Token ids spelling a non-empty run of a/b (what the grammar can emit), plus EOS."""
    tok = tokenizer()
    ids = {i for s in ("a", "b", "aa", "ab", "ba", "bb", "aab", "aba", "abb", "baa", "bab", "bba", "aaa", "bbb")
           for i in [tok.convert_tokens_to_ids(s)] if isinstance(i, int) and i > 0
           and tok.decode([i]) == s}
    return sorted(ids)


class _TableSequence:
    """The fake engine's sequence: only the committed tokens."""

    reused_tokens = 0

    def __init__(self) -> None:
        self.ids: list[int] = []

    @property
    def kv_len(self) -> int:
        return len(self.ids)

    def commit(self, root: int, verdict: Any) -> None:
        self.ids += [root, *verdict.accepted]

    def release(self) -> None:
        pass


class TableTarget:
    """Duck-typed ``HFTarget`` whose logits for a prefix are a fixed random vector, sharpened
    on the grammar's letter tokens (so the masked distributions are far from uniform)."""

    batches = True  # what the scheduler asks of an engine

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.max_draft_nodes = 16
        self.widest = self.max_draft_nodes + 1
        self.tokenizer = tokenizer()
        self.device = torch.device("cpu")
        self.letters = torch.tensor([*letter_tokens(), EOS])

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one instance per test module
    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(prefix) % (2**31))
        row = torch.randn(self.vocab_size, generator=g)
        row[self.letters] = torch.randn(len(self.letters), generator=g) * 2.0 + 3.0
        return row

    def new_sequence(self) -> _TableSequence:
        return _TableSequence()

    def prefill(self, seq: _TableSequence, tokens: list[int], *, now: bool = True) -> Prefill:
        seq.ids = list(tokens[:-1])
        return Prefill(seq, [])  # type: ignore[arg-type]

    def shared_rows(self, prompt_ids: list[int], other_ids: list[int]) -> int:
        return 0

    def run(self, members: list[Any], *, hidden: bool = False) -> Scored:
        """Each member's rows (the root, then draft nodes, each seeing its ancestors)."""
        out: list[torch.Tensor | None] = []
        for m in members:
            base = tuple([*m.seq.ids, m.ids[0]][1:])  # the generated tokens (a 1-token prompt)
            n = len(m.ids)
            paths = [tuple(m.ids[c] for c in range(1, n) if m.anc[r, c]) for r in range(n)]
            out.append(torch.stack([self.logits(base + path) for path in paths]))
        return Scored(out)


class MixedTreeDrafter:
    """Trees of letter tokens and forbidden ones, as a function of the context (point masses)."""

    name = "mixed"

    def __init__(self, letters: list[int]) -> None:
        self.letters = letters

    def begin(self, context: DraftContext) -> None:
        pass

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        k = len(context.generated)
        a, b = self.letters[k % len(self.letters)], self.letters[(k + 3) % len(self.letters)]
        forbidden = 1000 + k
        if k % 3 == 1:  # a forbidden token first: the whole spine is pruned, the alternative stays
            return Draft((forbidden, a, b), (-1, -1, 1), self.name)
        if k % 3 == 2:  # a stop token on the spine (checked, never consumed), a child after it
            return Draft((a, EOS, b, a), (-1, 0, 1, -1), self.name)
        return Draft((a, b, forbidden, b), (-1, 0, 1, -1), self.name)

    def observe(self, context: DraftContext, draft: Draft, verdict: Any) -> None:
        pass

    def end(self, context: DraftContext) -> None:
        pass


def exact_distribution(target: TableTarget) -> dict[tuple[int, ...], float]:
    """Every output token sequence under the grammar with its probability: at each prefix the
    masked, processed target distribution, recursively, until the stop token."""
    state = GrammarState(grammar(), tokenizer(), vocab_size=target.vocab_size, eos_ids=[EOS])
    out: dict[tuple[int, ...], float] = {}

    def visit(seq: tuple[int, ...], prob: float) -> None:
        allowed = state.allowed_now()
        probs = logits_to_probs(target.logits(seq)[None], SAMPLING, allowed)[0]
        for token in probs.nonzero().flatten().tolist():
            p = prob * float(probs[token])
            if token == EOS:
                out[seq] = out.get(seq, 0.0) + p
                continue
            state.advance([token])
            visit(seq + (token,), p)
            state.rollback(1)

    visit((), 1.0)
    return out


def sample_outputs(verifier: Any, draws: int, monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, ...], int]:
    """Outputs of ``draws`` seeded generations through ``decode`` with ``verifier`` in place
    of the real one; an output the grammar forbids counts under the key ``("invalid",)``."""
    monkeypatch.setattr("agentspec.decoding.loop.verify", verifier)
    target = TableTarget(tokenizer().vocab_size)
    drafter = MixedTreeDrafter(letter_tokens())
    sampling = SamplingParams(temperature=SAMPLING.temperature, grammar=grammar())
    counts: dict[Any, int] = {}
    for seed in range(draws):
        context = DraftContext(tokens=[EOS], prompt_len=1)  # a one-token "prompt"
        g = torch.Generator().manual_seed(seed)
        key: Any
        try:
            for _ in decode(target, drafter, context, sampling=sampling, max_new_tokens=8,
                            stop_token_ids=frozenset({EOS}), generator=g):
                pass
            key = tuple(context.generated)
        except Exception:  # a forbidden token: the matcher refuses it
            key = ("invalid",)
        counts[key] = counts.get(key, 0) + 1
    return counts


def p_value(counts: dict[Any, int], exact: dict[tuple[int, ...], float]) -> float:
    """The chi-square fit of output ``counts`` to the ``exact`` distribution; 0 where an
    output of probability zero was drawn."""
    keys = sorted(set(exact) | set(counts), key=str)
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    probs = np.array([exact.get(k, 0.0) for k in keys])
    if (obs[probs == 0] > 0).any():  # an output of probability zero: not the target's
        return 0.0
    return chi_square_p(obs, probs)


@functools.cache
def exact() -> dict[tuple[int, ...], float]:
    return exact_distribution(TableTarget(tokenizer().vocab_size))


def test_support_is_small_and_covers_every_length() -> None:
    dist = exact()
    assert abs(sum(dist.values()) - 1) < 1e-4
    texts = {tokenizer().decode(list(k)) for k in dist}
    assert texts <= {"".join(t) for n in (1, 2, 3) for t in __import__("itertools").product("ab", repeat=n)}
    assert {len(t) for t in texts} == {1, 2, 3}


def test_constrained_speculation_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    assert p_value(sample_outputs(verify_module.verify, DRAWS, monkeypatch), exact()) > ALPHA


def ignores_masks(draft, logits, sampling, generator=None, *, uniforms=None, allowed=None):
    """Wrong: verifies against the unmasked target."""
    return verify_module.verify(draft, logits, sampling, generator, uniforms=uniforms)


def first_row_mask(draft, logits, sampling, generator=None, *, uniforms=None, allowed=None):
    """Wrong: masks every row with the committed state's mask, not its own path's."""
    return verify_module.verify(draft, logits, sampling, generator, uniforms=uniforms,
                                allowed=None if allowed is None else allowed[:1].expand_as(allowed))


@pytest.mark.parametrize("wrong", [ignores_masks, first_row_mask])
def test_wrong_verifiers_are_rejected(wrong: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert p_value(sample_outputs(wrong, WRONG_DRAWS, monkeypatch), exact()) < ALPHA


def test_pruning_and_forced_tokens_shape_the_draft() -> None:
    """A forbidden first token prunes the spine and keeps the allowed alternative; forced
    tokens are appended; every kept row's mask allows the node after it."""
    tok = tokenizer()
    schema = Grammar.json_schema({"type": "object", "properties": {"k": {"enum": ["yes"]}},
                                  "required": ["k"], "additionalProperties": False})
    state = GrammarState(schema, tok, vocab_size=tok.vocab_size, eos_ids=[EOS])
    out, allowed = state.constrain(Draft(), room=20, max_nodes=20)
    text = tok.decode(list(out.token_ids))
    assert text == '{"k": "yes"}' and set(out.source) == {"grammar"}  # wholly forced
    assert allowed.shape == (out.num_nodes + 1, tok.vocab_size)
    for i, t in enumerate(out.token_ids):
        assert allowed[i, t]
    assert allowed[-1].nonzero().flatten().tolist() == [EOS]
    brace = out.token_ids[0]  # '{"': the grammar's canonical first token
    d = Draft((1000, brace), (-1, -1), "x")  # forbidden spine, allowed sibling
    out, allowed = state.constrain(d, room=20, max_nodes=20, force=False)
    assert out.token_ids == (brace,) and out.num_nodes + 1 == allowed.shape[0]
    assert depths(out.parents) == [1]
