"""A LangChain agent on agentspec: ``langchain.agents.create_agent`` over ChatAgentSpec.

The agent is LangChain's own (``pip install langchain``): it binds the tools, runs the calls
the model makes and feeds the results back. agentspec is only the chat model under it, and
``tool_loop`` puts the agent's model calls in one session and prints what it did (in a longer
run, earlier outputs and tool results are draft sources for the later calls).

The tool step is forced, because the packaged SmolLM2-135M-Instruct does not choose tools by
itself: left to ``tool_choice="auto"`` it answers "12 * 7 = 80" in text, and made to call some
tool it calls ``add``. A middleware therefore runs the model call with ``tool_choice="multiply"``;
agentspec's grammar admits only a valid call of ``multiply`` (its tokens drafted for free) and
the model writes the arguments. ``multiply`` returns directly, so its result is the agent's
answer: given the result to restate, the 135M model writes another call or the wrong number.
A model that chooses its tools and reads their results needs neither. Offline; run
``python examples/langchain_agent.py [--max-tokens N]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.tools import tool

from agentspec.adapters.decorators import current, tool_loop
from agentspec.adapters.langchain import ChatAgentSpec


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool(return_direct=True)  # the agent's answer is this tool's result
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@wrap_model_call
def call_multiply(request: ModelRequest,
                  handler: Callable[[ModelRequest], ModelResponse]) -> ModelResponse:
    """Force the tool step: the model's call must be a call of ``multiply``."""
    return handler(request.override(tool_choice="multiply"))


def show(msg: BaseMessage) -> str:
    """One message as a line: its type, its text, and the tool calls it makes or answers."""
    if isinstance(msg, AIMessage) and msg.tool_calls:
        calls = ", ".join(f"{c['name']}({', '.join(f'{k}={v!r}' for k, v in c['args'].items())})"
                          for c in msg.tool_calls)
        return f"{msg.type:>6}: {msg.text!r} tool_calls: {calls}"
    if isinstance(msg, ToolMessage):
        return f"{msg.type:>6}: {msg.name} -> {msg.text!r}"
    return f"{msg.type:>6}: {msg.text!r}"


def main(max_tokens: int = 64, max_steps: int = 8) -> None:
    chat = ChatAgentSpec.from_pretrained("smollm2-135m-instruct", max_tokens=max_tokens)
    agent = create_agent(chat, tools=[add, multiply], middleware=[call_multiply],
                         system_prompt="Use the tools for arithmetic.")
    spec = chat.speculator
    print("[the tool step is forced (tool_choice='multiply'): the packaged 135M model does not "
          "choose tools by itself; it writes the call's arguments, and the answer is the "
          "tool's result]")

    @tool_loop(spec, scope="calculator-agent")
    def ask(question: str) -> list[BaseMessage]:
        state = agent.invoke({"messages": [{"role": "user", "content": question}]},
                             {"recursion_limit": max_steps})
        s = current(spec)
        assert s is not None
        print(f"[model calls: {s.calls}, {s.stats.new_tokens} tokens in {s.stats.steps} steps, "
              f"accepted by source {s.stats.accepted_by_source}]")
        return state["messages"]

    messages = ask("What is 12 times 7?")
    for msg in messages:
        print(show(msg))
    print(f"answer: {messages[-1].text}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=8,
                        help="the agent graph's recursion limit (model and tool steps)")
    args = parser.parse_args()
    main(args.max_tokens, args.max_steps)
