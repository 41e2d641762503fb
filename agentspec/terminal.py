"""The width of a console on an output stream: a terminal's own, or a fixed width in a pipe.

Shared by the ``agentspec`` command and the bench's printed tables (:mod:`agentspec.bench`), so
neither imports the other for it. Imports nothing but the standard library.
"""

from __future__ import annotations

import os
from typing import Any

# Written to a file or a pipe (a CI log, `agentspec bench ... > run.log`), Rich would lay
# tables out in 80 columns and cut the bench's system names to "agen…"; there, lines are as
# wide as a table needs up to PIPE_WIDTH ($COLUMNS still decides where it is set).
PIPE_WIDTH = 200


def output_width(stream: Any, environ: dict[str, str] | None = None) -> int | None:
    """The width for a console on ``stream``: None (the terminal's, or $COLUMNS) on a
    terminal or where $COLUMNS is set, else :data:`PIPE_WIDTH`."""
    env = os.environ if environ is None else environ
    isatty = getattr(stream, "isatty", None)
    if env.get("COLUMNS") or (callable(isatty) and isatty()):
        return None
    return PIPE_WIDTH
