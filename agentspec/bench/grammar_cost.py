"""``python -m agentspec.bench.grammar_cost``: what a grammar costs per draft node on this CPU.

Walks real tool calls through :meth:`agentspec.grammar.state.GrammarState.constrain` as one draft
chain each, the way the decode loop does, and reports per draft node:

- ``mask``: llguidance computing one row's token mask (or the copy of a cached one);
- ``node``: the whole per-node cost of ``constrain`` (check, consume, mask, roll back, and the
  bits unpacked into the boolean mask the sampler applies), i.e. its time over its rows.

The timers are the bench's own, around the grammar's public calls: :class:`TimedGrammarState`
times each row's mask (``GrammarState.fill_row``), :func:`timed_steps` each step of the decode
loop (``GrammarState.constrain``, then ``LazyMasks.forbidding``).

The calls (``--source live``, the default) are the ground-truth answers of BFCL's
``live_multiple`` requests (real user requests to deployed agents), rendered as this project's
call lists under a grammar of the request's own tool set. Agent traffic repeats its tool sets,
so the first half of the calls (in file order) is walked once untimed, as the engine's earlier
calls would have (matchers pooled, per-grammar caches filled), and the second half is timed,
each call walked once: no timed call was seen before. ``--source workload`` times the
assistant calls recorded in a workload's histories instead (few; each walked ``--repeats``
times after one warm walk).

With ``xgrammar`` installed it also times xgrammar's mask for the same JSON schemas, token by
token. With ``--steps`` it also generates every measured line of the workload as a tool call
(its grammar with ``"choice": "required"``), prompt lookup only, with the grammar's
forced-token drafts on and off, and reports tokens per target step of each (the outputs must
be equal). A figure, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from agentspec.bench.workload import data_dir, load_workload
from agentspec.grammar import compiled
from agentspec.grammar.state import GrammarState, LazyMasks
from agentspec.types import Draft


class TimedGrammarState(GrammarState):
    """A grammar state that times each row mask it computes (or copies from the cache) while
    :attr:`timed`: :attr:`mask_seconds`, one entry per row (the ``mask`` figure)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timed = False
        self.mask_seconds: list[float] = []

    def fill_row(self, row: int, node: list[Any] | None, first: bool | None = None) -> None:
        if not self.timed:
            super().fill_row(row, node, first)
            return
        started = time.perf_counter()
        super().fill_row(row, node, first)
        self.mask_seconds.append(time.perf_counter() - started)


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


def _value(options: Any) -> Any:
    """BFCL's first accepted value of an argument (nested objects hold option lists too)."""
    value = options[0] if isinstance(options, list) and options else options
    if isinstance(value, dict):
        return {k: _value(v) for k, v in value.items() if not _omitted(v)}
    return value


def _omitted(options: Any) -> bool:
    return isinstance(options, list) and bool(options) and options[0] == ""


def live_calls(limit: int | None = None) -> list[tuple[dict[str, Any], str]]:
    """``(grammar spec, call list)`` for BFCL live_multiple's ground truths, in file order: the
    request's tool set as a required call list, the answer's arguments in schema order."""
    from agentspec.bench.bfcl import json_schema_of
    from agentspec.bench.bfcl_live import data_file, load_entries

    answers_path = data_file().parent / "possible_answer" / data_file().name
    with answers_path.open(encoding="utf-8") as f:
        answers = {a["id"]: a["ground_truth"] for a in map(json.loads, filter(str.strip, f))}
    out = []
    for entry in load_entries():
        truth = answers.get(entry["id"])
        if not truth:
            continue
        tools = [{"name": d["name"], "parameters": json_schema_of(d["parameters"])}
                 for d in entry["function"]]
        order = {t["name"]: list(t["parameters"].get("properties", {})) for t in tools}
        calls = []
        for call in truth:
            (name, args), = call.items()
            keys = sorted((k for k in args if not _omitted(args[k])),
                          key=lambda k: order.get(name, []).index(k) if k in order.get(name, []) else 1 << 30)
            calls.append({"name": name, "arguments": {k: _value(args[k]) for k in keys}})
        spec = {"type": "tool_calls", "tools": tools, "choice": "required", "as_list": True}
        out.append((spec, json.dumps(calls, ensure_ascii=False)))
    return out[:limit]


