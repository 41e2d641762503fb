"""The architecture matrix (issue 49): every family :data:`agentspec.engine.compat.ARCHITECTURES`
lists, on a tiny random checkpoint built from its transformers config (``tests/families.py``:
SmolLM2's tokenizer, no download).

On each:

- greedy output through agentspec, plain, with prompt lookup and with right drafts, equals
  ``generate(do_sample=False)`` in fp32;
- drafts (a right chain, trees whose right path is off their spine) and a completion memory
  (poisoned entries, then the real completion) change no token, in fp32 and bf16;
- a prompt whose first blocks the pool has cached from an earlier call, and a prompt prefilled
  in many small chunks, give bitwise the logits of a fresh prefill (fp32 and bf16);
- the windowed checkpoints' window is crossed by every generation (prompt and output are
  longer than it);
- a family outside the table is refused before its weights load.

The same file shows the checks can fail: an engine that ignores the sliding window (what it did
for Mistral and Phi-3 before this matrix) and one that drops Gemma 2's attention logit cap
(which it had none of before) each give other tokens than ``generate``; a verification mask
that lets a step's rows see the draft's later rows makes drafts change tokens; a pool that
finds a cached block by its tokens alone hands out rows that are not a fresh prefill's.

Then GGUF (issue 49 item 4): each family that transformers' GGUF reader knows is written as a
GGUF file (F32, llama.cpp's tensor names and layouts, a byte-level tokenizer) and loaded as
SmolLM2's is (``load_target(path)``: dequantised into safetensors once); its forward gives
bitwise the source checkpoint's logits, and its greedy output the source's tokens. What the
reader cannot give back is an expected failure naming the one reason.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from agentspec import SamplingParams, Speculator
from agentspec.decoding import loop
from agentspec.drafters.policy import DEFAULT_COST
from agentspec.drafters.prompt_lookup import PromptLookupDrafter
from agentspec.engine import compat, kv
from agentspec.engine import target as target_module
from agentspec.engine.load import load_target
from agentspec.engine.pool import BLOCK, KVPool
from agentspec.engine.target import HFTarget
from agentspec.errors import UnsupportedModelError
from agentspec.memory import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.protocols import DraftContext
from agentspec.scheduler import decode
from agentspec.stores import SQLStore
from agentspec.text import conversation_key
from agentspec.types import Draft
from tests.families import (
    BY_NAME,
    BYTE_VOCAB,
    END_OF_TEXT,
    FAMILIES,
    SHAPE,
    WINDOW,
    Family,
    build,
    gguf_architecture,
    tokenizer,
)
from tests.families import write_gguf as write_family_gguf
from tests.prompts import CODE, RECORD
from tests.solo import solo

from .helpers import OracleTreeDrafter

MAX_NEW = 10
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NAMES = [f.name for f in FAMILIES]
WINDOWED = [f.name for f in FAMILIES if f.window is not None]


@functools.cache
def _model(name: str, dtype: str) -> torch.nn.Module:
    fp32 = build(BY_NAME[name]) if dtype == "fp32" else _model(name, "fp32")
    return fp32 if dtype == "fp32" else copy.deepcopy(fp32).to(DTYPES[dtype])


def _target(name: str, dtype: str, **kw) -> HFTarget:
    """A target with a pool of its own over the family's (shared) model."""
    return HFTarget(_model(name, dtype), tokenizer(), name=name, **kw)


def _plain(target: HFTarget, prompt: str = PROMPT) -> list[int]:
    out = Speculator(target, speculate=False, cost=DEFAULT_COST, memory=None).generate(prompt, MAX_NEW)
    return list(out.token_ids)


def _tree_walk(target: HFTarget, ref: list[int]) -> list[int]:
    """Greedy decoding through the loop itself (no drafter chain, whose policy may prune a
    tree to its first branch) with :class:`OracleTreeDrafter`'s trees, whose right path is off
    the spine: every step commits a path that is not the spine (its rows are gathered)."""
    ids = tokenizer()(PROMPT)["input_ids"]
    steps = list(decode(target, OracleTreeDrafter(ref, target.vocab_size),
                        DraftContext(tokens=list(ids), prompt_len=len(ids)),
                        sampling=SamplingParams(), max_new_tokens=MAX_NEW,
                        stop_token_ids=target.stop_token_ids))
    assert sum(not s.draft.is_chain for s in steps) >= MAX_NEW // 2  # trees really were scored
    return [t for s in steps for t in s.new_tokens]


