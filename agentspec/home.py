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
