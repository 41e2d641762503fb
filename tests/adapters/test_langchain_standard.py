"""The langchain-tests standard suites for ChatAgentSpec.

Unit suite: on a fake Speculator (construction only, no model calls). Integration suite: on ONE
shared real SmolLM2-135M Speculator with small ``max_tokens``. What the adapter does not support
is declared (images, audio, PDF, model override); what a 135M model cannot do well enough for the
suite's semantic assertions is xfailed with the reason (non-strict: an XPASS is reported).
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from agentspec.adapters.langchain import ChatAgentSpec
from tests.adapters.adapter_fakes import FakeSpeculator, shared_speculator

SMALL = "a 135M model rarely"
WEAK_TOOLS = pytest.mark.xfail(reason=f"{SMALL} emits the exact tool call JSON (name and args) "
                               "the test asserts within the suite's small max_tokens")
SCHEMA_TYPES = ["pydantic", "typeddict", "json_schema"]  # the parent's parametrization
WEAK_JSON = pytest.mark.xfail(reason=f"{SMALL} completes a JSON object matching the joke schema "
                              "within the suite's small max_tokens")


class _Features:
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatAgentSpec

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True  # "any"/"required"/a name force the call's JSON prefix

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False  # one instance wraps one loaded Speculator


class TestChatAgentSpecUnit(_Features, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"speculator": FakeSpeculator()}


class TestChatAgentSpecIntegration(_Features, ChatModelIntegrationTests):
    """At the suite's own defaults (``max_tokens`` 100, temperature 0): nothing lowered."""

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"speculator": shared_speculator()}
