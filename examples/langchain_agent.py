"""A LangChain tool-calling loop on agentspec: ChatAgentSpec + bind_tools, two python tools.

The loop sends the conversation, runs every tool call the model makes, feeds the results back
as ToolMessages, and stops when the model answers in text or after ``--max-iterations``.
Offline; run ``python examples/langchain_agent.py [--max-tokens N] [--max-iterations N]``.
"""

from __future__ import annotations

import argparse

from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage, ToolMessage
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


TOOLS = {t.name: t for t in (add, multiply)}


def run_agent(chat: ChatAgentSpec, question: str, *, max_iterations: int) -> list[BaseMessage]:
    """Call the model, run its tool calls, repeat until it answers in text or the budget ends."""
    model = chat.bind_tools(list(TOOLS.values()))
    messages: list[BaseMessage] = [
        SystemMessage("Use the tools for arithmetic, then give the final answer."),
        HumanMessage(question)]
    for _ in range(max_iterations):
        reply = model.invoke(messages)
        messages.append(reply)
        calls = getattr(reply, "tool_calls", [])
        for bad in getattr(reply, "invalid_tool_calls", []):
            messages.append(ToolMessage(f"Error: unparseable call {bad['args']!r}",
                                        tool_call_id=bad["id"] or "invalid", status="error"))
        if not calls and not getattr(reply, "invalid_tool_calls", []):
            break  # a plain text answer ends the loop
        for call in calls:
            tool_fn = TOOLS.get(call["name"])
            try:
                result = tool_fn.invoke(call["args"]) if tool_fn else f"unknown tool {call['name']!r}"
            except Exception as exc:  # a bad argument is the model's problem to fix, not a crash
                result = f"Error: {exc}"
            messages.append(ToolMessage(str(result), tool_call_id=call["id"], name=call["name"]))
    return messages


def main(max_tokens: int = 64, max_iterations: int = 4) -> None:
    chat = ChatAgentSpec.from_pretrained("smollm2-135m-instruct", max_tokens=max_tokens)
    spec = chat.speculator

    @tool_loop(spec, scope="calculator-agent")
    def agent(question: str) -> list[BaseMessage]:
        messages = run_agent(chat, question, max_iterations=max_iterations)
        s = current(spec)
        assert s is not None
        print(f"[{s.calls} model calls, {s.stats.new_tokens} tokens in {s.stats.steps} steps, "
              f"accepted by source {s.stats.accepted_by_source}]")
        return messages

    for msg in agent("What is 12 times 7? Use the multiply tool."):
        calls = getattr(msg, "tool_calls", None)
        print(f"{msg.type:>6}: {msg.text!r}" + (f" tool_calls={calls}" if calls else ""))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-iterations", type=int, default=4)
    args = parser.parse_args()
    main(args.max_tokens, args.max_iterations)
