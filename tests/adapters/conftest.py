"""Fixtures for the adapter tests; the doubles live in adapter_fakes.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.adapters.adapter_fakes import FakeSpeculator, shared_speculator


@pytest.fixture
def fake_spec() -> FakeSpeculator:
    return FakeSpeculator()


@pytest.fixture(scope="session")
def real_spec() -> Any:
    return shared_speculator()
