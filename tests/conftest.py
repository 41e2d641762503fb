"""Shared fixtures. The real packaged model loads once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spec():
    """The real packaged SmolLM2-135M-Instruct with prompt lookup only (no memory)."""
    from agentspec import Speculator

    return Speculator.from_pretrained("smollm2-135m-instruct", memory=None)
