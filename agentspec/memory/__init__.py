"""The completion memory: past completions in a SQL store (the truth), a vector index per
scope over their keys' embeddings, and what the memory does when its database fails."""

from agentspec.memory.completion import CompletionMemory

__all__ = ["CompletionMemory"]