@functools.cache
def _reference(name: str, dtype: str) -> tuple[int, ...]:
    """Plain decoding without prefix reuse: what every run must equal."""
    return tuple(_plain(_target(name, dtype, reuse_prefix=False)))


def _generate(name: str) -> list[int]:
    """transformers' greedy tokens (fp32), cut before the first stop token."""
    model = _model(name, "fp32")
    ids = torch.tensor([tokenizer()(PROMPT)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                         do_sample=False)
    tokens = out[0, ids.shape[1] :].tolist()
    stop = tokenizer().eos_token_id
    return tokens[: tokens.index(stop)] if stop in tokens else tokens


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_generate(name: str) -> None:
    expected = _generate(name)
    assert len(expected) == MAX_NEW  # no early stop: every comparison covers all the tokens
    assert len(set(expected)) >= 3  # a checkpoint whose output moves (not one token repeated)
    assert list(_reference(name, "fp32")) == expected
    target = _target(name, "fp32")
    lookup = Speculator(target, drafters=[PromptLookupDrafter()], cost=DEFAULT_COST, memory=None)
    assert list(lookup.generate(PROMPT, MAX_NEW).token_ids) == expected
    right = Speculator(target, drafters=[OracleTreeDrafter(expected, target.vocab_size,
                                                           right_first=True)],
                       cost=DEFAULT_COST, memory=None).generate(PROMPT, MAX_NEW)
    assert list(right.token_ids) == expected
    assert right.stats.tokens_per_step > 2  # the right drafts really were accepted


def _poisoned(target: HFTarget, ref: list[int]) -> CompletionMemory:
    """A memory holding, under the prompt's own key, the right start then noise, and the right
    completion with one token flipped."""
    memory = CompletionMemory(SQLStore("sqlite://"), embedder=HashEmbedder())
    key = conversation_key(PROMPT)
    flipped = list(ref)
    flipped[len(ref) // 2] = (flipped[len(ref) // 2] + 1) % target.vocab_size
    noise = torch.randint(0, target.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    for n, ids in enumerate((ref[:3] + noise.tolist(), flipped)):
        memory.record(scope="s", model=target.fingerprint, request_text=key, key_text=key,
                      completion_text=f"poison {n}", completion_ids=ids)
    return memory


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", NAMES)
def test_drafts_and_memory_change_nothing(name: str, dtype: str) -> None:
    ref = list(_reference(name, dtype))
    target = _target(name, dtype)  # prefix reuse on: each run starts on what the last left
    vocab = target.vocab_size
    right = Speculator(target, drafters=[OracleTreeDrafter(ref, vocab, right_first=True)],
                       cost=DEFAULT_COST, memory=None)  # (prompt lookup: the test above)
    assert list(right.generate(PROMPT, MAX_NEW).token_ids) == ref, f"right drafts ({dtype})"
    assert _tree_walk(target, ref) == ref, f"trees, right path off the spine ({dtype})"
    memory = _poisoned(target, ref)
    spec = Speculator(target, memory=memory, cost=DEFAULT_COST)  # the default drafters
    poisoned = spec.generate(PROMPT, MAX_NEW, scope="s", record=False)
    assert list(poisoned.token_ids) == ref, f"poisoned memory ({dtype})"
    assert poisoned.stats.drafted.get("memory", 0) > 0  # the poison really was drafted
    key = conversation_key(PROMPT)  # then the real completion, as a call records it
    memory.record(scope="s", model=target.fingerprint, request_text=key, key_text=key,
                  completion_text="real", completion_ids=ref)
    repeat = spec.generate(PROMPT, MAX_NEW, scope="s", record=False)
    assert list(repeat.token_ids) == ref, f"memory ({dtype})"
    assert repeat.stats.accepted.get("memory", 0) >= MAX_NEW - 3


@functools.cache
def _calls() -> tuple[list[int], ...]:
    """Three calls of two agents whose prompts differ in their first pool block and share the
    second (their tool docs): the third call's first two blocks are cached by the first call,
    and a second block with the same tokens by the second call, after another first block."""
    encode = tokenizer()

    def block(text: str) -> list[int]:
        ids = encode(text * 4)["input_ids"][:BLOCK]
        assert len(ids) == BLOCK
        return ids

    x, y, docs = block(f"You are agent X.\n{CODE}\n"), block(f"You are agent Y.\n{RECORD}\n"), block(CODE + RECORD)
    tails = [encode(t)["input_ids"] for t in ("Repeat the first function.", "Name the customer.",
                                             "Sum the totals.")]
    return x + docs + tails[0], y + docs + tails[1], x + docs + tails[2]


def _rows(target: HFTarget, ids: list[int]) -> torch.Tensor:
    """The prompt's last row and a short chain's rows, after a prefill of the prompt."""
    solo(target).start(ids)
    return solo(target).score(ids[-1], Draft.chain(ids[3:6], "test")).clone()


def _reused_rows(name: str, dtype: str) -> tuple[HFTarget, torch.Tensor]:
    """The third call's rows on a target that served the other two first."""
    cached = _target(name, dtype)
    for ids in _calls():
        rows = _rows(cached, ids)
    return cached, rows


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", NAMES)
def test_prefix_reuse_and_chunked_prefill_compute_a_fresh_prefills_rows(name: str, dtype: str) -> None:
    cached, reused = _reused_rows(name, dtype)
    assert solo(cached).reused_tokens == 2 * BLOCK  # its agent's two blocks, from the pool
    third = _calls()[-1]
    fresh = _rows(_target(name, dtype, reuse_prefix=False), third)  # 256 rows, then the rest
    assert torch.equal(reused, fresh), f"prefix reuse ({dtype})"
    # The same prompt prefilled 32 rows at a time.
    chunked = _target(name, dtype, reuse_prefix=False, widths=(2, 4, 8, 16), prefill_widths=(32,))
    assert torch.equal(_rows(chunked, third), fresh), f"chunked prefill ({dtype})"
    assert chunked.widest == 32


@pytest.mark.parametrize("name", WINDOWED)
def test_every_generation_crosses_the_window(name: str) -> None:
    target = _target(name, "fp32")
    assert target.sliding_window == BY_NAME[name].window == WINDOW
    assert len(tokenizer()(PROMPT)["input_ids"]) > WINDOW and MAX_NEW > WINDOW
    assert target.supports_trees  # the window's tree masks are the engine's own


# -- the checks fail on a wrong engine -------------------------------------------------------

@pytest.mark.parametrize("name", WINDOWED)
def test_an_engine_ignoring_the_window_fails_the_identity(name: str, monkeypatch) -> None:
    monkeypatch.setattr(compat, "sliding_window", lambda model: (None, False))
    windowless = _target(name, "fp32", reuse_prefix=False)
    assert windowless.sliding_window is None
    assert _plain(windowless) != _generate(name)


@pytest.mark.parametrize("name", NAMES)
def test_a_step_whose_rows_see_later_draft_rows_fails_the_invariance(name: str, monkeypatch) -> None:
    """A verification mask that lets every row of a step see all the step's rows (the root
    then attends the draft's tokens, which plain decoding never had): drafts change tokens."""
    ref = list(_reference(name, "fp32"))
    right_mask = loop.draft_member

    def leaky(seq, last_token, draft):  # noqa: ANN001, ANN202 - the wrong mask
        member = right_mask(seq, last_token, draft)
        member.anc[:] = True
        return member

    monkeypatch.setattr(loop, "draft_member", leaky)
    assert _tree_walk(_target(name, "fp32"), ref) != ref


class _BlocksByTokens(KVPool):
    """Deliberately wrong: a cached block is found by its own tokens, whatever came before it
    (the last sealed of equal blocks wins)."""

    def match(self, ids):  # noqa: ANN001, ANN201 - KVPool.match's signature
        found = {key: block for block, (_, key) in self.trie._key.items() if len(key) == BLOCK}
        chain = []
        for start in range(0, len(ids) - BLOCK + 1, BLOCK):
            block = found.get(tuple(ids[start : start + BLOCK]))
            if block is None:
                break
            chain.append(block)
        return chain, -1, 0


def test_a_pool_finding_blocks_by_their_tokens_fails_the_prefix_check(monkeypatch) -> None:
    """The third call gets the agents' shared second block as computed after the other agent's
    first block: its rows are not a fresh prefill's."""
    monkeypatch.setattr(target_module, "KVPool", _BlocksByTokens)
    cached, reused = _reused_rows("llama", "fp32")
    assert isinstance(cached.pool, _BlocksByTokens) and solo(cached).reused_tokens == 2 * BLOCK
    fresh = _rows(_target("llama", "fp32", reuse_prefix=False), _calls()[-1])
    assert not torch.equal(reused, fresh)


def test_an_engine_dropping_gemma2s_logit_cap_fails_the_identity(monkeypatch) -> None:
    assert _model("gemma2", "fp32").config.attn_logit_softcapping == 50.0  # Gemma 2's own
    original = kv.group_attention

    def uncapped(*args, softcap=None, **kwargs):  # noqa: ANN001, ANN202 - the wrong engine
        return original(*args, **kwargs)

    monkeypatch.setattr(kv, "group_attention", uncapped)
    assert _plain(_target("gemma2", "fp32", reuse_prefix=False)) != _generate("gemma2")


def test_a_family_outside_the_table_is_refused_before_its_weights_load(tmp_path, monkeypatch) -> None:
    """A folder of a family transformers knows but the matrix does not run (Starcoder2) is
    refused by name, with the supported ones and the way to try it anyway."""
    import transformers

    monkeypatch.delenv(compat.ALLOW_UNTESTED, raising=False)
    transformers.Starcoder2Config(vocab_size=64, architectures=["Starcoder2ForCausalLM"],
                                  **SHAPE).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"model type 'starcoder2' \("
                       r"Starcoder2ForCausalLM\) is not supported; agentspec loads gemma2, .*"
                       r"AGENTSPEC_ALLOW_UNTESTED=1"):
        load_target(str(tmp_path), device="cpu")


# -- GGUF ------------------------------------------------------------------------------------

def _gguf_case(family: Family):
    arch = gguf_architecture(family.model_type)
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        return pytest.param(family.name, marks=pytest.mark.skip(
            reason=f"transformers' GGUF reader does not know the {arch} architecture"))
    if family.gguf is not None:
        return pytest.param(family.name, marks=pytest.mark.xfail(reason=family.gguf, strict=True))
    return family.name


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An AGENTSPEC_HOME of the test's own: the GGUF's conversion is written there."""
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path / "home"))
    return tmp_path


@pytest.mark.parametrize("name", [_gguf_case(f) for f in FAMILIES])
def test_a_gguf_of_the_family_loads_as_its_checkpoint(name: str, home) -> None:
    family = BY_NAME[name]
    source = build(family, byte_vocab=True)
    path = write_family_gguf(source, family, home / f"{name}.gguf")
    loaded = load_target(str(path), device="cpu", dtype="float32")
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    assert loaded.tokenizer.convert_ids_to_tokens(BYTE_VOCAB - 1) == END_OF_TEXT  # the file's
    x = torch.tensor([ids])
    with torch.inference_mode():
        assert torch.equal(loaded.model(x).logits, source(x).logits), name
    want = source.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                           do_sample=False, eos_token_id=None)[0, len(ids) :].tolist()
    spec = Speculator(loaded, drafters=[PromptLookupDrafter()], cost=DEFAULT_COST, memory=None)
    got = list(spec.generate(PROMPT, MAX_NEW).token_ids)
    assert got == want[: len(got)] and (len(got) == MAX_NEW or want[len(got)] in spec.stop_token_ids)
