"""Many calls at once against each one's solo plain run, on one target's model (the GPU tests'
shared check)."""

from __future__ import annotations

import threading
from typing import Any


def concurrent_and_solo(base: Any) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[int]]:
    """Every bundled prompt generated (32 tokens; every third seeded-sampled) by a plain
    speculate-off engine one at a time, then by a speculating engine with all calls at once
    (``max_batch`` 16) on ``base``'s model: the solo outputs, the concurrent ones, and the
    number of sequences in each of the concurrent engine's forwards."""
    from agentspec import SamplingParams, SpecConfig, Speculator
    from agentspec.engine.target import HFTarget
    from tests.prompts import ALL_PROMPTS

    sampled = [SamplingParams(temperature=0.8, seed=5 + i) if i % 3 == 2 else None
               for i in range(len(ALL_PROMPTS))]
    solo = Speculator(HFTarget(base.model, base.tokenizer, reuse_prefix=False), speculate=False,
                      memory=None)
    want = [solo.generate(p, 32, sampling=s).token_ids
            for p, s in zip(ALL_PROMPTS, sampled, strict=True)]
    target = HFTarget(base.model, base.tokenizer)
    widths: list[int] = []
    run = target.run
    target.run = lambda members, **kw: (widths.append(len(members)), run(members, **kw))[1]
    spec = Speculator(target, memory=None, config=SpecConfig(max_batch=16))
    got: dict[int, tuple[int, ...]] = {}

    def call(i: int) -> None:
        got[i] = spec.generate(ALL_PROMPTS[i], 32, sampling=sampled[i]).token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(ALL_PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return want, [got[i] for i in range(len(ALL_PROMPTS))], widths