def walk(state: GrammarState, ids: list[int]) -> int:
    """Constrain the reply as one draft chain; the number of its tokens the grammar allows."""
    out, _ = state.constrain(Draft.chain(ids, "reply"), room=len(ids), max_nodes=len(ids),
                             force=False)
    return out.num_nodes


def llguidance_cost(tokenizer: Any, vocab_size: int, eos: list[int],
                    texts: list[tuple[dict[str, Any], str]], repeats: int,
                    held_out: bool) -> dict[str, Any]:
    """Per-node costs. ``held_out``: the first half warms, the second half is timed once
    each; else every reply is walked once to warm and ``repeats`` times timed."""
    mask_s: list[float] = []
    node_s: list[float] = []
    setup_s: list[float] = []  # a timed call's grammar seen for the first time: compile + warm-up
    seen: set[str] = set()
    refused = 0
    half = len(texts) // 2 if held_out else 0
    for k, (spec, text) in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        key = json.dumps(spec)
        t0 = time.perf_counter()
        state = TimedGrammarState(compiled(spec), tokenizer, vocab_size=vocab_size, eos_ids=eos)
        if key not in seen and k >= half:
            setup_s.append(time.perf_counter() - t0)
        seen.add(key)
        walks = 1 if held_out else repeats + 1
        for r in range(walks):
            timed = k >= half if held_out else r > 0
            state.timed = timed
            state.mask_seconds.clear()
            t0 = time.perf_counter()
            kept = walk(state, ids)
            elapsed = time.perf_counter() - t0
            if kept < len(ids):  # BFCL's answer breaks its own schema (a type, an enum)
                refused += r == 0
                break
            if timed:
                mask_s.extend(state.mask_seconds)
                node_s.append(elapsed / (kept + 1))
        state.close()
    return {"mask": percentiles(mask_s), "node": percentiles(node_s), "refused_calls": refused,
            **({"new_grammar_setup": percentiles(setup_s)} if setup_s else {})}


def xgrammar_cost(tokenizer: Any, vocab_size: int, texts: list[tuple[dict[str, Any], str]],
                  repeats: int, held_out: bool) -> dict[str, Any] | None:
    """xgrammar's mask for the same calls, on the same protocol as :func:`llguidance_cost`."""
    try:
        import xgrammar
    except ImportError:
        return None
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info)  # caches compiled schemas itself
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    mask_s: list[float] = []
    setup_s: list[float] = []
    seen: set[str] = set()
    half = len(texts) // 2 if held_out else 0
    for k, (spec, text) in enumerate(texts):
        schema = _call_list_schema(spec)
        if schema is None:
            continue
        key = json.dumps(schema)
        t0 = time.perf_counter()
        grammar = compiler.compile_json_schema(key, any_whitespace=False, separators=(", ", ": "))
        if key not in seen and k >= half:
            setup_s.append(time.perf_counter() - t0)
        seen.add(key)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for r in range(1 if held_out else repeats + 1):
            timed = k >= half if held_out else r > 0
            matcher = xgrammar.GrammarMatcher(grammar)
            times = []
            for token in ids:
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                times.append(time.perf_counter() - t0)
                if not matcher.accept_token(token):
                    times = []  # refused by this schema: not a call of it
                    break
            if timed:
                mask_s.extend(times)
    if not mask_s:
        return None
    return {"mask": percentiles(mask_s), **({"new_grammar_setup": percentiles(setup_s)} if setup_s else {})}


