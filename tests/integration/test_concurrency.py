"""Concurrency on the real model (issue 14): many callers, one target, the serial outputs.

* 8 threads and 8 asyncio tasks at once, through ``Speculator`` and the LangChain
  ``ChatAgentSpec``, invoke and stream, greedy and seeded-sampled, while abandoned streams
  (advanced once, still referenced) are alive: every call completes without error, equals
  its serial output (16/16), and the calls share forwards.
* A caller is not blocked by an abandoned stream: a ``generate`` finishes within
  ``UNBLOCKED_S`` while one is alive. The same check fails for the old behaviour (one lock
  held from a stream's first step to its last), reproduced by :class:`LockAcrossYield`.
* A stream closed early, broken out of or raised into gives the model back at once, ends its
  drafters' request, and leaves the KV consistent for the next call.
* Two streams stepped alternately on one thread (drafting from a shared memory and prompt
  lookup, each keeping per-request drafter state) equal their serial outputs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Generator
from typing import Any

import pytest

from agentspec import SamplingParams, Speculator
from agentspec.drafters.policy import DEFAULT_COST
from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores import InMemoryStore
from agentspec.stream import Stream
from agentspec.types import Generation
from tests.integration.helpers import cached_target

pytestmark = pytest.mark.slow
langchain = pytest.importorskip("agentspec.adapters.langchain")

MAX_NEW = 8
UNBLOCKED_S = 10.0  # a generate of MAX_NEW tokens takes ~1 s here; the old behaviour never ends
PROMPTS: list[Any] = [
    [{"role": "user", "content": "List three colours, comma separated."}],
    "def fibonacci(n):\n    ",
    [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Give a cat's name."}],
    "The capital of France is",
]
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def target():
    return cached_target("smollm2-135m-instruct")


def _messages(prompt: Any) -> Any:
    return prompt if isinstance(prompt, str) else [(m["role"].replace("user", "human"), m["content"])
                                                   for m in prompt]


def _calls() -> list[tuple[str, Any, bool]]:
    """16 calls: (kind, prompt, sampled); the first 8 run in threads, the rest as tasks."""
    threads = ["generate", "stream", "invoke", "chat_stream"] * 2
    tasks = ["ainvoke", "astream", "to_thread_generate", "to_thread_stream"] * 2
    return [(kind, PROMPTS[i % len(PROMPTS)], i % 3 == 2)
            for i, kind in enumerate(threads + tasks)]


def _chat(spec: Speculator, sampled: bool) -> Any:
    extra = {"temperature": 0.8, "top_p": 0.95, "seed": 7} if sampled else {}
    return langchain.ChatAgentSpec(speculator=spec, max_tokens=MAX_NEW, **extra)


def _sync(spec: Speculator, kind: str, prompt: Any, sampled: bool) -> str:
    sampling = SAMPLED if sampled else None
    if kind.endswith("generate"):
        return spec.generate(prompt, MAX_NEW, sampling=sampling).text
    if kind.endswith("stream") and not kind.startswith(("chat", "a")):
        stream = spec.stream(prompt, MAX_NEW, sampling=sampling)
        text = "".join(stream)
        assert stream.generation is not None and stream.generation.text == text
        return text
    chat = _chat(spec, sampled)
    if kind == "chat_stream":
        return "".join(str(c.content) for c in chat.stream(_messages(prompt)))
    return str(chat.invoke(_messages(prompt)).content)


async def _async(spec: Speculator, kind: str, prompt: Any, sampled: bool) -> str:
    if kind.startswith("to_thread"):
        return await asyncio.to_thread(_sync, spec, kind, prompt, sampled)
    chat = _chat(spec, sampled)
    if kind == "astream":
        return "".join([str(c.content) async for c in chat.astream(_messages(prompt))])
    return str((await chat.ainvoke(_messages(prompt))).content)


def _abandon(spec: Speculator) -> list[Any]:
    """Streams advanced once and kept referenced (the caller went away without closing)."""
    streams: list[Any] = [spec.stream(PROMPTS[1], 40), spec.stream(PROMPTS[0], 40, sampling=SAMPLED),
                          _chat(spec, False).stream(_messages(PROMPTS[2]))]
    for s in streams:
        next(s)
    return streams


def test_16_concurrent_callers_equal_their_serial_outputs(target, monkeypatch):
    spec = Speculator(target, cost=DEFAULT_COST, memory=None)
    calls = _calls()
    serial = [_sync(spec, *call) if i < 8 else asyncio.run(_async(spec, *call))
              for i, call in enumerate(calls)]
    abandoned = _abandon(spec)
    widths = []  # sequences per forward
    run = target.run
    monkeypatch.setattr(target, "run", lambda members, **kw: (widths.append(len(members)),
                                                              run(members, **kw))[1])
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = _sync(spec, *calls[i])
        except BaseException as exc:  # noqa: BLE001 - counted below
            errors.append(exc)

    async def tasks() -> None:
        async def one(i: int) -> None:
            try:
                results[i] = await _async(spec, *calls[i])
            except BaseException as exc:  # noqa: BLE001 - counted below
                errors.append(exc)
        await asyncio.gather(*(one(i) for i in range(8, 16)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    asyncio.run(tasks())
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread never finished"
    assert errors == []
    same = sum(results.get(i) == serial[i] for i in range(16))
    assert same == 16, [(calls[i][0], results.get(i), serial[i]) for i in range(16)
                        if results.get(i) != serial[i]]
    assert max(widths) >= 8, "the calls never shared a forward"
    assert all(s is not None for s in abandoned)  # they were alive (referenced) all along
    for s in abandoned:
        s.close()


class LockAcrossYield(Speculator):
    """The old behaviour: a lock held from a stream's first step until it ends (or is
    collected), so an abandoned stream blocks every other call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held = threading.RLock()

    def stream(self, *args: Any, **kwargs: Any) -> Stream:
        inner = super().stream(*args, **kwargs)

        def held() -> Generator[str, None, Generation]:
            with self._held:
                return (yield from inner)
        return Stream(held())

    def generate(self, *args: Any, **kwargs: Any) -> Generation:
        with self._held:
            return super().generate(*args, **kwargs)


