"""Offline draft replay: tokens per target step of each drafting policy, and their ceiling.

    python -m agentspec.bench.replay --workload bfcl --outputs out/replay-outputs.json

Greedy decoding is deterministic, so once the target's greedy output of every line is known
(generated once with the target and cached in ``--outputs``), replaying drafters over it gives
exactly the steps the decode loop takes: a draft's accepted path is its longest match with the
output, ended at its first node off the draft's spine as the decode loop ends it, and the step
commits that path plus the next output token. ``agentspec bench --lines FILE`` writes a greedy
bench run's outputs in this format, so no generation pass is needed. No target runs in the
replay itself: a policy change is measured in seconds, not in a 7-minute benchmark.

The drafters are the real ones, with a fresh completion memory in a temporary SQLite file that
records the warmup lines and every earlier measured line, as in ``agentspec bench``. Policies:

- ``prompt-lookup``: prompt lookup alone (``agentspec-pld``);
- ``agentspec``: memory, suffix and prompt lookup with tree drafts (``agentspec``);
- ``agentspec-chain``: the same verifying chains only (``agentspec-chain``);
- ``suffix``: suffix matching over earlier outputs and prompt lookup, no semantic lookup
  (``agentspec-suffix``: SuffixDecoding's and REST's sources);
- ``ceiling-pld`` / ``ceiling``: each step the one drafter whose proposal is accepted furthest,
  chosen with hindsight and cut one token past its accepted length: an upper bound on what any
  policy choosing among these drafters' proposals can reach.

A line with a grammar (the workload's ``grammar`` field) is replayed under it when the replay
is given the target's vocabulary (:class:`Constraint`; the bench does this): every draft is
cut and extended as the decode loop does (:meth:`agentspec.grammar.state.GrammarState.constrain`:
forbidden tokens pruned, forced tokens appended), the ceiling's candidates too, so the
ceiling counts the grammar's free tokens that ``agentspec`` gets.

``--sizing-cost`` sizes the drafts by another cost curve than the one the steps are priced
on (``flat``: every forward costs the same, as CUDA graphs make a GPU's): what reaching the
ceiling's tokens per step would cost on this device.

``--cost`` defaults to this machine's cached curve of the model (:func:`cached_cost_file`),
the one its bench runs sized their drafts by; replayed on it, tokens per step match theirs.

``held past the draft`` says where a chain's tokens per step fall short of the ceiling's:
``cut``, what the sizing left out; ``other``, what another source's proposal held
(:mod:`agentspec.bench.held_past`).

``host ms/step`` is the drafter's own time per step (propose and observe; for the ceiling it
includes asking every drafter), measured in the replay on this machine. ``modeled speedup`` is
plain decoding's cost (one forward per output token) over the policy's
summed step costs, both from the cost model (``--cost``; without a cached curve, the built-in
CPU curve of ``agentspec.drafters.policy``); prefill, prefix reuse and Python overheads are
left out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentspec.bench.held_past import Recorder, held_past
from agentspec.bench.replay_lines import Line, generate_lines, load_lines, save_lines
from agentspec.config import SamplingParams, SpecConfig
from agentspec.drafters.chain import DrafterChain
from agentspec.drafters.policy import DEFAULT_COST, CostModel
from agentspec.protocols import DraftContext, Drafter
from agentspec.tree import spine_prefix, sub_draft
from agentspec.types import EMPTY_DRAFT, Draft, Verdict

STOP = -1  # stands for the stop token that ended an output (no draft proposes it)
MODEL = "replay"  # the model fingerprint of the replay's memory rows
POLICIES = ("prompt-lookup", "suffix", "agentspec", "agentspec-chain", "ceiling-pld", "ceiling")


@dataclass(frozen=True)
class Constraint:
    """What a replay needs to decode lines under their grammars: the target's tokenizer, its
    logit width and its stop tokens."""

    tokenizer: Any
    vocab_size: int
    stop_ids: frozenset[int]
    max_nodes: int = 63

    @classmethod
    def of(cls, target: Any) -> Constraint:
        """The constraint of a loaded :class:`~agentspec.engine.target.HFTarget`."""

        return cls(target.tokenizer, target.vocab_size, target.stop_token_ids, target.max_draft_nodes)

    def state(self, line: Line) -> Any:
        """A fresh grammar state for ``line``, or None when it has no grammar."""
        if line.grammar is None:
            return None
        from agentspec.grammar import compiled
        from agentspec.grammar.state import GrammarState

        return GrammarState(compiled(line.grammar), self.tokenizer, vocab_size=self.vocab_size,
                            eos_ids=sorted(self.stop_ids))


@dataclass
class Totals:
    """Measured lines only: steps, output tokens, modeled seconds, accepted tokens by source."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    plain_seconds: float = 0.0
    host_seconds: float = 0.0  # wall-clock time in the drafter's propose and observe
    accepted: Counter[str] = field(default_factory=Counter)
    # Tokens the proposals would have held past what the steps accepted (module docstring);
    # None for a policy that is not a chain of recorded drafters (the ceilings, plain).
    held_cut: int | None = None
    held_other: int | None = None

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def host_ms_per_step(self) -> float:
        return 1000 * self.host_seconds / self.steps if self.steps else 0.0

    @property
    def modeled_speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds else 0.0


