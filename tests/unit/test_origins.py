"""Where each token came from (``Generation.origins``): the data type, the text's runs, and the
Speculator's recording on a tiny random model.

The recording is checked against what can be known independently: an oracle drafter proposes
the plain output's next tokens under a source named by each token's output position
(``even``/``odd``), then one wrong token. So a token marked as drafted must carry its own
position's name, every step ends with the one token the target chose itself, the counts equal
the stats' ``accepted_by_source`` and the steps the stats' ``steps``, and the tokens are plain
decoding's. Two deliberately wrong recorders (the target's token put first in its step; the
target's token booked to the draft's source) fail the same checks.
"""

from __future__ import annotations

import json

import pytest

from agentspec import Speculator
from agentspec.decoding.loop import Step
from agentspec.drafters.policy import CostModel
from agentspec.engine.target import HFTarget
from agentspec.text import origin_text
from agentspec.types import TARGET_ORIGIN, Draft, Generation, Origins
from tests.tiny_model import DecodingTokenizer, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, TOKENS = "3 3", 24  # seed 3 writes 24 tokens from it without an end-of-sequence token
COST = CostModel(base=0.05, per_token=0.0)


# -- the type ------------------------------------------------------------------------------------


def test_runs_counts_cut_and_json():
    o = Origins(("memory", "memory", "target", "suffix", "target", "target"), (3, 2, 1))
    assert o.runs() == ((0, "memory", 0, 2), (0, "target", 2, 3), (1, "suffix", 3, 4),
                        (1, "target", 4, 5), (2, "target", 5, 6))
    assert o.counts() == {"memory": 2, "suffix": 1, "target": 3}
    assert o.cut(4) == Origins(("memory", "memory", "target", "suffix"), (3, 1))
    assert o.cut(99) is o and o.cut(0) == Origins()
    with_text = Origins(o.sources, o.steps, (2, 3, 5, 6, 8))
    for each in (o, with_text):
        assert Origins.from_json(each.as_json()) == each
    assert with_text.pieces("abcdefgh") == ((0, "memory", 2, "ab"), (0, "target", 1, "c"),
                                            (1, "suffix", 1, "de"), (1, "target", 1, "f"),
                                            (2, "target", 1, "gh"))


@pytest.mark.parametrize(("sources", "steps", "ends", "match"), [
    (("a", "b"), (1,), None, "commit 1 tokens but there are 2 sources"),
    (("a",), (0, 1), None, "at least one token, got a step of 0"),
    (("",), (1,), None, "non-empty str, got ''"),
    (("a", "b"), (2,), (3,), r"2 non-decreasing ints .*got \(3,\)"),
    (("a", "b"), (1, 1), (3, 2), r"got \(3, 2\)"),
])
def test_bad_origins_are_named(sources, steps, ends, match):
    with pytest.raises(ValueError, match=match):
        Origins(sources, steps, ends)


@pytest.mark.parametrize("text", ["", "[]", '{"runs": [[0, "a", 0]]}', '{"runs": [[1, "a", 1]]}',
                                  '{"runs": [[0, "a", 1]], "text_ends": [0, 1]}', '{"x": 1}'])
def test_bad_json_is_named(text):
    with pytest.raises(ValueError, match="not the JSON of token origins"):
        Origins.from_json(text)
    with pytest.raises(ValueError, match="no text_ends"):
        Origins(("a",), (1,)).pieces("x")


# -- the text's runs ------------------------------------------------------------------------------


class ByteTokenizer:
    """A token is a UTF-8 byte: a character may be split between two runs."""

    def decode(self, ids, skip_special_tokens=True):  # noqa: ANN001
        return bytes(ids).decode("utf-8", errors="replace")


class WordTokenizer:
    """SentencePiece's way: a word's token carries its leading space, which a decode drops
    at its start."""

    WORDS = ["▁the", "▁cat", "▁sat", "▁on", "▁a", "▁mat", "s", "."]

    def decode(self, ids, skip_special_tokens=True):  # noqa: ANN001
        return "".join(self.WORDS[i] for i in ids).replace("▁", " ").removeprefix(" ")


