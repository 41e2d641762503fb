"""Does a small draft model pay as the fallback drafter? Tokens per step and speedup.

    python -m agentspec.bench.model_fallback --prompts 5 --max-new-tokens 32

Two pairs, every system run on each prompt before the next prompt (interleaved, rotated):

* cross tokenizer: gemma-3-270m target, SmolLM2-135M-Instruct drafting text;
* same tokenizer: SmolLM2-135M-Instruct target, a layer-skipped copy of itself drafting tokens
  (its first 20 of 30 decoder layers by default, untrained: a self-speculative draft).

Systems per pair: plain decoding, prompt lookup alone, prompt lookup + model fallback (the
chain picks per step), and the model drafter alone. Greedy, so every system's output must be
token-identical to plain decoding (checked). Prints a markdown table of medians over prompts:
tokens per target step, and speedup = plain seconds / system seconds on the same prompt.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentspec.bench.prompts import ALL_PROMPTS
from agentspec.config import SamplingParams
from agentspec.drafters.model import ModelDrafter
from agentspec.drafters.prompt_lookup import PromptLookupDrafter
from agentspec.engine.load import load_layer_skip, load_target
from agentspec.engine.target import HFTarget
from agentspec.speculator import Speculator

GREEDY = SamplingParams(temperature=0.0)
# Prompts sized for the 2-core CPU: grounded and open-ended ones.
DEFAULT_PROMPTS = (2, 3, 8, 10, 13)


def as_text(prompt: Any) -> str:
    """A raw-text rendering of chat messages, for base models without a chat template."""
    if isinstance(prompt, str):
        return prompt
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in prompt]
    return "\n\n".join(turns) + "\n\nAssistant:"


def systems(target: HFTarget, draft: HFTarget) -> dict[str, Speculator]:
    """The four systems of one pair; the cost model is measured once per target (cached)."""
    def model_drafter() -> ModelDrafter:
        return ModelDrafter(draft, target.tokenizer)

    specs = {
        "plain": Speculator(target, speculate=False, memory=None),
        "lookup": Speculator(target, drafters=[PromptLookupDrafter()], memory=None),
        "lookup+model": Speculator(target, drafters=[PromptLookupDrafter(), model_drafter()], memory=None),
        "model": Speculator(target, drafters=[model_drafter()], memory=None),
    }
    for spec in specs.values():
        spec.warmup()  # the cost curve is measured here (once per target), not in a timed call
    return specs


def run_pair(name: str, specs: dict[str, Speculator], prompts: Sequence[Any],
             max_new: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Each prompt through every system (rotating the order); one row per system."""
    seconds: dict[str, list[float]] = {s: [] for s in specs}
    steps: dict[str, list[int]] = {s: [] for s in specs}
    tokens: dict[str, list[int]] = {s: [] for s in specs}
    for i, prompt in enumerate(prompts):
        order = list(specs)[i % len(specs):] + list(specs)[: i % len(specs)]
        outputs = {}
        for s in order:
            t0 = time.perf_counter()
            out = specs[s].generate(prompt, max_new, sampling=GREEDY, record=False)
            seconds[s].append(time.perf_counter() - t0)
            steps[s].append(out.stats.steps)
            tokens[s].append(len(out.token_ids))
            outputs[s] = out.token_ids
        if any(o != outputs["plain"] for o in outputs.values()):
            raise AssertionError(f"{name}: prompt {i} output differs from plain decoding")
        log(f"{name} prompt {i}: " + ", ".join(
            f"{s} {seconds[s][-1]:.2f}s {tokens[s][-1] / steps[s][-1]:.2f} tok/step" for s in specs))
    rows = []
    for s in specs:
        speedups = [p / t for p, t in zip(seconds["plain"], seconds[s], strict=True)]
        rows.append({"pair": name, "system": s,
                     "tokens_per_step": sum(tokens[s]) / sum(steps[s]),
                     "speedup_median": statistics.median(speedups),
                     "seconds_total": sum(seconds[s]), "new_tokens": sum(tokens[s])})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| pair | system | tokens/step | speedup (median) | seconds (sum) | tokens |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['pair']} | {r['system']} | {r['tokens_per_step']:.2f} | "
                     f"{r['speedup_median']:.2f}x | {r['seconds_total']:.1f} | {r['new_tokens']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=len(DEFAULT_PROMPTS),
                        help="how many of the default bundled prompts")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--keep-layers", default="0-19",
                        help="decoder layers of SmolLM2 (30) the same-tokenizer draft keeps")
    parser.add_argument("--pairs", default="cross,same", help="cross, same, or both")
    args = parser.parse_args(argv)
    prompts = [ALL_PROMPTS[i] for i in DEFAULT_PROMPTS[: args.prompts]]
    keep = [i for part in args.keep_layers.split(",")
            for i in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)]
    smollm = load_target("smollm2-135m-instruct")
    rows: list[dict[str, Any]] = []
    if "cross" in args.pairs:
        gemma = load_target("gemma-3-270m")  # a base model without a chat template: raw text
        rows += run_pair("gemma-3-270m <- smollm2 (text)", systems(gemma, smollm),
                         [as_text(p) for p in prompts], args.max_new_tokens, print)
    if "same" in args.pairs:
        with tempfile.TemporaryDirectory() as tmp:
            draft = load_layer_skip("smollm2-135m-instruct", Path(tmp) / "draft", keep)
            rows += run_pair(f"smollm2 <- smollm2 layers {args.keep_layers} (tokens)",
                             systems(smollm, draft), prompts, args.max_new_tokens, print)
    print(table(rows))


if __name__ == "__main__":
    main()