def accepted_path(draft: Draft, output: Sequence[int]) -> list[int]:
    """The nodes greedy verification accepts: the longest root path spelling a prefix of
    ``output`` (which holds the tokens still to come, the next one last to be drafted)."""
    children: defaultdict[int, list[int]] = defaultdict(list)
    for node, parent in enumerate(draft.parents):
        children[parent].append(node)
    path: list[int] = []
    node = -1
    while len(path) < len(output) - 1:
        want = output[len(path)]
        node = next((c for c in children[node] if draft.token_ids[c] == want), -2)
        if node == -2:
            break
        path.append(node)
    return path


def spine_cut(draft: Draft, path: list[int]) -> list[int]:
    """``path`` ended at its first node off the draft's spine, as the decode loop ends a
    verdict (:func:`agentspec.decoding.verify.cut_at_spine`: only spine rows decide more than one
    token; the node's token, the target's own at its parent, is the step's next token)."""
    return path[: spine_prefix(draft.parents, path)]


class Hindsight:
    """Each step the proposal of the drafter that the output accepts furthest (cheating on
    purpose: an upper bound), cut one node past its accepted path."""

    name = "hindsight"

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        self.drafters = list(drafters)
        self.output: tuple[int, ...] = ()
        self.prompt_len = 0
        # The line's grammar, applied to each candidate as the decode loop would (or None).
        self.constrain: Callable[[Draft, int], Draft] | None = None

    def begin(self, context: DraftContext) -> None:
        for d in self.drafters:
            d.begin(context)

    def propose(self, context: DraftContext, *, max_tokens: int) -> Draft:
        todo = [*self.output[len(context.tokens) - self.prompt_len :], STOP]
        best, best_path = EMPTY_DRAFT, -1
        for drafter in self.drafters:
            draft = drafter.propose(context, max_tokens=max_tokens)
            if self.constrain is not None:
                draft = self.constrain(draft, max_tokens)
            path = accepted_path(draft, todo) if draft.num_nodes else []
            if draft.num_nodes and len(path) > best_path:
                best, best_path = draft, len(path)
        if best_path <= 0:
            return EMPTY_DRAFT
        path = accepted_path(best, todo)
        keep = sorted(set(path) | {c for c, p in enumerate(best.parents) if p == path[-1]})
        return sub_draft(best, keep[: len(path) + 1])

    def observe(self, context: DraftContext, draft: Draft, verdict: Verdict) -> None:
        for d in self.drafters:
            d.observe(context, draft, verdict)

    def end(self, context: DraftContext) -> None:
        for d in self.drafters:
            d.end(context)