def _reference_ends(tokenizer, ids, origins):  # noqa: ANN001
    """Where each run ends by the definition: a decode of the whole prefix (half a character
    left to the next run), the last run at the text's end."""
    ends = [end for _, _, _, end in origins.runs()]
    out = [len(tokenizer.decode(ids[:e]).rstrip("\ufffd")) for e in ends[:-1]]
    return tuple(out + [len(tokenizer.decode(ids))])


def _lone_runs(tokenizer, ids, origins, text):  # noqa: ANN001
    """A wrong way: each run decoded alone (drops SentencePiece's spaces, splits characters)."""
    ends, at = [], 0
    for _, _, start, end in origins.runs():
        at += len(tokenizer.decode(ids[start:end]))
        ends.append(at)
    return Origins(origins.sources, origins.steps, tuple(ends))


@pytest.mark.parametrize("tokenizer, ids", [
    (ByteTokenizer(), list("héllo wörld ✓ ok".encode())),
    (WordTokenizer(), [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 6, 7]),
])
def test_text_runs_equal_whole_prefix_decodes(tokenizer, ids):
    import random

    rng = random.Random(0)
    wrong_failed = 0
    for _ in range(50):
        steps, left = [], len(ids)
        while left:
            steps.append(min(left, rng.randint(1, 4)))
            left -= steps[-1]
        sources = tuple(rng.choice(["memory", "target", "suffix"]) for _ in ids)
        origins = Origins(sources, tuple(steps))
        text = tokenizer.decode(ids)
        got = origin_text(tokenizer, ids, origins, text)
        assert got.text_ends == _reference_ends(tokenizer, ids, origins)
        assert "".join(p for *_, p in got.pieces(text)) == text
        wrong_failed += _lone_runs(tokenizer, ids, origins, text).text_ends != got.text_ends
    assert wrong_failed > 25  # the check sees a wrong cut


def test_text_runs_fall_back_to_whole_prefixes_and_stay_in_a_cut_text():
    class Moody(WordTokenizer):  # decodes a window unlike the whole text: the exact path
        def decode(self, ids, skip_special_tokens=True):  # noqa: ANN001
            text = super().decode(ids)
            return text.upper() if len(ids) < 3 else text

    tok, ids = Moody(), [0, 1, 2, 3, 4, 5]
    origins = Origins(("memory",) * 3 + ("target",) * 3, (4, 2))
    got = origin_text(tok, ids, origins, tok.decode(ids))
    assert got.text_ends == _reference_ends(tok, ids, origins)
    cut = origin_text(tok, ids, origins, "the cat")  # a stop string cut the text
    assert max(cut.text_ends) == len("the cat")


# -- the Speculator's recording --------------------------------------------------------------------


class Oracle:
    """Proposes the plain output's next tokens, then a wrong one; each node's source names
    its output position's parity."""

    name = "oracle"

    def __init__(self, truth: tuple[int, ...]) -> None:
        self.truth = truth

    def begin(self, context) -> None:  # noqa: ANN001
        pass

    def end(self, context) -> None:  # noqa: ANN001
        pass

    def observe(self, context, draft, verdict) -> None:  # noqa: ANN001
        pass

    def propose(self, context, *, max_tokens: int) -> Draft:  # noqa: ANN001
        at = len(context.tokens) - context.prompt_len
        ids = list(self.truth[at : at + 3])
        if at + 3 < len(self.truth):
            ids.append((self.truth[at + 3] + 1) % 11)  # wrong: rejected
        ids = ids[: max(max_tokens, 0)]
        if not ids:
            return Draft()
        return Draft(tuple(ids), tuple(range(-1, len(ids) - 1)),
                     tuple(_parity(at + i) for i in range(len(ids))))


def _parity(position: int) -> str:
    return "even" if position % 2 == 0 else "odd"


