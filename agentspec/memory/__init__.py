"""The completion memory: past completions in a SQL store (the truth), a vector index per
scope over their keys' embeddings, and what the memory does when its database fails; a
memory of the user's is wrapped into the same protocol (:func:`as_memory`)."""

from agentspec.memory.completion import CompletionMemory
from agentspec.memory.foreign import ForeignMemory, as_memory

__all__ = ["CompletionMemory", "ForeignMemory", "as_memory"]