def replay(lines: Sequence[Line], drafter: Drafter, *, memory: Any = None,
           cost: CostModel = DEFAULT_COST, constraint: Constraint | None = None) -> Totals:
    """Run ``drafter`` over every line's known greedy output; totals over measured lines.

    Lines are replayed in order; each one's output is recorded into ``memory`` afterwards
    (warmup lines included), as ``agentspec bench`` does. With ``constraint``, lines with a
    grammar are decoded under it (see the module docstring).
    """
    totals = Totals()
    recorders = [d for d in getattr(drafter, "drafters", ()) if isinstance(d, Recorder)]
    held_cut = held_other = 0
    for line in lines:
        context = DraftContext(tokens=list(line.prompt_ids), prompt_len=len(line.prompt_ids),
                               scope=line.scope, key_text=line.key_text if memory else "",
                               sampling=SamplingParams())
        grammar = constraint.state(line) if constraint is not None else None
        constrain = None if grammar is None or constraint is None else (
            lambda d, room, g=grammar, n=constraint.max_nodes: g.constrain(
                d, room=max(room, 0), max_nodes=n)[0])
        if isinstance(drafter, Hindsight):
            drafter.output, drafter.prompt_len = line.output_ids, len(line.prompt_ids)
            drafter.constrain = constrain
        try:
            steps, seconds, accepted, host, held = _replay_line(
                line, drafter, context, cost, grammar, constrain, recorders)
        finally:
            if grammar is not None:
                grammar.close()
        if memory is not None and line.output_ids:
            memory.record(scope=line.scope, model=MODEL, request_text=line.key_text,
                          key_text=line.key_text, completion_text=line.output_text,
                          completion_ids=list(line.output_ids))
        if line.phase == "measure":
            totals.steps += steps
            totals.tokens += len(line.output_ids)
            totals.seconds += seconds
            totals.host_seconds += host
            totals.plain_seconds += (len(line.output_ids) + line.stopped) * cost.seconds(0)
            totals.accepted.update(accepted)
            held_cut, held_other = held_cut + held[0], held_other + held[1]
    if recorders:
        totals.held_cut, totals.held_other = held_cut, held_other
    return totals


def _replay_line(line: Line, drafter: Drafter, context: DraftContext, cost: CostModel,
                 grammar: Any = None, constrain: Callable[[Draft, int], Draft] | None = None,
                 recorders: Sequence[Recorder] = (),
                 ) -> tuple[int, float, Counter[str], float, tuple[int, int]]:
    # What the steps commit: the output, then the stop token where one ended it.
    todo = [*line.output_ids, STOP] if line.stopped else list(line.output_ids)
    drafter.begin(context)
    steps, seconds, done, accepted, host = 0, 0.0, 0, Counter[str](), 0.0
    held_cut = held_other = 0
    try:
        while done < len(todo):
            room = line.max_new_tokens - done - 1
            for rec in recorders:  # a source the chain skips this step proposed nothing
                rec.last = None
            started = time.perf_counter()
            draft = drafter.propose(context, max_tokens=room) if room > 0 else EMPTY_DRAFT
            host += time.perf_counter() - started
            if constrain is not None:  # as the decode loop: prune what it forbids, add what it forces
                draft = constrain(draft, room)
            rest = [*todo[done:], STOP]
            path = spine_cut(draft, accepted_path(draft, rest))
            if recorders:
                cut, other = held_past(recorders, draft, len(path), rest)
                held_cut, held_other = held_cut + cut, held_other + other
            new = todo[done : done + len(path) + 1]
            if grammar is not None:
                grammar.advance([t for t in new if t != STOP])
            verdict = Verdict(tuple(path), tuple(draft.token_ids[n] for n in path), new[-1])
            context.tokens.extend(t for t in new if t != STOP)
            done += len(new)
            steps += 1
            seconds += cost.seconds(draft.num_nodes)
            accepted.update(draft.source_of(n) for n in path)
            started = time.perf_counter()
            drafter.observe(context, draft, verdict)
            host += time.perf_counter() - started
    finally:
        drafter.end(context)
    return steps, seconds, accepted, host, (held_cut, held_other)


