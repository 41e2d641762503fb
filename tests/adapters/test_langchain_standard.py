"""The langchain-tests standard suites for ChatAgentSpec.

Unit suite: on a fake Speculator (construction only, no model calls). Integration suite: on ONE
shared real SmolLM2-135M Speculator at the suite's own defaults (``max_tokens`` 100). Tool calls,
structured output and JSON mode are grammar-constrained; what the adapter does not support is
declared (images, audio, PDF, model override); where the grammar cannot decide the outcome
(which value the model writes), the test is xfailed with that reason (non-strict: an XPASS is
reported).
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from agentspec.adapters.langchain import ChatAgentSpec
from tests.adapters.adapter_fakes import FakeSpeculator, shared_speculator

SCHEMA_TYPES = ["pydantic", "typeddict", "json_schema"]  # the parent's parametrization
STRING_RUNS_ON = pytest.mark.xfail(reason="which string the model writes is not the grammar's to "
                                   "decide: SmolLM2-135M's greedy joke repeats itself past "
                                   "max_tokens (100), cutting the JSON inside a string")


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

    # Every reply is grammar-constrained, so each output that fits in max_tokens is valid. What
    # the grammar cannot decide is which value the model writes: below, SmolLM2-135M's greedy
    # string value repeats itself ("a cat is a cat, a cat is a cat, ...") until max_tokens, so
    # the JSON is cut before its closing quote (checked by hand on 2026-11-23).
    @STRING_RUNS_ON
    @pytest.mark.parametrize("schema_type", SCHEMA_TYPES)
    def test_structured_output(self, model: BaseChatModel, schema_type: Any) -> None:
        super().test_structured_output(model, schema_type)

    @STRING_RUNS_ON
    @pytest.mark.parametrize("schema_type", SCHEMA_TYPES)
    async def test_structured_output_async(self, model: BaseChatModel, schema_type: Any) -> None:
        await super().test_structured_output_async(model, schema_type)

    @STRING_RUNS_ON
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @STRING_RUNS_ON
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        super().test_structured_output_optional_param(model)

    @STRING_RUNS_ON
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(reason="the test expects a tool call with tool_choice unset ('auto': a "
                              "call or text, the model's choice); SmolLM2-135M answers in text")
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)
