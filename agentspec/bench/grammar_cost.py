"""``python -m agentspec.bench.grammar_cost``: what a grammar costs per draft node on this CPU.

Walks real tool-call replies (the assistant calls recorded in a BFCL workload, each under its
line's grammar) through :meth:`agentspec.grammar.GrammarState.constrain` as one draft chain,
the way the decode loop does, and reports per draft node:

- ``mask``: llguidance computing one row's token mask (the matcher's own work);
- ``node``: the whole per-node cost of ``constrain`` (check, consume, mask, roll back, and the
  bits unpacked into the boolean mask the sampler applies), i.e. its time over its rows.

With ``xgrammar`` installed it also times xgrammar's mask for the same JSON schemas, token by
token (see :mod:`agentspec.grammar`). With ``--steps`` it also generates every measured line
of the workload as a tool call (its grammar with ``"choice": "required"``), prompt lookup only,
with the grammar's forced-token drafts on and off, and reports tokens per target step of each
(the outputs must be equal). A figure, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from agentspec.bench.cli import data_dir
from agentspec.bench.workload import load_workload
from agentspec.grammar import GrammarState, compiled
from agentspec.types import Draft


def replies(workload: Path) -> list[tuple[dict[str, Any], str]]:
    """``(grammar spec, reply)`` for every distinct assistant tool call in the workload."""
    seen: set[tuple[str, str]] = set()
    out = []
    for item in load_workload(workload, default_max_new_tokens=128).items:
        if item.grammar is None or item.messages is None:
            continue
        key = json.dumps(item.grammar, sort_keys=True)
        for m in item.messages:
            text = m["content"]
            if m["role"] == "assistant" and text.startswith("[") and (key, text) not in seen:
                seen.add((key, text))
                out.append((dict(item.grammar), text))
    return out


def percentiles(seconds: list[float]) -> dict[str, float]:
    us = np.array(seconds) * 1e6
    return {"n": len(us), "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)), "mean_us": float(us.mean())}


def llguidance_cost(tokenizer: Any, vocab_size: int, eos: list[int],
                    texts: list[tuple[dict[str, Any], str]], repeats: int) -> dict[str, Any]:
    mask_s: list[float] = []
    node_s: list[float] = []
    for spec, text in texts:
        state = GrammarState(compiled(spec), tokenizer, vocab_size=vocab_size, eos_ids=eos)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        draft = Draft.chain(ids, "reply")
        for r in range(repeats + 1):
            state.timing = r > 0  # the first walk warms the matcher's caches
            state.mask_seconds.clear()
            t0 = time.perf_counter()
            out, _ = state.constrain(draft, room=len(ids), max_nodes=len(ids), force=False)
            elapsed = time.perf_counter() - t0
            if r > 0:
                mask_s.extend(state.mask_seconds)
                node_s.append(elapsed / (out.num_nodes + 1))
    return {"mask": percentiles(mask_s), "node": percentiles(node_s)}


def xgrammar_cost(tokenizer: Any, vocab_size: int, texts: list[tuple[dict[str, Any], str]],
                  repeats: int) -> dict[str, Any] | None:
    try:
        import xgrammar
    except ImportError:
        return None
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    mask_s: list[float] = []
    for spec, text in texts:
        schema = _call_list_schema(spec)
        if schema is None:
            continue
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                               separators=(", ", ": "))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for r in range(repeats + 1):
            matcher = xgrammar.GrammarMatcher(grammar)
            for token in ids:
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                if r > 0:
                    mask_s.append(time.perf_counter() - t0)
                if not matcher.accept_token(token):
                    break
    return {"mask": percentiles(mask_s)} if mask_s else None


def forced_steps(workload: Path, model: str, max_new_tokens: int) -> dict[str, Any]:
    """Tokens per target step on required tool calls, forced-token drafts on against off."""
    from agentspec import SamplingParams, SpecConfig, Speculator, load_target

    target = load_target(model)
    specs = {on: Speculator(target.fork(), config=SpecConfig(grammar_drafts=on))
             for on in (True, False)}
    totals = {on: [0, 0] for on in (True, False)}
    equal = 0
    items = [i for i in load_workload(workload, default_max_new_tokens=max_new_tokens).measure
             if i.grammar is not None and i.grammar.get("type") == "tool_calls"]
    for item in items:
        grammar = compiled({**(item.grammar or {}), "choice": "required"})
        outs = {}
        for on, spec in specs.items():
            gen = spec.generate([dict(m) for m in item.messages or ()], max_new_tokens,
                                sampling=SamplingParams(grammar=grammar), record=False)
            totals[on][0] += len(gen.token_ids)
            totals[on][1] += gen.stats.steps
            outs[on] = gen.token_ids
        equal += outs[True] == outs[False]
    return {"calls": len(items), "equal_outputs": equal,
            **{f"tokens_per_step_{'with' if on else 'without'}_forced":
               round(t / s, 3) if s else None for on, (t, s) in totals.items()}}


def _call_list_schema(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema of a ``tool_calls`` spec's call list (xgrammar takes schemas only)."""
    if spec.get("type") != "tool_calls":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                               "arguments": t.get("parameters", {})},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in spec["tools"]]
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, default=data_dir() / "bfcl.jsonl")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--steps", action="store_true",
                        help="also tokens per step on required calls, forced drafts on vs off")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from agentspec.target import load_target

    target = load_target(args.model)
    tokenizer = AutoTokenizer.from_pretrained(target.tokenizer.name_or_path) \
        if not hasattr(target.tokenizer, "backend_tokenizer") else target.tokenizer
    eos = [int(target.tokenizer.eos_token_id)]
    texts = replies(args.workload)
    if not texts:
        raise SystemExit(f"no constrained assistant tool calls in {args.workload}")
    result: dict[str, Any] = {"replies": len(texts),
              "tokens": statistics.fmean(len(tokenizer(t)["input_ids"]) for _, t in texts),
              "llguidance": llguidance_cost(tokenizer, target.vocab_size, eos, texts, args.repeats),
              "xgrammar": xgrammar_cost(tokenizer, target.vocab_size, texts, args.repeats)}
    for name in ("llguidance", "xgrammar"):
        figures = result[name]
        if figures is None:
            print(f"{name}: not installed")
            continue
        for what, f in figures.items():
            print(f"{name:10s} {what:4s} per draft node: p50 {f['p50_us']:6.1f} us, "
                  f"p99 {f['p99_us']:6.1f} us, mean {f['mean_us']:6.1f} us ({f['n']} nodes)")
    if args.steps:
        result["forced_steps"] = steps = forced_steps(args.workload, args.model, args.max_new_tokens)
        print(f"required calls on {steps['calls']} measured lines: tokens per step "
              f"{steps['tokens_per_step_with_forced']} with forced-token drafts, "
              f"{steps['tokens_per_step_without_forced']} without; equal outputs "
              f"{steps['equal_outputs']} of {steps['calls']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
