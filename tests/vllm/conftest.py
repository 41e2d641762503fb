"""tests/vllm/ runs where vLLM is installed (``make test-vllm``'s venv); elsewhere (``.venv``,
``make test``) nothing here is collected, so it costs ``make test`` no time."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
