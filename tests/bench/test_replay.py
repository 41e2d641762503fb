"""The offline replay: steps equal what the decode loop would take; the ceiling bounds policies."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from agentspec.bench import replay as rp
from agentspec.bench.held_past import Recorder, held_past
from agentspec.config import SpecConfig
from agentspec.decoding.loop import NoDrafter
from agentspec.drafters.chain import DrafterChain
from agentspec.drafters.policy import CostModel
from agentspec.drafters.prompt_lookup import PromptLookupDrafter
from agentspec.types import Draft

FREE = CostModel(base=1.0, per_token=1e-6)  # drafting is (almost) free: always draft


def _line(prompt, output, *, phase="measure", budget=16, id="a"):
    return rp.Line(id, phase, "s", tuple(prompt), "key " + id, tuple(output), "text", budget)


def test_accepted_path_walks_the_tree_and_leaves_room_for_the_next_token():
    tree = Draft((5, 6, 7, 6, 9), (-1, 0, 1, -1, 3), "m")
    assert rp.accepted_path(tree, [5, 6, 7, 8]) == [0, 1, 2]
    assert rp.accepted_path(tree, [6, 9, 1]) == [3, 4]
    assert rp.accepted_path(tree, [5, 6]) == [0]  # the last output token is never drafted
    assert rp.accepted_path(tree, [4, 6, 7]) == []


class _TreeOnce:
    """Proposes one fixed tree at the first step, nothing after."""

    name = "m"

    def __init__(self, tree):
        self.tree, self.proposed = tree, False

    def begin(self, context):
        self.proposed = False

    def propose(self, context, *, max_tokens):
        if self.proposed:
            return Draft()
        self.proposed = True
        return self.tree

    def observe(self, context, draft, verdict):
        pass

    def end(self, context):
        pass


def test_a_path_off_the_spine_ends_the_step_as_the_decode_loop_ends_it():
    # spine 5 6 7; an alternative 6 -> 9 under the root, and 4 under the spine's first node
    tree = Draft((5, 6, 7, 6, 9, 4), (-1, 0, 1, -1, 3, 0), "m")
    assert rp.spine_cut(tree, [0, 1, 2]) == [0, 1, 2]
    assert rp.spine_cut(tree, [3, 4]) == []  # the root's alternative: its token is the next one
    assert rp.spine_cut(tree, [0, 5]) == [0]
    # Replayed: the output takes the alternative branch 6 9, so the first step commits only 6
    # (the target's own token at the root), not 6 9 and the token after them.
    line = _line([1, 2], [6, 9, 3], budget=16)
    totals = rp.replay([line], _TreeOnce(tree))
    assert totals.steps == 4 and totals.accepted["m"] == 0
    along = rp.replay([_line([1, 2], [5, 6, 7, 3], budget=16)], _TreeOnce(tree))
    assert along.steps == 2 and along.accepted["m"] == 3  # the spine: 3 drafts + 3, then the stop


def test_plain_decoding_takes_one_step_per_token_and_one_for_the_stop():
    stopped = _line([1, 2, 3], [4, 5, 6], budget=16)
    cut = _line([1, 2, 3], [4, 5, 6], budget=3, id="b")
    assert rp.replay([stopped], NoDrafter()).steps == 4
    assert rp.replay([cut], NoDrafter()).steps == 3


def test_prompt_lookup_copies_a_repeated_span_in_few_steps():
    span = list(range(10, 30))
    line = _line([1, 2, *span, 3], [1, 2, *span], budget=40)
    drafter = DrafterChain([PromptLookupDrafter(SpecConfig())], cost=FREE)
    totals = rp.replay([line], drafter, cost=FREE)
    assert totals.steps <= 4 and totals.tokens == 22
    assert totals.accepted["prompt_lookup"] >= 19
    assert totals.modeled_speedup > 4


def test_warmup_lines_are_not_counted():
    lines = [_line([1], [2, 3], phase="warmup", id="w"), _line([1], [2, 3], id="m")]
    assert rp.replay(lines, NoDrafter()).tokens == 2


def test_ceiling_is_at_least_every_policy_and_memory_replays_a_repeat(tmp_path: Path):
    body = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    lines = [_line([1, 2, 3], body, phase="warmup", id="w"),
             _line([1, 2, 4], [5, *body], id="m1"),
             _line([1, 2, 3], body, id="m2")]
    results = rp.run_policies(lines, cost=FREE)
    assert set(results) == set(rp.POLICIES)
    for name in ("prompt-lookup", "suffix", "agentspec", "agentspec-chain"):
        assert results["ceiling"].tokens_per_step >= results[name].tokens_per_step - 1e-9
    assert results["ceiling-pld"].tokens_per_step >= results["prompt-lookup"].tokens_per_step
    # The repeat of the warmup line is drafted from memory; prompt lookup alone cannot.
    assert results["agentspec"].accepted["memory"] >= len(body) - 1
    assert results["agentspec"].tokens_per_step > results["prompt-lookup"].tokens_per_step
    # The suffix policy finds it too once three tokens match an earlier output.
    assert results["suffix"].accepted["suffix"] > 0


def test_lines_round_trip_and_the_table(tmp_path: Path):
    lines = [_line([1, 2], [3, 4]), _line([5], [6], phase="warmup", id="w")]
    rp.save_lines(lines, tmp_path / "o.json")
    assert rp.load_lines(tmp_path / "o.json") == lines
    text = rp.table({"prompt-lookup": rp.replay(lines, NoDrafter())})
    assert "| prompt-lookup | 0.67 | 1.00x |" in text  # 2 tokens, 3 steps (the stop)


def test_cli_reads_cached_outputs_and_rejects_unknown_policies(tmp_path: Path, capsys):
    out = tmp_path / "o.json"
    rp.save_lines([_line([1, 2, 3], [1, 2, 3, 1, 2, 3])], out)
    assert rp.main(["--outputs", str(out), "--policies", "prompt-lookup,ceiling-pld"]) == 0
    printed = capsys.readouterr().out
    assert "| prompt-lookup |" in printed and "| ceiling-pld |" in printed
    with pytest.raises(SystemExit):
        rp.main(["--outputs", str(out), "--policies", "nope"])


class _CharTokenizer:
    """One token per character (ord), enough for raw-prompt lines."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_bench_ceiling_replays_the_bench_outputs(tmp_path: Path):
    from agentspec.bench.results import Outcome, RequestResult
    from agentspec.bench.workload import Workload, WorkloadItem

    body = tuple(range(200, 230))
    warm = WorkloadItem(id="w", prompt="tell me", phase="warmup", max_new_tokens=40)
    again = WorkloadItem(id="m", prompt="tell me", max_new_tokens=40)
    workload = Workload(tmp_path / "x.jsonl", (warm, again), ())
    requests = [RequestResult(again, 7, 40, {"hf-greedy": (Outcome(body, 1.0),)})]
    ceiling = rp.bench_ceiling(workload, {"w": body}, requests, _CharTokenizer())
    # the measured line repeats the warmup line: the memory drafts it in one or two steps
    assert ceiling >= len(body) / 2
    assert rp.bench_ceiling(workload, {}, requests, _CharTokenizer()) < 2  # nothing remembered
    # --lines: the same lines, written for the offline replay, give the same ceiling there
    saved = tmp_path / "lines.json"
    assert rp.bench_ceiling(workload, {"w": body}, requests, _CharTokenizer(), save_to=saved) == ceiling
    lines = rp.load_lines(saved)
    assert [(line.id, line.phase, line.output_ids) for line in lines] == [("w", "warmup", body),
                                                                            ("m", "measure", body)]
    assert rp.run_policies(lines, ["ceiling"])["ceiling"].tokens_per_step == ceiling


