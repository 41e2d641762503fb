"""``python -m agentspec.bench.grammar_cost``'s timers: they time the grammar's public calls
from the bench (a subclass, wrapped calls), and leave the core's classes as they were."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from agentspec.bench import grammar_cost  # noqa: E402
from agentspec.grammar import Grammar  # noqa: E402
from agentspec.grammar.state import GrammarState, LazyMasks  # noqa: E402
from agentspec.types import Draft  # noqa: E402

TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                                "properties": {"city": {"type": "string"}}}}]
CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from agentspec.engine.load import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct")[1]))


def _grammar() -> Grammar:
    return Grammar.tool_calls(TOOLS, choice="required", as_list=True)


def test_a_timed_state_times_one_mask_per_row_only_while_timed(tok) -> None:
    ids = tok.encode(CALL, add_special_tokens=False)
    state = grammar_cost.TimedGrammarState(_grammar(), tok, vocab_size=len(tok),
                                           eos_ids=[tok.eos_token_id])
    assert grammar_cost.walk(state, ids) == len(ids) and state.mask_seconds == []
    state.timed = True
    assert grammar_cost.walk(state, ids) == len(ids)
    assert len(state.mask_seconds) == len(ids) + 1  # the committed state's row, then each node's
    assert all(s >= 0 for s in state.mask_seconds)
    state.close()


def test_timed_steps_counts_each_step_once_and_puts_the_calls_back(tok) -> None:
    ids = tok.encode(CALL, add_special_tokens=False)
    before = (GrammarState.constrain, LazyMasks.forbidding)
    state = GrammarState(_grammar(), tok, vocab_size=len(tok), eos_ids=[tok.eos_token_id])
    with grammar_cost.timed_steps() as steps:
        draft, masks = state.constrain(Draft.chain(ids[:5], "t"), room=8, max_nodes=8,
                                       force=False, lazy=True)
        assert isinstance(masks, LazyMasks) and len(steps) == 1
        constrained = steps[0][0]
        masks.forbidding([tok.eos_token_id] * masks.num_rows)  # adds to the step's seconds
    assert len(steps) == 1 and steps[0][1] == draft.num_nodes + 1
    assert steps[0][0] > constrained
    assert (GrammarState.constrain, LazyMasks.forbidding) == before
    state.close()
