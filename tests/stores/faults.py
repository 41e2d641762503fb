"""Helpers of the memory-fault tests (test_memory_faults.py, test_index_faults.py)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from agentspec.errors import MemoryFaultWarning
from agentspec.memory.completion import CompletionMemory


def rec(memory: CompletionMemory, key: str, *, text: str | None = None, n: int = 4) -> int:
    return memory.record(scope="s", model="m", request_text=key, key_text=key,
                         completion_text=text or f"answer to {key}",
                         completion_ids=list(range(n)))


def fault_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, MemoryFaultWarning)]


@contextmanager
def catching() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