def policies(memory: Any, cost: CostModel) -> dict[str, Callable[[], Drafter]]:
    """The replayed policies, each built fresh (drafters keep per-request state)."""
    from agentspec.drafters.memory import MemoryDrafter
    from agentspec.drafters.prompt_lookup import PromptLookupDrafter
    from agentspec.drafters.suffix import SuffixDrafter

    config = SpecConfig()  # the product's defaults

    def all_drafters() -> list[Drafter]:
        return [MemoryDrafter(memory, MODEL, k=config.memory_neighbours),
                SuffixDrafter(memory, MODEL), PromptLookupDrafter(config)]

    def chain(drafters: list[Drafter], trees: bool = True) -> DrafterChain:
        return DrafterChain([Recorder(d) for d in drafters], cost=cost, trees=trees)

    return {
        "prompt-lookup": lambda: chain([PromptLookupDrafter(config)]),
        "suffix": lambda: chain([SuffixDrafter(memory, MODEL), PromptLookupDrafter(config)]),
        "agentspec": lambda: chain(all_drafters()),
        "agentspec-chain": lambda: chain(all_drafters(), trees=False),
        "ceiling-pld": lambda: Hindsight([PromptLookupDrafter(config)]),
        "ceiling": lambda: Hindsight(all_drafters()),
    }


def run_policies(lines: Sequence[Line], names: Sequence[str] = POLICIES,
                 cost: CostModel = DEFAULT_COST,
                 constraint: Constraint | None = None, *,
                 sizing: CostModel | None = None) -> dict[str, Totals]:
    """Every named policy over ``lines``, each with a fresh memory of its own (with
    ``constraint``: lines with a grammar decoded under it). ``sizing``: the cost curve the
    policies size drafts by, when not the ``cost`` their steps are modeled with (what a
    policy sized for another device would do on this one)."""
    from agentspec.memory.completion import CompletionMemory
    from agentspec.stores import SQLStore

    sizing = cost if sizing is None else sizing
    out: dict[str, Totals] = {}
    for name in names:
        if name in ("prompt-lookup", "ceiling-pld"):
            out[name] = replay(lines, policies(None, sizing)[name](), cost=cost,
                               constraint=constraint)
            continue
        with tempfile.TemporaryDirectory(prefix="agentspec-replay-") as tmp:
            memory = CompletionMemory(SQLStore(f"sqlite:///{Path(tmp) / 'memory.db'}"))
            try:
                out[name] = replay(lines, policies(memory, sizing)[name](), memory=memory,
                                   cost=cost, constraint=constraint)
            finally:
                memory.close()
    return out


def bench_ceiling(workload: Any, warmup_outputs: dict[str, tuple[int, ...]],
                  requests: Sequence[Any], tokenizer: Any,
                  max_new_tokens: int | None = None,
                  constraint: Constraint | None = None, *, save_to: Path | None = None) -> float:
    """The ceiling's tokens per step over a greedy bench run's measured requests.

    The bench's own greedy outputs (the agentspec system's on warmup lines, hf-greedy's on
    measured ones; equal to the target's greedy output, as ``exact`` checks) replace a
    generation pass: the replay then costs seconds. ``max_new_tokens`` is the bench's budget
    override (``None``: each line's own); ``constraint``: lines with a grammar are replayed
    under it, forced tokens included. ``save_to``: the lines are also written there (the
    ``--outputs`` file of :func:`main`).
    """
    from agentspec.bench.results import REFERENCE, prompt_of
    from agentspec.text import conversation_key, encode_prompt

    outputs = dict(warmup_outputs)
    budgets = {}
    for request in requests:
        outputs[request.item.id] = request.outcomes[REFERENCE][0].token_ids
        budgets[request.item.id] = request.max_new_tokens
    lines = []
    for item in workload.items:
        if item.id not in outputs:
            continue
        prompt, out = prompt_of(item), outputs[item.id]
        lines.append(Line(item.id, item.phase, item.scope,
                          tuple(encode_prompt(tokenizer, prompt)), conversation_key(prompt),
                          tuple(out), tokenizer.decode(list(out)),
                          budgets.get(item.id) or max_new_tokens or item.max_new_tokens
                          or len(out) + 1, item.grammar))
    if save_to is not None:
        save_lines(lines, save_to)
    return run_policies(lines, ["ceiling"], constraint=constraint)["ceiling"].tokens_per_step


