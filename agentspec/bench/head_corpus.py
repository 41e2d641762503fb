"""Fill a completion memory with the BFCL agent's own calls: training data for the draft head.

The agent (:mod:`agentspec.bench.bfcl`) runs BFCL multi-turn tasks whose main tool class is
the given one, through a :class:`~agentspec.Speculator` with a memory, recording every call
in the scope the bench uses (``bfcl-<class>``). The default bench's measured tasks are left
out, so a head trained on this memory is measured on tasks it never saw.

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


def corpus_tasks(class_name: str, *, skip: Sequence[str] = HELD_OUT) -> list[bfcl.Task]:
    """BFCL tasks whose main class is ``class_name``, single-class ones first, ``skip`` left out."""
    tasks = [t for t in bfcl.load_tasks() if bfcl.main_class(t) == class_name and t.id not in skip]
    return sorted(tasks, key=lambda t: len(t.involved_classes))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="memory database URL to record into")
    parser.add_argument("--class-name", default="GorillaFileSystem")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-seconds", type=float, default=540.0,
                        help="stop starting tasks after this long")
    parser.add_argument("--skip-done", action="store_true",
                        help="leave out tasks already named in --done-file")
    parser.add_argument("--done-file", default=None)
    args = parser.parse_args(argv)

    from agentspec import Speculator, load_target
    from agentspec.memory import CompletionMemory

    done: set[str] = set()
    if args.done_file and args.skip_done:
        try:
            done = set(open(args.done_file).read().split())
        except FileNotFoundError:
            pass
    spec = Speculator(load_target(args.model), memory=CompletionMemory.open(args.db))
    spec.warmup()
    scope = f"bfcl-{args.class_name}"
    started, calls = time.perf_counter(), 0

    def generate(messages: list[dict[str, str]], grammar: Any = None) -> str:
        # the agent's plain calls (no grammar): the completions the bench's memory records
        nonlocal calls
        calls += 1
        return str(spec.generate(messages, args.max_new_tokens, scope=scope).text)

    for task in corpus_tasks(args.class_name, skip=(*HELD_OUT, *done)):
        if time.perf_counter() - started > args.max_seconds:
            break
        bfcl.run_task(task, generate, max_calls_per_turn=bfcl.DEFAULT_MAX_CALLS_PER_TURN)
        if args.done_file:
            with open(args.done_file, "a") as f:
                f.write(task.id + "\n")
        print(f"{task.id}: {calls} calls, {time.perf_counter() - started:.0f} s", flush=True)
    spec.memory.close()  # type: ignore[union-attr]
    return 0


if __name__ == "__main__":
    sys.exit(main())
