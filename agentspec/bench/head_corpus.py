"""Fill a completion memory with the BFCL agent's own calls: training data for the draft head.

``--live``: the same for the ``bfcl-live`` workload's scopes, from the requests of its tool
sets that the workload does not use.

The agent (:mod:`agentspec.bench.bfcl`) runs BFCL multi-turn tasks whose main tool class is
the given one, through a :class:`~agentspec.Speculator` with a memory, recording every call
in the scope the bench uses (``bfcl-<class>``). Each call is decoded under the task's call
grammar, as the default ``bfcl`` workload was built (``--no-grammar``: plain text). The
default bench's measured tasks are left out, so a head trained on this memory is measured on
tasks it never saw.

    python -m agentspec.bench.head_corpus --db sqlite:///corpus.db --max-seconds 540
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from agentspec.bench import bfcl

# The default bench's measured tasks (held out from every training corpus).
HELD_OUT = tuple(bfcl.DEFAULT_TASK_IDS[3:])


def task_number(task_id: str) -> str:
    """The number a task shares with its variants in the other suites (``..._38`` -> ``38``)."""
    return task_id.rsplit("_", 1)[-1]


def corpus_tasks(class_name: str, *, skip: Sequence[str] = HELD_OUT,
                 suites: Sequence[str] = ("base",)) -> list[bfcl.Task]:
    """BFCL tasks whose main class is ``class_name``, suite by suite, single-class ones first;
    ``skip`` left out, and with it every variant of a skipped task (the same number in another
    suite: the held-out tasks' variants would leak them into a training corpus)."""
    held = {task_number(t) for t in skip}
    out: list[bfcl.Task] = []
    for suite in suites:
        tasks = [t for t in bfcl.load_tasks(suite=suite) if bfcl.main_class(t) == class_name
                 and t.id not in skip and task_number(t.id) not in held]
        out.extend(sorted(tasks, key=lambda t: len(t.involved_classes)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="memory database URL to record into")
    parser.add_argument("--class-name", default="GorillaFileSystem",
                        help="main tool class of the tasks (comma-separated, or 'all'); "
                             "each class records into its own scope, bfcl-<class>")
    parser.add_argument("--live", action="store_true",
                        help="instead of BFCL tasks: the bfcl-live workload's tool sets' other "
                             "requests (neither its warmup nor its measured lines), each under "
                             "its reply grammar, in the workload's scopes")
    parser.add_argument("--head-rows", action="store_true",
                        help="keep the target's hidden rows of each call for head training "
                             "(SpecConfig(head_rows=True))")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-seconds", type=float, default=540.0,
                        help="stop starting tasks after this long")
    parser.add_argument("--suites", default="base",
                        help=f"comma-separated BFCL multi-turn suites, among {', '.join(bfcl.SUITES)}")
    parser.add_argument("--max-calls", type=int, default=None,
                        help="stop starting tasks once this many calls are recorded")
    parser.add_argument("--no-grammar", action="store_true",
                        help="decode without the task's call grammar")
    parser.add_argument("--skip-done", action="store_true",
                        help="leave out tasks already named in --done-file")
    parser.add_argument("--done-file", default=None)
    args = parser.parse_args(argv)

    from agentspec import SamplingParams, SpecConfig, Speculator, load_target
    from agentspec.grammar import compiled
    from agentspec.memory.completion import CompletionMemory

    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = [s for s in suites if s not in bfcl.SUITES]
    if unknown or not suites:
        parser.error(f"--suites: unknown suite(s) {unknown or args.suites!r}; "
                     f"known: {', '.join(bfcl.SUITES)}")
    if args.max_calls is not None and args.max_calls < 1:
        parser.error(f"--max-calls must be a positive integer, got {args.max_calls}")

    done: set[str] = set()
    if args.done_file and args.skip_done:
        try:
            done = set(open(args.done_file).read().split())
        except FileNotFoundError:
            pass
    known = sorted({bfcl.main_class(t) for t in bfcl.load_tasks()})
    classes = known if args.class_name == "all" else [
        c.strip() for c in args.class_name.split(",") if c.strip()]
    if not classes or any(c not in known for c in classes):
        parser.error(f"--class-name: unknown class in {args.class_name!r}; known: "
                     f"{', '.join(known)} or 'all'")
    spec = Speculator(load_target(args.model), memory=CompletionMemory.open(args.db),
                      config=SpecConfig(head_rows=args.head_rows))
    spec.warmup()
    scope = ""
    started, calls = time.perf_counter(), 0

    def generate(messages: list[dict[str, str]], grammar: Any = None) -> str:
        nonlocal calls
        calls += 1
        sampling = SamplingParams(grammar=None if grammar is None else compiled(grammar))
        return str(spec.generate(messages, args.max_new_tokens, sampling=sampling,
                                 scope=scope).text)

    if args.live:
        from agentspec.bench import bfcl_live
        from agentspec.bench.results import grammar_of, prompt_of

        for item in bfcl_live.build_workload(bfcl_live.load_entries(), rest=True):
            sampling = SamplingParams(grammar=None if args.no_grammar else grammar_of(item))
            spec.generate(prompt_of(item), item.max_new_tokens or args.max_new_tokens,
                          sampling=sampling, scope=item.scope)
            calls += 1
        print(f"bfcl-live: {calls} calls, {time.perf_counter() - started:.0f} s", flush=True)
        spec.memory.close()  # type: ignore[union-attr]
        return 0
    tasks = [(c, t) for c in classes for t in corpus_tasks(c, skip=HELD_OUT, suites=suites)]
    for class_name, task in tasks:
        scope = f"bfcl-{class_name}"
        if task.id in done:
            continue
        if time.perf_counter() - started > args.max_seconds:
            break
        if args.max_calls is not None and calls >= args.max_calls:
            break
        bfcl.run_task(task, generate, max_calls_per_turn=bfcl.DEFAULT_MAX_CALLS_PER_TURN,
                      constrain=not args.no_grammar)
        if args.done_file:
            with open(args.done_file, "a") as f:
                f.write(task.id + "\n")
        print(f"{task.id}: {calls} calls, {time.perf_counter() - started:.0f} s", flush=True)
    spec.memory.close()  # type: ignore[union-attr]
    return 0


if __name__ == "__main__":
    sys.exit(main())