def read_cost(path: Path) -> CostModel:
    """The curve of a cost file (``$AGENTSPEC_HOME/costs/*.json``)."""
    points = json.loads(path.read_text(encoding="utf-8"))["points"]
    return CostModel.fit([(int(t), float(sec)) for t, sec in points])


def cached_cost_file(model: str) -> Path | None:
    """This machine's cached CPU float32 cost curve of ``model`` (a packaged model's name), when
    ``$AGENTSPEC_HOME/costs`` holds exactly one: the curve the bench's systems sized their
    drafts by here. Replayed on it, tokens per step match the bench's runs (BENCHMARKS.md,
    twentieth session); on another curve the replay answers for that curve's machine."""
    from agentspec.home import agentspec_home

    found = sorted((agentspec_home() / "costs").glob(f"{model}-*-cpu-float32.json"))
    return found[0] if len(found) == 1 else None


def table(results: dict[str, Totals]) -> str:
    head = ("| policy | tok/step | modeled speedup | host ms/step | accepted by source | "
            "held past the draft (cut / other) |\n|---|---:|---:|---:|---|---:|\n")
    rows = [f"| {name} | {t.tokens_per_step:.2f} | {t.modeled_speedup:.2f}x | "
            f"{t.host_ms_per_step:.3f} | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(t.accepted.items())) or '-'} | "
            f"{'-' if t.held_cut is None else f'{t.held_cut} / {t.held_other}'} |"
            for name, t in results.items()]
    return head + "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    from agentspec.bench.workload import resolve_workload

    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.replay",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="bfcl", help="shipped name or JSONL path")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=96,
                        help="budget of lines that name none")
    parser.add_argument("--outputs", type=Path, default=None,
                        help="cache of the greedy outputs: read when it exists, else written")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--cost", type=Path, default=None, metavar="JSON",
                        help="a measured cost curve (a file of $AGENTSPEC_HOME/costs); default "
                             "this machine's cached CPU float32 curve of --model where there is "
                             "exactly one, else the built-in CPU curve")
    parser.add_argument("--sizing-cost", default=None, metavar="JSON|flat",
                        help="size drafts by this curve instead of --cost (steps are still "
                             "modeled with --cost); 'flat': every forward costs the same, as "
                             "on a GPU running CUDA graphs")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        parser.error(f"unknown policy {unknown or args.policies!r}; known: {', '.join(POLICIES)}")
    if args.outputs is not None and args.outputs.exists():
        lines = load_lines(args.outputs)
    else:
        lines = generate_lines(resolve_workload(args.workload), args.model, args.max_new_tokens)
        if args.outputs is not None:
            save_lines(lines, args.outputs)
    measured = sum(1 for line in lines if line.phase == "measure")
    print(f"{args.workload}: {measured} measured lines (+{len(lines) - measured} warmup), "
          f"{sum(len(line.output_ids) for line in lines if line.phase == 'measure')} tokens")
    cost_file = args.cost if args.cost is not None else cached_cost_file(args.model)
    cost = DEFAULT_COST if cost_file is None else read_cost(cost_file)
    print(f"cost curve: {cost_file or 'built-in (no single cached CPU float32 curve of the model)'}")
    sizing = None
    if args.sizing_cost == "flat":
        sizing = CostModel(cost.seconds(0), 0.0)  # no points: base + 0 per token
    elif args.sizing_cost is not None:
        sizing = read_cost(Path(args.sizing_cost))
    constraint = None
    if any(line.grammar is not None for line in lines):  # replayed under their grammars
        from agentspec import load_target

        constraint = Constraint.of(load_target(args.model))
    print(table(run_policies(lines, names, cost, constraint, sizing=sizing)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
