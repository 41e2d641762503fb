"""A real multi-turn tool-calling agent on BFCL tasks, plain decoding against agentspec.

The agent (``agentspec.bench.bfcl``) calls BFCL's own file-system tools. Each of its LLM calls
runs twice on one loaded model, plain decoding and agentspec with a completion memory, and
prints both speeds and what agentspec's drafts got accepted. The same tasks then run again:
the warm memory drafts whole completions. Outputs are token-identical (greedy), always.

Offline (model and tasks come from installed packages). This is ``agentspec demo`` as a
library call; run ``python examples/bfcl_agent.py [--tasks 26] [--max-new-tokens 64]
[--max-turns 1] [--max-calls-per-turn 2] [--no-grammar]``.
"""

from __future__ import annotations

import argparse

from agentspec.bench.demo import DEFAULT_TASK_IDS, DemoConfig, print_summary, run_demo, task_ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASK_IDS),
                        help="comma-separated BFCL multi-turn task ids (N: multi_turn_base_N)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=None)
    parser.add_argument("--max-calls-per-turn", type=int, default=2)
    parser.add_argument("--no-grammar", dest="grammar", action="store_false",
                        help="free text instead of tool calls through the grammar")
    args = parser.parse_args()
    config = DemoConfig(task_ids(args.tasks), max_new_tokens=args.max_new_tokens,
                        max_turns=args.max_turns, max_calls_per_turn=args.max_calls_per_turn,
                        grammar=args.grammar)
    summary = run_demo(config)  # cold pass (empty memory), then warm pass
    print_summary(summary)
    cold, warm = summary["passes"]["cold"], summary["passes"]["warm"]
    print(f"memory warm: total speedup {cold['total_speedup']:.2f}x -> "
          f"{warm['total_speedup']:.2f}x, tokens accepted from memory: "
          f"{warm['accepted_by_source'].get('memory', 0)}")
    return 0 if summary["exact_match"]["rate"] == 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