def forced_steps(workload: Path, model: str, max_new_tokens: int) -> dict[str, Any]:
    """Tokens per target step on required tool calls, forced-token drafts on against off."""
    from agentspec import SamplingParams, SpecConfig, Speculator, load_target

    target = load_target(model)
    specs = {on: Speculator(target.fork(), config=SpecConfig(grammar_drafts=on), memory=None)
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


@contextmanager
def timed_steps() -> Iterator[list[list[float]]]:
    """Every grammar step of every :class:`GrammarState` inside, timed: ``[seconds in the
    grammar, rows scored]`` per ``constrain`` call that constrains (not once free text has
    begun), the step's ``LazyMasks.forbidding`` checks added to its seconds. The two public
    calls are wrapped for the block and put back after."""
    steps: list[list[float]] = []
    last: dict[int, list[float]] = {}  # id(state) -> its latest step
    constrain, forbidding = GrammarState.constrain, LazyMasks.forbidding

    def timed_constrain(self: GrammarState, draft: Draft, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out, allowed = constrain(self, draft, **kwargs)
        if allowed is not None:
            step = [time.perf_counter() - started, out.num_nodes + 1]
            steps.append(step)
            last[id(self)] = step
        return out, allowed

    def timed_forbidding(self: LazyMasks, tokens: Any) -> Any:
        started = time.perf_counter()
        out = forbidding(self, tokens)
        step = last.get(id(self.state))
        if step is not None:
            step[0] += time.perf_counter() - started
        return out

    GrammarState.constrain = timed_constrain  # type: ignore[method-assign]
    LazyMasks.forbidding = timed_forbidding  # type: ignore[method-assign]
    try:
        yield steps
    finally:
        GrammarState.constrain = constrain  # type: ignore[method-assign]
        LazyMasks.forbidding = forbidding  # type: ignore[method-assign]


def decode_cost(workload: Path, model: str, max_new_tokens: int) -> dict[str, Any]:
    """The grammar's cost per scored row in the decode loop (greedy, the default drafters),
    masks on demand against every row's mask, generation by generation in turn on one target.

    A step's grammar time (``constrain``, then the checks of the masks on demand) is spread
    over the rows it scored; the percentiles are over rows. Outputs must be equal."""
    from agentspec import SamplingParams, SpecConfig, Speculator, load_target

    target = load_target(model)
    specs = {lazy: Speculator(target.fork(), config=SpecConfig(lazy_masks=lazy), memory=None)
             for lazy in (True, False)}
    per_row: dict[bool, list[float]] = {True: [], False: []}
    per_step: dict[bool, list[float]] = {True: [], False: []}
    equal = 0
    items = [i for i in load_workload(workload, default_max_new_tokens=max_new_tokens).measure
             if i.grammar is not None]
    for k, item in enumerate(items):
        grammar = compiled(dict(item.grammar or {}))
        outs = {}
        for lazy in ((True, False) if k % 2 == 0 else (False, True)):  # interleaved
            with timed_steps() as steps:
                gen = specs[lazy].generate([dict(m) for m in item.messages or ()], max_new_tokens,
                                           sampling=SamplingParams(grammar=grammar), record=False)
            outs[lazy] = gen.token_ids
            for seconds, rows in steps:
                per_row[lazy].extend([seconds / rows] * int(rows))
                per_step[lazy].append(seconds)
        equal += outs[True] == outs[False]
    return {"calls": len(items), "equal_outputs": equal,
            **{f"{'lazy' if lazy else 'full'}_masks": {"row": percentiles(per_row[lazy]),
                                                       "step": percentiles(per_step[lazy])}
               for lazy in (True, False)}}


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
    parser.add_argument("--source", choices=("live", "workload"), default="live",
                        help="live: BFCL live_multiple's ground-truth calls, first half warm, "
                             "second half timed once (default); workload: the calls in "
                             "--workload's histories, each timed --repeats times")
    parser.add_argument("--workload", type=Path, default=data_dir() / "bfcl.jsonl")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--limit", type=int, default=None, help="at most this many live calls")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", action="store_true",
                        help="also tokens per step on required calls, forced drafts on vs off")
    parser.add_argument("--decode", type=Path, nargs="?", const=data_dir() / "bfcl-live.jsonl",
                        default=None, metavar="WORKLOAD",
                        help="also the grammar's cost per scored row in the decode loop, masks "
                             "on demand vs every row's mask, on a workload's measured lines "
                             "under their grammars (default: bfcl-live)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    for name in ("repeats", "limit", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    from transformers import AutoTokenizer

    from agentspec.engine.load import load_target

    target = load_target(args.model)
    tokenizer = AutoTokenizer.from_pretrained(target.tokenizer.name_or_path) \
        if not hasattr(target.tokenizer, "backend_tokenizer") else target.tokenizer
    eos = [int(target.tokenizer.eos_token_id)]
    held_out = args.source == "live"
    texts = live_calls(args.limit) if held_out else replies(args.workload)
    if not texts:
        raise SystemExit(f"no constrained assistant tool calls in {args.workload}")
    result: dict[str, Any] = {
        "source": args.source, "calls": len(texts),
        "timed_calls": len(texts) - len(texts) // 2 if held_out else len(texts),
        "tokens": statistics.fmean(len(tokenizer(t)["input_ids"]) for _, t in texts),
        "llguidance": llguidance_cost(tokenizer, target.vocab_size, eos, texts, args.repeats,
                                      held_out),
        "xgrammar": xgrammar_cost(tokenizer, target.vocab_size, texts, args.repeats, held_out)}
    print(f"{result['calls']} calls ({args.source}), {result['timed_calls']} timed, "
          f"{result['tokens']:.1f} tokens each; llguidance refused "
          f"{result['llguidance']['refused_calls']} (answers outside their own schema)")
    for name in ("llguidance", "xgrammar"):
        figures = result[name]
        if figures is None:
            print(f"{name}: not installed")
            continue
        for what, f in figures.items():
            if not isinstance(f, dict):
                continue
            if what == "new_grammar_setup":
                print(f"{name:10s} per new grammar (compile{' + warm-up' if name == 'llguidance' else ''}): "
                      f"p50 {f['p50_us'] / 1000:6.1f} ms, p99 {f['p99_us'] / 1000:6.1f} ms "
                      f"({f['n']} grammars)")
                continue
            print(f"{name:10s} {what:4s} per draft node: p50 {f['p50_us']:6.1f} us, "
                  f"p99 {f['p99_us']:6.1f} us, mean {f['mean_us']:6.1f} us ({f['n']} nodes)")
    if args.steps:
        result["forced_steps"] = steps = forced_steps(args.workload, args.model, args.max_new_tokens)
        print(f"required calls on {steps['calls']} measured lines: tokens per step "
              f"{steps['tokens_per_step_with_forced']} with forced-token drafts, "
              f"{steps['tokens_per_step_without_forced']} without; equal outputs "
              f"{steps['equal_outputs']} of {steps['calls']}")
    if args.decode:
        result["decode"] = dec = decode_cost(args.decode, args.model, args.max_new_tokens)
        print(f"decode loop on {dec['calls']} measured lines of {args.decode.name} (greedy, "
              f"equal outputs {dec['equal_outputs']} of {dec['calls']}): grammar per scored row")
        for name in ("lazy_masks", "full_masks"):
            row, step = dec[name]["row"], dec[name]["step"]
            print(f"  {name.replace('_', ' '):10s}: p50 {row['p50_us']:6.1f} us, p99 "
                  f"{row['p99_us']:6.1f} us, mean {row['mean_us']:6.1f} us ({row['n']} rows); per "
                  f"step p50 {step['p50_us']:6.1f} us, p99 {step['p99_us']:6.1f} us ({step['n']} steps)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
