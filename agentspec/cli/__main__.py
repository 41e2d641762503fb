"""``python -m agentspec.cli``: the same as the ``agentspec`` command."""

from agentspec.cli import main

main()
