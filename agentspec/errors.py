"""The few exception types agentspec raises besides ValueError/TypeError for bad arguments,
and the one way it warns about a lasting condition (once per message)."""

import warnings


class AgentSpecError(Exception):
    """Base class of every agentspec-specific error."""


class NotFoundError(AgentSpecError, ValueError):
    """A named thing is not there: a model, a workload, a file. A ValueError too, as the bad
    argument it also is."""


class ModelNotAvailableError(AgentSpecError):
    """A model was asked for whose package or files are not installed; the message says how."""


class UnsupportedModelError(AgentSpecError):
    """The target cannot be rolled back exactly (a static KV, for example), or its
    architecture is not one agentspec supports (the message names it and the supported ones)."""


class UnsupportedVersionError(AgentSpecError, ImportError):
    """The installed torch or transformers is outside the range agentspec supports (raised
    when the engine is imported; the message names the installed and supported versions)."""


class ContextLengthError(AgentSpecError, ValueError):
    """A request's prompt plus its ``max_new_tokens`` is longer than the model can attend (the
    message names both counts); a ValueError too, as the bad argument it also is."""


class StoreError(AgentSpecError):
    """The completion memory's database cannot be opened, read or written."""


class MemoryFaultWarning(RuntimeWarning):
    """The completion memory's database failed; generation goes on without it (said once)."""


def warn_once(message: str, _seen: set[str] = set()) -> None:  # noqa: B006 - a deliberate memo
    """Warn with ``message`` the first time it is given in this process only."""
    if message not in _seen:
        _seen.add(message)
        warnings.warn(message, stacklevel=3)