def test_versus_names_the_best_single_source_and_the_share_of_the_ceiling():
    from agentspec.bench.report import versus, versus_line

    systems = {"agentspec-pld": {"tokens_per_second": 20.0},
               "agentspec": {"tokens_per_second": 25.0, "tokens_per_step": 2.7}}
    v = versus(systems, 3.0)
    assert v == {"best_single_source": "agentspec-pld", "over_best_single_source": 1.25,
                 "ceiling_tokens_per_step": 3.0, "of_ceiling": 0.9}
    assert versus_line({"workload": "w", "versus": v}) == (
        "w: agentspec/agentspec-pld 1.25x (tokens/s); agentspec tok/step 90% of the replay "
        "ceiling (3.00)")
    assert versus({"agentspec-pld": {"tokens_per_second": 1.0}}, 3.0) == {}


def test_lines_with_a_grammar_are_replayed_under_it_forced_tokens_included():
    from transformers import AutoTokenizer

    from agentspec.engine.load import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct")[1]))
    grammar = {"type": "tool_calls", "as_list": True, "choice": "required", "tools": [
        {"name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                               "properties": {"city": {"type": "string"}}}}]}
    output = tok.encode('[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    line = rp.Line("g", "measure", "s", (1, 2, 3), "key g", tuple(output), "text", 64, grammar)
    constraint = rp.Constraint(tok, len(tok), frozenset({tok.eos_token_id}))
    plain = rp.replay([line], NoDrafter())
    forced = rp.replay([line], NoDrafter(), constraint=constraint)
    assert plain.steps == len(output) + 1 and plain.tokens == forced.tokens
    # The skeleton (name, key, braces) is forced: the steps left are the value's tokens, the
    # list's end (another call could follow) and the stop.
    assert forced.steps <= 6 and forced.accepted["grammar"] >= len(output) - 6
    ceiling = rp.run_policies([line], ["ceiling"], constraint=constraint)["ceiling"]
    assert ceiling.steps <= forced.steps


def test_sizing_by_another_curve_sizes_as_that_curve_and_is_modeled_with_this_one(tmp_path: Path):
    # A long copy from the prompt: sized as if forwards were free, prompt lookup drafts it in
    # fewer steps than sized for a steep curve, and those steps are modeled on the steep one.
    span = list(range(20, 60))
    lines = [_line([1, 2, *span, 3], [1, 2, *span], budget=48)]
    steep = CostModel(base=0.01, per_token=0.01)  # a 40-token forward costs 40x a 1-token one
    own = rp.run_policies(lines, ["prompt-lookup"], steep)["prompt-lookup"]
    free = rp.run_policies(lines, ["prompt-lookup"], FREE)["prompt-lookup"]
    sized_free = rp.run_policies(lines, ["prompt-lookup"], steep, sizing=FREE)["prompt-lookup"]
    assert sized_free.steps == free.steps < own.steps  # sized as on the free curve
    assert sized_free.plain_seconds == own.plain_seconds != free.plain_seconds
    assert sized_free.seconds != free.seconds
    out = tmp_path / "o.json"
    rp.save_lines(lines, out)
    cost = tmp_path / "steep.json"
    cost.write_text('{"points": [[1, 0.02], [64, 0.65]]}')
    assert rp.main(["--outputs", str(out), "--policies", "prompt-lookup", "--cost", str(cost),
                    "--sizing-cost", "flat"]) == 0


def test_the_cli_prices_on_the_machines_own_cached_curve_of_the_model(tmp_path: Path, capsys,
                                                                       monkeypatch):
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path / "home"))
    out = tmp_path / "o.json"
    rp.save_lines([_line([1, 2, 3], [1, 2, 3, 1, 2, 3])], out)
    costs = tmp_path / "home" / "costs"
    costs.mkdir(parents=True)
    (costs / "tiny-0123-cuda-bfloat16.json").write_text('{"points": [[1, 0.01], [64, 0.02]]}')
    assert rp.cached_cost_file("tiny") is None  # no CPU float32 curve: the built-in one
    mine = costs / "tiny-0123-cpu-float32.json"
    mine.write_text('{"points": [[1, 0.02], [64, 0.65]]}')
    assert rp.cached_cost_file("tiny") == mine
    assert rp.main(["--outputs", str(out), "--model", "tiny", "--policies", "prompt-lookup"]) == 0
    assert f"cost curve: {mine}" in capsys.readouterr().out
    (costs / "tiny-4567-cpu-float32.json").write_text(mine.read_text())  # two fingerprints
    assert rp.cached_cost_file("tiny") is None


def test_held_past_splits_what_the_sizing_cut_from_what_another_source_had():
    todo = [5, 6, 7, 8, 9, rp.STOP]
    # held_past reads only each recorder's name and its last proposal
    mine, theirs = Recorder(SimpleNamespace(name="a")), Recorder(SimpleNamespace(name="b"))
    mine.last = Draft.chain([5, 6, 7, 0], "a")     # would have held 3
    theirs.last = Draft.chain([5, 6, 7, 8, 9, 4], "b")  # would have held 5: all but the stop
    verified = Draft.chain([5], "a")               # the sizing kept one node: 1 accepted
    assert held_past([mine, theirs], verified, 1, todo) == (2, 2)
    # Had the chain verified b's whole proposal, nothing was left anywhere.
    assert held_past([mine, theirs], theirs.last, 5, todo) == (0, 0)
    # A source that proposed nothing this step (skipped) counts for nothing; with no draft
    # verified, the sizing left out the best proposal's held tokens.
    theirs.last = None
    assert held_past([mine, theirs], Draft(), 0, todo) == (3, 0)
    # A tree is scored by its spine, as the decode loop verifies it.
    mine.last = Draft((5, 6, 9, 7), (-1, 0, -1, 2), "a")  # spine 5 6; 9 7 off it
    assert held_past([mine], Draft.chain([5], "a"), 1, todo) == (1, 0)


def test_the_replay_counts_the_tokens_a_dear_forward_left_unverified():
    span = list(range(10, 40))
    line = _line([1, 2, *span, 3], [1, 2, *span], budget=40)
    dear = CostModel(base=1.0, per_token=1.0)  # every drafted node costs a forward: draft little
    runs = {}
    for name, cost in (("free", FREE), ("dear", dear)):
        chain = DrafterChain([Recorder(PromptLookupDrafter(SpecConfig()))], cost=cost)
        runs[name] = rp.replay([line], chain, cost=cost)
        assert runs[name].held_other == 0  # one source: nothing elsewhere
    # Drafting little, the steps accept less of what prompt lookup proposed, and the count
    # says how much: every step leaves the rest of the span unverified.
    assert runs["dear"].steps > runs["free"].steps
    assert runs["dear"].held_cut > 2 * runs["free"].held_cut + 100
    assert rp.replay([line], NoDrafter()).held_cut is None  # not a chain of recorders
    assert " | - |" in rp.table({"plain": rp.replay([line], NoDrafter())})