def problems(gen: Generation, plain: tuple[int, ...]) -> list[str]:
    """What is wrong with ``gen``'s origins against what is known without them."""
    o, out = gen.origins, []
    assert o is not None
    if gen.token_ids != plain:
        out.append("tokens differ from plain decoding")
    if len(o.sources) != len(gen.token_ids):
        out.append(f"{len(o.sources)} origins for {len(gen.token_ids)} tokens")
    drafted = {k: v for k, v in o.counts().items() if k != TARGET_ORIGIN}
    if drafted != gen.stats.accepted_by_source:
        out.append(f"drafted counts {drafted} != accepted {gen.stats.accepted_by_source}")
    if len(o.steps) != gen.stats.steps or o.counts().get(TARGET_ORIGIN, 0) != gen.stats.steps:
        out.append(f"{len(o.steps)} steps, {o.counts().get(TARGET_ORIGIN)} target tokens, "
                   f"{gen.stats.steps} steps in the stats")
    at = 0
    for size in o.steps:
        step = o.sources[at : at + size]
        if step[-1] != TARGET_ORIGIN or TARGET_ORIGIN in step[:-1]:
            out.append(f"step at token {at} is {step}: drafts, then the target's own token")
        out += [f"token {i} marked {s}" for i, s in enumerate(step, at)
                if s != TARGET_ORIGIN and s != _parity(i)]
        at += size
    return out


@pytest.fixture(scope="module")
def target() -> HFTarget:
    return HFTarget(tiny_target(3).model, DecodingTokenizer(), name="tiny-origins")


def _runs(target: HFTarget) -> tuple[tuple[int, ...], Generation]:
    plain = Speculator(target, memory=None, speculate=False, cost=COST).generate(PROMPT, TOKENS)
    assert len(plain.token_ids) == TOKENS and plain.finish_reason == "length"
    spec = Speculator(target, memory=None, drafters=[Oracle(plain.token_ids)], cost=COST)
    return plain.token_ids, spec.generate(PROMPT, TOKENS)


def test_origins_are_each_tokens_draft_source_and_each_steps_own_token(target):
    plain, gen = _runs(target)
    assert problems(gen, plain) == []
    assert gen.stats.accepted_by_source and gen.stats.steps < TOKENS  # the oracle drafted
    no_draft = Speculator(target, memory=None, speculate=False, cost=COST).generate(PROMPT, TOKENS)
    assert no_draft.origins == Origins((TARGET_ORIGIN,) * TOKENS, (1,) * TOKENS)


def test_recording_changes_no_token(target, monkeypatch):
    """The same requests with the recording and without it (every step's origins empty):
    the same tokens and the same drafts."""
    _, recorded = _runs(target)
    monkeypatch.setattr(Step, "origins", property(lambda self: ()))
    _, bare = _runs(target)
    assert bare.origins == Origins() and recorded.origins != Origins()
    assert bare.token_ids == recorded.token_ids
    assert (bare.stats.drafted, bare.stats.accepted, bare.stats.steps) == \
        (recorded.stats.drafted, recorded.stats.accepted, recorded.stats.steps)


def _target_first(self: Step) -> tuple[str, ...]:
    out = [TARGET_ORIGIN, *(self.draft.source_of(n) for n in self.verdict.path)]
    return tuple(out[: len(self.new_tokens)])


def _target_as_draft(self: Step) -> tuple[str, ...]:
    path = self.verdict.path
    last = self.draft.source_of(path[-1]) if path else TARGET_ORIGIN
    return tuple([*(self.draft.source_of(n) for n in path), last][: len(self.new_tokens)])


@pytest.mark.parametrize("wrong", [_target_first, _target_as_draft])
def test_a_wrong_recorder_fails_the_checks(target, monkeypatch, wrong):
    monkeypatch.setattr(Step, "origins", property(wrong))
    plain, gen = _runs(target)
    assert problems(gen, plain)


def test_a_recorded_completion_keeps_its_origins_and_text_runs(target):
    from agentspec.memory.completion import CompletionMemory
    from agentspec.memory.embedder import HashEmbedder
    from agentspec.stores import InMemoryStore

    plain = Speculator(target, memory=None, speculate=False, cost=COST).generate(PROMPT, TOKENS)
    memory = CompletionMemory(InMemoryStore(), embedder=HashEmbedder())
    spec = Speculator(target, memory=memory, drafters=[Oracle(plain.token_ids)], cost=COST)
    gen = spec.generate(PROMPT, TOKENS, scope="s")
    memory.worker.settle()
    (record,) = memory.records(scope="s")
    assert record.origins == gen.origins and gen.origins is not None
    assert gen.origins.text_ends is not None
    pieces = gen.origins.pieces(gen.text)
    assert "".join(p for *_, p in pieces) == gen.text
    assert json.loads(record.origins.as_json())["runs"][0][:2] == [0, gen.origins.sources[0]]
