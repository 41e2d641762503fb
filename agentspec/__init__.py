"""agentspec: exact speculative decoding for LLM agents, drafting from what they have seen.

Heavy modules (torch, transformers) load on first use of the names that need them, so that
``agentspec.stores`` and the ``agentspec cache`` commands stay light.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from agentspec.config import SamplingParams, SpecConfig
from agentspec.errors import (
    AgentSpecError,
    MemoryFaultWarning,
    ModelNotAvailableError,
    StoreError,
    UnsupportedModelError,
    UnsupportedVersionError,
)
from agentspec.types import (
    Draft,
    Generation,
    GenerationStats,
    Origins,
    Record,
    TokenLogprob,
    Verdict,
)

if TYPE_CHECKING:
    from agentspec.engine.load import load_target
    from agentspec.engine.target import HFTarget
    from agentspec.memory.completion import CompletionMemory
    from agentspec.session import record
    from agentspec.speculator import Speculator
    from agentspec.stream import Stream

_LAZY = {
    "Speculator": "agentspec.speculator",
    "Stream": "agentspec.stream",
    "load_target": "agentspec.engine.load",
    "HFTarget": "agentspec.engine.target",
    "CompletionMemory": "agentspec.memory.completion",
    "record": "agentspec.session",
}

__all__ = [
    "AgentSpecError",
    "CompletionMemory",
    "Draft",
    "Generation",
    "GenerationStats",
    "HFTarget",
    "MemoryFaultWarning",
    "ModelNotAvailableError",
    "Origins",
    "Record",
    "SamplingParams",
    "SpecConfig",
    "Speculator",
    "StoreError",
    "Stream",
    "TokenLogprob",
    "UnsupportedModelError",
    "UnsupportedVersionError",
    "Verdict",
    "load_target",
    "record",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentspec' has no attribute {name!r}")