def _generate_finishes_beside_an_abandoned_stream(spec: Speculator) -> bool:
    abandoned = spec.stream(PROMPTS[1], 40)
    next(abandoned)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (spec.generate(PROMPTS[3], MAX_NEW), done.set()))
    worker.start()
    finished = done.wait(UNBLOCKED_S)
    abandoned.close()  # lets the old behaviour's generate go on, so the thread ends
    worker.join(timeout=120)
    return finished


def test_an_abandoned_stream_blocks_nobody(target):
    assert _generate_finishes_beside_an_abandoned_stream(Speculator(target, cost=DEFAULT_COST, memory=None))


def test_the_old_lock_across_yield_fails_that_check(target):
    assert not _generate_finishes_beside_an_abandoned_stream(LockAcrossYield(target, cost=DEFAULT_COST))


class Recording:
    """Prompt lookup that records which requests began and ended."""

    name = "recording"

    def __init__(self) -> None:
        from agentspec.drafters.prompt_lookup import PromptLookupDrafter

        self.lookup = PromptLookupDrafter()
        self.begun = self.ended = 0

    def begin(self, context):
        self.begun += 1
        self.lookup.begin(context)

    def propose(self, context, *, max_tokens):
        return self.lookup.propose(context, max_tokens=max_tokens)

    def observe(self, context, draft, verdict):
        self.lookup.observe(context, draft, verdict)

    def end(self, context):
        self.ended += 1


@pytest.mark.parametrize("how", ["close", "break", "throw"])
def test_a_stream_ended_early_gives_the_model_back_and_leaves_the_kv_consistent(target, how):
    drafter = Recording()
    spec = Speculator(target, drafters=[drafter], cost=DEFAULT_COST, memory=None)
    expected = Speculator(target, speculate=False, memory=None).generate(PROMPTS[0], MAX_NEW).token_ids
    stream = spec.stream(PROMPTS[2], 40)
    next(stream)
    started = time.perf_counter()
    if how == "close":
        stream.close()
    elif how == "throw":
        with pytest.raises(KeyError):
            stream.throw(KeyError("caller gave up"))
    else:  # the usual way: a loop over a stream nobody else references
        del stream
        for _ in spec.stream(PROMPTS[2], 40):
            break
        stream = None
    assert time.perf_counter() - started < 5.0  # at once: no more steps run to end it
    assert drafter.ended == drafter.begun  # its drafters' request ended
    assert stream is None or stream.generation is None
    after = spec.generate(PROMPTS[0], MAX_NEW)  # the KV still held the broken stream's rows
    assert after.token_ids == expected
    assert drafter.ended == drafter.begun


def test_interleaved_streams_with_per_request_drafter_state_equal_serial(target):
    memory = CompletionMemory(InMemoryStore(), embedder=HashEmbedder())
    spec = Speculator(target, memory=memory, cost=DEFAULT_COST)
    prompts = [PROMPTS[0], PROMPTS[2]]
    serial = [spec.generate(p, 10).token_ids for p in prompts]  # also fills the memory
    streams = [spec.stream(p, 10, record=False) for p in prompts]
    live = list(streams)
    while live:  # one step each in turn, on this thread: every step follows another call's
        for s in list(live):
            if next(s, None) is None:
                live.remove(s)
    assert [s.generation.token_ids for s in streams] == serial
    drafted = sum(sum(s.generation.stats.accepted.values()) for s in streams)
    assert drafted > 0  # the memory and prompt lookup did draft (and were accepted)
