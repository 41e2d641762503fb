"""Where agentspec keeps its files. The one place that reads environment variables."""

from __future__ import annotations

import os
from pathlib import Path


def agentspec_home() -> Path:
    """``$AGENTSPEC_HOME``, else ``~/.cache/agentspec``. Not created here."""
    env = os.environ.get("AGENTSPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agentspec"


def default_db_url() -> str:
    """``$AGENTSPEC_DB``, else the SQLite file ``memory.db`` under ``agentspec_home()``."""
    env = os.environ.get("AGENTSPEC_DB")
    if env:
        return env
    return f"sqlite:///{agentspec_home() / 'memory.db'}"


def model_dir() -> Path:
    """Converted models (safetensors + config + tokenizer) live here, one folder each."""
    return agentspec_home() / "models"


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def recording_allowed() -> bool:
    """``$AGENTSPEC_RECORD``: unset or 1/true/yes/on lets calls record their completions into
    a memory; 0/false/no/off records nothing in this process, whatever a call asks (a switch
    for a deployment, above ``SpecConfig.record`` and a call's ``record=``).

    Raises:
        ValueError: another value (the message names it).
    """
    value = os.environ.get("AGENTSPEC_RECORD", "").strip().lower()
    if value in ("", *_ON):
        return True
    if value in _OFF:
        return False
    raise ValueError(f"AGENTSPEC_RECORD must be one of {', '.join(_ON + _OFF)}, "
                     f"got {os.environ['AGENTSPEC_RECORD']!r}")
