"""What a :class:`~agentspec.Speculator` is built from: its constructor's arguments checked
up front (a wrong type fails here, named, not mid-call later), and the memory a string names
opened (:func:`open_memory`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentspec.config import SpecConfig
from agentspec.drafters.policy import CostModel
from agentspec.engine.target import HFTarget
from agentspec.home import agentspec_home
from agentspec.memory.foreign import REQUIRED


def open_memory(memory: Any) -> Any:
    """``"default"`` | URL | CompletionMemory | None -> a CompletionMemory or None."""
    if memory is None or not isinstance(memory, str):
        return memory
    if not memory:
        raise ValueError("memory must be 'default', a SQLAlchemy URL, a CompletionMemory or None, got ''")
    from agentspec.memory.completion import CompletionMemory

    url = None if memory == "default" else memory
    return CompletionMemory.open(url, index_dir=agentspec_home() / "index")


DRAFTER_METHODS = ("begin", "propose", "observe", "end")


def check_arguments(target: Any, memory: Any, drafters: Any, config: Any, speculate: Any,
                    cost: Any, draft_model: Any) -> None:
    """Refuse bad constructor arguments now, naming them, rather than fail mid-call later."""
    def bad(name: str, expected: str, value: Any) -> TypeError:
        return TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r:.80}")

    if not isinstance(target, HFTarget):
        raise bad("target", "an HFTarget (agentspec.load_target(...))", target)
    if not (memory is None or isinstance(memory, str)
            or all(callable(getattr(memory, m, None)) for m in REQUIRED)):
        raise bad("memory", "a CompletionMemory, a URL string, 'default' or None", memory)
    if drafters is not None:
        if isinstance(drafters, (str, bytes)) or not isinstance(drafters, Sequence):
            raise bad("drafters", "a list of drafters or None", drafters)
        for i, d in enumerate(drafters):
            if not isinstance(getattr(d, "name", None), str) or not all(
                    callable(getattr(d, m, None)) for m in DRAFTER_METHODS):
                raise bad(f"drafters[{i}]", "a Drafter (a str name and begin, propose, observe, "
                          "end methods)", d)
    if config is not None and not isinstance(config, SpecConfig):
        raise bad("config", "a SpecConfig or None", config)
    if not isinstance(speculate, bool):
        raise bad("speculate", "a bool", speculate)
    if isinstance(cost, str):
        if cost != "measure":
            raise ValueError(f"cost must be a CostModel or 'measure', got {cost!r}")
    elif not isinstance(cost, CostModel):
        raise bad("cost", "a CostModel or 'measure'", cost)
    if not (draft_model is None or isinstance(draft_model, (str, HFTarget))):
        raise bad("draft_model", "a model name, an HFTarget or None", draft_model)
