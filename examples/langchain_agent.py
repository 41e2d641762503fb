"""A LangChain agent on agentspec: ``langchain.agents.create_agent`` over ChatAgentSpec.

The agent is LangChain's own (``pip install langchain``): it binds the tools, runs every call
the model makes and feeds the results back until the model answers in text. agentspec is
only the chat model under it; ``tool_loop`` groups the agent's model calls in one session, so
earlier outputs and tool results become draft sources for the later calls, and prints what
the session did. Offline; run ``python examples/langchain_agent.py [--max-tokens N]``.
"""

from __future__ import annotations

import argparse

from langchain.agents import create_agent
from langchain_core.messages import BaseMessage
from langchain_core.tools import tool

from agentspec.adapters.decorators import current, tool_loop
from agentspec.adapters.langchain import ChatAgentSpec


@tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


def main(max_tokens: int = 64, max_steps: int = 8) -> None:
    chat = ChatAgentSpec.from_pretrained("smollm2-135m-instruct", max_tokens=max_tokens)
    agent = create_agent(chat, tools=[add, multiply],
                         system_prompt="Use the tools for arithmetic, then give the final answer.")
    spec = chat.speculator

    @tool_loop(spec, scope="calculator-agent")
    def ask(question: str) -> list[BaseMessage]:
        state = agent.invoke({"messages": [{"role": "user", "content": question}]},
                             {"recursion_limit": max_steps})
        s = current(spec)
        assert s is not None
        print(f"[{s.calls} model calls, {s.stats.new_tokens} tokens in {s.stats.steps} steps, "
              f"accepted by source {s.stats.accepted_by_source}]")
        return state["messages"]

    for msg in ask("What is 12 times 7? Use the multiply tool."):
        calls = getattr(msg, "tool_calls", None)
        print(f"{msg.type:>6}: {msg.text!r}" + (f" tool_calls={calls}" if calls else ""))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=8,
                        help="the agent graph's recursion limit (model and tool steps)")
    args = parser.parse_args()
    main(args.max_tokens, args.max_steps)
