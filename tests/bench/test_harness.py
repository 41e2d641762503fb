"""The bench loop and its report on fake systems (the ``System`` seam): no model, fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentspec.bench import harness, report
from agentspec.bench.prompts import GROUNDED, OPEN
from agentspec.bench.results import BenchConfig, BenchResult, Outcome, RequestResult
from agentspec.bench.workload import WorkloadItem, load_workload, write_workload

ALL = ("hf-greedy", "hf-pld", "agentspec-pld", "agentspec")


class FakeSystem:
    """Returns fixed tokens (``offset`` shifts them: a wrong system) and logs its calls."""

    def __init__(self, name: str, log: list[tuple[str, str]], *, offset: int = 0,
                 seconds: float = 1.0, extra_tokens: int = 0) -> None:
        self.name, self.log, self.offset = name, log, offset
        self.seconds, self.extra_tokens = seconds, extra_tokens

    def run(self, item: WorkloadItem, max_new_tokens: int, seed: int | None) -> Outcome:
        self.log.append((self.name, item.id))
        n = min(max_new_tokens, 4 + self.extra_tokens + (seed or 0) % 3)
        tokens = tuple(range(self.offset, self.offset + n))
        spec = self.name.startswith("agentspec")
        return Outcome(tokens, self.seconds, steps=2 if spec else None,
                       accepted={"prompt_lookup": 2} if spec else {},
                       cached_tokens=2 if self.name == "agentspec" else 0)


def _workload(tmp_path: Path) -> object:
    items = [WorkloadItem(id="warm", phase="warmup", prompt="w")]
    items += [WorkloadItem(id=f"{g}-{i}", prompt=f"p{i}") for g in ("grounded", "open")
              for i in range(2)]
    write_workload(tmp_path / "w.jsonl", items)
    return load_workload(tmp_path / "w.jsonl", default_max_new_tokens=8)


def _run(tmp_path: Path, systems: dict, config: BenchConfig) -> BenchResult:
    workload = _workload(tmp_path)
    requests = harness.run_requests(workload, systems, config,  # type: ignore[arg-type]
                                    encode=lambda p: [1, 2, 3])
    return BenchResult("w.jsonl", "fake", "cpu", config, 1, requests)


def test_interleaved_rotated_and_warmup_through_agentspec_systems_only(tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    systems = {n: FakeSystem(n, log) for n in ALL}
    _run(tmp_path, systems, BenchConfig(systems=ALL))
    # the systems that carry state across calls (memory, prefix cache), not transformers
    assert log[:2] == [("agentspec-pld", "warm"), ("agentspec", "warm")]
    per_request = [[n for n, i in log[2:] if i == rid] for rid in
                   ("grounded-0", "grounded-1", "open-0", "open-1")]
    assert per_request == [harness.rotation(ALL, k) for k in range(4)]
    assert per_request[1][0] == "hf-pld"  # rotated by one


def test_warmup_runs_through_every_memory_system(tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    names = ("hf-greedy", "agentspec", "agentspec-chain")
    _run(tmp_path, {n: FakeSystem(n, log) for n in names}, BenchConfig(systems=names))
    assert log[:2] == [("agentspec", "warm"), ("agentspec-chain", "warm")]
    assert ("hf-greedy", "warm") not in log


def test_warmup_runs_through_prompt_lookup_but_not_plain_decoding(tmp_path: Path) -> None:
    # agentspec-pld keeps a prefix cache and acceptance estimates across calls; plain
    # decoding reuses nothing, so warming it would only cost time.
    log: list[tuple[str, str]] = []
    names = ("hf-greedy", "agentspec-plain", "agentspec-pld")
    _run(tmp_path, {n: FakeSystem(n, log) for n in names}, BenchConfig(systems=names))
    assert [entry for entry in log if entry[1] == "warm"] == [("agentspec-pld", "warm")]


def test_summary_fields_and_exact_match(tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    systems = {n: FakeSystem(n, log, seconds=0.5 if n == "agentspec" else 1.0) for n in ALL}
    summary = report.summarize(_run(tmp_path, systems, BenchConfig(systems=ALL)))
    assert summary["measured_requests"] == 4 and summary["device"] == "cpu"
    assert summary["exact_match"] == {"hf-pld": 1.0, "agentspec-pld": 1.0, "agentspec": 1.0}
    a = summary["systems"]["agentspec"]
    assert a["speedup"] == pytest.approx(2.0) and a["median_speedup"] == pytest.approx(2.0)
    assert a["tokens_per_step"] == pytest.approx(2.0)
    assert a["accepted_by_source"]["prompt_lookup"] == 8 and a["accepted_by_source"]["memory"] == 0
    assert summary["systems"]["hf-greedy"]["speedup"] == 1.0
    assert set(summary["groups"]) == {"grounded", "open"}
    assert summary["groups"]["grounded"]["ratios"]["agentspec-pld/hf-pld"] == pytest.approx(1.0)
    assert len(summary["requests"]) == 4
    json.dumps(summary)  # JSON-ready
    assert "| agentspec |" in report.to_markdown(summary)


def test_a_wrong_system_is_reported(tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    systems = {n: FakeSystem(n, log, offset=7 if n == "agentspec-pld" else 0) for n in ALL}
    summary = report.summarize(_run(tmp_path, systems, BenchConfig(systems=ALL)))
    assert summary["exact_match"]["agentspec-pld"] == 0.0
    assert summary["exact_match"]["agentspec"] == 1.0
    assert not summary["requests"][0]["systems"]["agentspec-pld"]["matches_reference"]
    assert "≠" in report.to_markdown(summary)


def test_distribution_check_flags_a_biased_system(tmp_path: Path) -> None:
    names = ("hf-greedy", "agentspec-pld", "agentspec")
    log: list[tuple[str, str]] = []
    systems = {n: FakeSystem(n, log, extra_tokens=3 if n == "agentspec" else 0) for n in names}
    config = BenchConfig(systems=names, temperature=0.7, samples=3, max_new_tokens=64)
    summary = report.summarize(_run(tmp_path, systems, config))
    assert summary["exact_match"] == {}
    check = summary["distribution_check"]
    assert check["agentspec-pld"]["ok"] and check["agentspec-pld"]["p_value"] > 0.5
    # 4 requests can give p >= 1/8 at best with a sign-flip test; the bias is in every one.
    assert check["agentspec"]["mean_length_difference"] == pytest.approx(3.0)
    assert check["agentspec"]["p_value"] <= 0.13
    assert sum(n == "hf-greedy" for n, _ in log) == 4 * 3  # 4 requests, 3 seeds each


def test_cut_at_stop() -> None:
    from agentspec.text import cut_at_stop

    assert cut_at_stop([5, 6, 2, 7], frozenset({2})) == ((5, 6), True)
    assert cut_at_stop([5, 6], frozenset({2})) == ((5, 6), False)


def test_shipped_prompts_workload_is_the_bundled_prompts() -> None:
    from agentspec.bench.workload import data_dir

    w = load_workload(data_dir() / "prompts.jsonl", default_max_new_tokens=128)
    assert [i.id for i in w.measure] == [f"grounded-{i}" for i in range(len(GROUNDED))] + \
        [f"open-{i}" for i in range(len(OPEN))]
    for item, prompt in zip(w.measure, GROUNDED + OPEN, strict=True):
        assert (item.prompt == prompt) if isinstance(prompt, str) else \
            ([dict(m) for m in item.messages or ()] == prompt)


def test_shipped_bfcl_workload_loads() -> None:
    from agentspec.bench.workload import data_dir

    w = load_workload(data_dir() / "bfcl.jsonl", default_max_new_tokens=128)
    assert w.errors == () and w.warmup and w.measure
    assert {i.scope for i in w.measure} <= {i.scope for i in w.warmup}


class CompilingFakeSystem(FakeSystem):
    """A fake with ``warm`` (as hf-static has): logged as ``warm:<id>``."""

    def warm(self, item: WorkloadItem, max_new_tokens: int) -> None:
        self.log.append((self.name, f"warm:{item.id}:{max_new_tokens}"))


def test_a_compiling_system_is_warmed_once_on_the_first_measured_request(tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    names = ("hf-greedy", "hf-static", "agentspec")
    systems = {n: (CompilingFakeSystem if n == "hf-static" else FakeSystem)(n, log)
               for n in names}
    _run(tmp_path, systems, BenchConfig(systems=names))
    warms = [entry for entry in log if entry[1].startswith("warm:")]
    assert warms == [("hf-static", "warm:grounded-0:8")]
    # after the memory warmup, before any measured run
    assert log.index(warms[0]) == 1 and log[0] == ("agentspec", "warm")
    assert sum(n == "hf-static" for n, _ in log) == 1 + 4  # warm + one run per request


def test_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="'fp8'"):
        BenchConfig(systems=("hf-greedy",), dtype="fp8")


@pytest.mark.parametrize(("dtype", "name"), [("float32", "fp32"), ("bfloat16", "bf16"),
                                             ("float16", "fp16")])
def test_environment_names_dtype_and_versions(dtype: str, name: str) -> None:
    import torch
    import transformers

    model = torch.nn.Linear(2, 2).to(getattr(torch, dtype))
    env = harness.environment(model)
    assert env == {"dtype": name, "gpu_name": None,
                   "versions": {"torch": torch.__version__,
                                "transformers": transformers.__version__}}


def test_report_header_names_device_dtype_and_gpu(tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    config = BenchConfig(systems=ALL)
    result = _run(tmp_path, {n: FakeSystem(n, log) for n in ALL}, config)
    cpu = report.summarize(result)
    assert (cpu["dtype"], cpu["gpu_name"], cpu["notes"]) == (None, None, [])
    assert " on cpu, temperature" in report.to_markdown(cpu).splitlines()[0]
    gpu = report.summarize(BenchResult("w.jsonl", "fake", "cuda:0", config, 1, result.requests,
                                       dtype="bf16", gpu_name="NVIDIA H200"))
    assert " on cuda:0, bf16, NVIDIA H200, temperature" in report.to_markdown(gpu).splitlines()[0]


def test_tool_call_steps_counts_only_call_outputs_under_a_tool_grammar() -> None:
    grammar = {"type": "tool_calls", "tools": [{"name": "ls"}], "choice": "auto"}
    msgs = ({"role": "user", "content": "x"},)
    call = WorkloadItem("a", messages=msgs, grammar=grammar)
    text = WorkloadItem("b", messages=msgs, grammar=grammar)
    free = WorkloadItem("c", messages=msgs)

    def req(item: WorkloadItem, out: str, steps: int) -> RequestResult:
        return RequestResult(item, 5, 32, {
            "hf-greedy": (Outcome((1,) * 12, 1.0),),
            "agentspec": (Outcome((1,) * 12, 0.5, steps, text=out),)})

    reqs = (req(call, '[{"name": "ls", "arguments": {}}]', 3), req(text, "Done.", 12),
            req(free, '{"name": "ls"}', 12))
    got = report.tool_call_steps(reqs, ["hf-greedy", "agentspec"])
    assert got == {"agentspec": {"calls": 1, "tokens": 12, "steps": 3, "tokens_per_step": 4.0}}


def test_the_share_of_prompt_tokens_read_from_the_kv_per_agentspec_system(tmp_path: Path) -> None:
    log: list[tuple[str, str]] = []
    summary = report.summarize(_run(tmp_path, {n: FakeSystem(n, log) for n in ALL},
                                    BenchConfig(systems=ALL)))
    shares = {n: s.get("cached_prompt_share") for n, s in summary["systems"].items()}
    assert shares == {"hf-greedy": None, "hf-pld": None, "agentspec-pld": 0.0,
                      "agentspec": round(2 / 3, 3)}  # 2 of each request's 3 prompt tokens
    assert report.cached_line(summary).endswith("agentspec-pld 0%, agentspec 67%")
    assert summary["requests"][0]["systems"]["agentspec"]["cached_tokens"] == 2


@pytest.mark.slow
def test_agentspec_pld_drafts_by_prompt_lookup_alone_even_where_a_head_is_trained(
        spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import agentspec.drafters.head as head

    monkeypatch.setattr(head, "heads_exist", lambda fingerprint: True)  # as if trained
    config = BenchConfig(systems=("hf-greedy", "agentspec-pld"))
    systems = harness.build_systems(spec.target, config, f"sqlite:///{tmp_path / 'm.db'}")
    drafters = systems["agentspec-pld"].spec.drafters  # type: ignore[attr-defined]
    assert [d.name for d in drafters] == ["prompt_lookup"]


@pytest.mark.slow
def test_agentspec_suffix_drafts_from_earlier_outputs_and_the_prompt_without_a_semantic_lookup(
        spec, tmp_path: Path) -> None:
    config = BenchConfig(systems=("hf-greedy", "agentspec-suffix"))
    with pytest.raises(ValueError, match="agentspec-suffix needs a memory database"):
        harness.build_systems(spec.target, config, f"sqlite:///{tmp_path / 'm.db'}")
    systems = harness.build_systems(spec.target, config, f"sqlite:///{tmp_path / 'm.db'}",
                                    suffix_db_url=f"sqlite:///{tmp_path / 's.db'}")
    suffix = systems["agentspec-suffix"].spec  # type: ignore[attr-defined]
    assert [d.name for d in suffix.drafters] == ["suffix", "prompt_lookup"]
    assert suffix.memory.embedder.name.startswith("hash")  # no model embeds its keys
    item = WorkloadItem(id="a", scope="s", messages=({"role": "user", "content": "Count from 1 to 30."},))
    first = systems["agentspec-suffix"].run(item, 48, None)
    again = systems["agentspec-suffix"].run(item, 48, None)
    assert again.token_ids == first.token_ids
    assert (again.accepted or {}).get("suffix", 0) > 0  # the first output was recorded
    harness.close_memory(systems["agentspec-suffix"])


def test_the_results_table_keeps_every_system_name_when_written_to_a_file(tmp_path: Path) -> None:
    """A bench written to a log laid its table out in 80 columns and cut the names of the
    systems to ``agen…``; the CLI's console is as wide as the table needs off a terminal."""
    import io

    from rich.console import Console

    from agentspec.terminal import PIPE_WIDTH, output_width

    names = ("hf-greedy", "agentspec-pld", "agentspec-suffix", "agentspec")
    systems = {n: FakeSystem(n, []) for n in names}
    summary = report.summarize(_run(tmp_path, systems, BenchConfig(systems=names)))

    class File(io.StringIO):
        def isatty(self) -> bool:
            return False

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert output_width(File(), {}) == PIPE_WIDTH
    assert output_width(Terminal(), {}) is None and output_width(File(), {"COLUMNS": "90"}) is None
    for width, whole in ((output_width(File(), {}), True), (80, False)):  # 80: the old layout
        out = File()
        Console(file=out, width=width, highlight=False).print(report.rich_table(summary))
        shown = {n for n in names if f" {n} " in out.getvalue()}
        assert (shown == set(names)) is whole
