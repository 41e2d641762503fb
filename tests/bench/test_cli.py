"""``agentspec bench``: bad input, workload names, a mismatch fails the run, and one real run
end to end on a tiny workload (slow: the real model, a few tokens per request)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from agentspec.bench import harness
from agentspec.bench.results import BenchResult, Outcome, RequestResult
from agentspec.bench.workload import WorkloadItem, resolve_workload
from agentspec.cli import app
from agentspec.cli import bench as bench_cli


def invoke(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def test_module_imports_neither_torch_nor_transformers_nor_the_bench() -> None:
    code = ("import sys, agentspec.cli.bench; "
            "print(sorted(m for m in ('torch', 'transformers', 'agentspec.bench') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_commands_help_imports_no_bench_module() -> None:
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom agentspec.cli import app\n"
            "assert CliRunner().invoke(app, ['--help']).exit_code == 0\n"
            "print(sorted(m for m in sys.modules if m.startswith('agentspec.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("args", "named"), [
    (["--systems", "hf-greedy,warp-drive"], "'warp-drive'"),
    (["--temperature", "-0.5"], "-0.5"),
    (["--temperature", "nan"], "nan"),
    (["--max-new-tokens", "0"], "got 0"),
    (["--dtype", "fp8"], "'fp8'"),
    (["--dtype", "BF16", "--device", "cpu"], "'BF16'"),
    (["--device", "tpu"], "'tpu'"),
    (["--device", "not a device"], "'not a device'"),
    (["--lines", "o.json", "--temperature", "0.7"], "temperature 0.7"),
    (["--lines", "o.json", "--systems", "hf-greedy,agentspec-pld"], "hf-greedy,agentspec-pld"),
])
def test_bad_input_exits_2_naming_the_value(args: list[str], named: str) -> None:
    res = invoke(*args)
    assert res.exit_code == 2, res.output
    assert named in res.stderr and res.stderr.count("\n") == 1


def test_a_missing_workload_exits_3_naming_it() -> None:
    res = invoke("--workload", "no-such-workload")
    assert res.exit_code == 3, res.output
    assert "'no-such-workload'" in res.stderr and res.stderr.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_exits_2_naming_the_device(device: str) -> None:
    res = invoke("--workload", "prompts", "--device", device)
    assert res.exit_code == 2, res.output
    assert f"{device!r}" in res.stderr and "CUDA, which is not available" in res.stderr
    assert res.stderr.count("\n") == 1


def _capture_config(monkeypatch) -> list:
    seen: list = []

    def fake(workload, model, config, *, on_progress=None) -> BenchResult:
        seen.append(config)
        return _fake_result(workload, model, config)

    monkeypatch.setattr(harness, "run_bench", fake)
    return seen


@pytest.mark.parametrize(("args", "cuda", "device", "dtype"), [
    ([], False, "cpu", "fp32"),
    ([], True, "cuda", "bf16"),
    (["--dtype", "fp16"], True, "cuda", "fp16"),
    (["--device", "cpu"], True, "cpu", "fp32"),
    (["--device", "cpu", "--dtype", "bf16"], False, "cpu", "bf16"),
])
def test_device_and_dtype_defaults_reach_the_config(monkeypatch, args, cuda, device,
                                                     dtype) -> None:
    seen = _capture_config(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    res = invoke("--workload", "prompts", "--systems", "hf-greedy,hf-static", *args)
    assert res.exit_code == 0, res.output
    assert (seen[0].device, seen[0].dtype) == (device, dtype)
    assert seen[0].systems == ("hf-greedy", "hf-static")


def test_bad_task_id_for_the_builder(tmp_path: Path) -> None:
    pytest.importorskip("bfcl_eval")
    res = invoke("build-bfcl", "--out", str(tmp_path / "x.jsonl"), "--tasks", "multi_turn_base_999")
    assert res.exit_code == 2 and "multi_turn_base_999" in res.stderr


def test_short_names_resolve_to_shipped_workloads(tmp_path: Path) -> None:
    data = Path(harness.__file__).parent / "data"
    assert resolve_workload("prompts") == data / "prompts.jsonl"
    assert resolve_workload("bfcl") == data / "bfcl.jsonl"
    own = tmp_path / "prompts"
    own.write_text('{"id": "a", "prompt": "x"}\n')
    assert resolve_workload(str(own)) == own  # an existing file wins
    with pytest.raises(ValueError, match="'no/such'.*shipped: .*prompts"):
        resolve_workload("no/such")


def test_systems_parsing() -> None:
    assert bench_cli.parse_systems("agentspec, hf-pld") == ["hf-greedy", "agentspec", "hf-pld"]


def _fake_result(workload, model, config, *, on_progress=None) -> BenchResult:
    """One request on which agentspec-pld and hf-static differ from the reference."""
    item = WorkloadItem(id="r-0", prompt="x", max_new_tokens=4)
    outcomes = {n: (Outcome((1, 2, 4) if n in ("agentspec-pld", "hf-static") else (1, 2, 3),
                            1.0, None if n.startswith("hf") else 2),) for n in config.systems}
    return BenchResult(str(workload.path), model, "cuda:0", config, 0,
                       (RequestResult(item, 3, 4, outcomes),), (0.1, 0.2, 0.3), dtype="bf16",
                       gpu_name="NVIDIA H100 80GB HBM3",
                       versions={"torch": "2.13.0", "transformers": "5.23.0"},
                       notes=("hf-static: torch.compile failed (X: y); static KV without "
                              "torch.compile",))


def test_a_mismatch_fails_the_run_and_is_in_the_json(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(harness, "run_bench", _fake_result)
    out = tmp_path / "r.json"
    res = invoke("--workload", "prompts", "--systems", "hf-greedy,agentspec-pld,agentspec-plain",
                 "--out", str(out))
    assert res.exit_code == 1 and "agentspec-pld" in res.stderr
    summary = json.loads(out.read_text())
    assert summary["exact_match"] == {"agentspec-pld": 0.0, "agentspec-plain": 1.0}


def test_a_baseline_mismatch_is_a_finding_not_a_failure(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(harness, "run_bench", _fake_result)
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    res = invoke("--workload", "prompts", "--systems", "hf-greedy,hf-static,agentspec-plain",
                 "--out", str(out), "--report", str(md))
    assert res.exit_code == 0, res.output
    assert "warning: outputs differ from hf-greedy" in res.stderr and "hf-static" in res.stderr
    assert res.stderr.count("note: hf-static: torch.compile failed") == 1
    summary = json.loads(out.read_text())
    assert summary["exact_match"] == {"hf-static": 0.0, "agentspec-plain": 1.0}
    assert {k: summary[k] for k in ("device", "dtype", "gpu_name", "torch_version",
                                    "transformers_version")} == {
        "device": "cuda:0", "dtype": "bf16", "gpu_name": "NVIDIA H100 80GB HBM3",
        "torch_version": "2.13.0", "transformers_version": "5.23.0"}
    assert summary["notes"] == ["hf-static: torch.compile failed (X: y); static KV without "
                                "torch.compile"]
    header = md.read_text().splitlines()[0]
    assert header.startswith("## ") and "on cuda:0, bf16, NVIDIA H100 80GB HBM3," in header
    assert "Note: hf-static: torch.compile failed" in md.read_text()


def test_in_bf16_agentspec_must_equal_its_plain_decoding_not_hf_greedy() -> None:
    from agentspec.cli.bench import fail_on_mismatch
    from agentspec.cli.common import CliError

    bf16 = {"dtype": "bf16", "exact_match": {"agentspec-plain": 0.5, "agentspec": 0.5},
            "same_as_plain": {"agentspec": 1.0}}
    fail_on_mismatch(bf16)  # transformers rounds otherwise in bf16: reported, not failed
    with pytest.raises(CliError):
        fail_on_mismatch({**bf16, "same_as_plain": {"agentspec": 0.9}})  # drafts changed outputs
    with pytest.raises(CliError):
        fail_on_mismatch({**bf16, "dtype": "fp32"})  # fp32: identity with transformers


TINY = [
    {"id": "warm-0", "scope": "t", "phase": "warmup", "max_new_tokens": 6,
     "messages": [{"role": "user", "content": 'Repeat exactly: {"city": "Paris", "unit": "c"}'}]},
    {"id": "grounded-0", "scope": "t",
     "messages": [{"role": "user", "content": 'Repeat exactly: {"city": "Paris", "unit": "c"}'}]},
    {"id": "open-0", "scope": "t", "prompt": "The three primary colors are"},
]


@pytest.mark.slow
def test_end_to_end_on_a_tiny_workload(tmp_path: Path) -> None:
    workload = tmp_path / "tiny.jsonl"
    workload.write_text("".join(json.dumps(line) + "\n" for line in TINY))
    out, png, md = tmp_path / "o.json", tmp_path / "o.png", tmp_path / "o.md"
    res = invoke("--workload", str(workload), "--max-new-tokens", "6",
                 "--systems", ",".join(bench_cli.SYSTEMS), "--out", str(out),
                 "--plot", str(png), "--report", str(md), "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())
    assert json.loads(res.stdout) == summary  # --json: stdout holds the JSON alone
    assert summary["measured_requests"] == 2 and summary["warmup_requests"] == 1
    assert summary["device"] == "cpu" and summary["model"] == "smollm2-135m-instruct"
    assert (summary["dtype"], summary["gpu_name"]) == ("fp32", None)
    assert summary["torch_version"] == torch.__version__
    assert summary["transformers_version"] == transformers.__version__
    assert [n.split(":")[0] for n in summary["notes"]] == ["hf-static"]  # no compile on CPU
    assert summary["exact_match"] == {n: 1.0 for n in bench_cli.SYSTEMS[1:]}
    for name, s in summary["systems"].items():
        assert s["new_tokens"] > 0 and s["tokens_per_second"] > 0, name
        # time to first token: some of a call (6 tokens here), never more than all of it
        per_call_ms = 1000 * s["seconds"] / summary["measured_requests"]
        assert 0 < s["first_token_ms"] < 2 * per_call_ms, name
    assert summary["systems"]["hf-greedy"]["speedup"] == 1.0
    assert set(summary["systems"]["agentspec"]["accepted_by_source"]) >= {"memory", "prompt_lookup"}
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "agentspec-plain" in md.read_text()
    assert "exact" in res.stderr and "TTFT" in res.stderr  # the table, on stderr under --json


def test_every_system_runs_on_the_files_own_weights_with_dtype_gguf(tmp_path: Path) -> None:
    """``--dtype gguf``: transformers' generate runs on the same held weights (its modules over
    the native products, float32 KV), agentspec on the native forward (float16 KV): the promise
    is agentspec-plain's outputs, and the report names the mode."""
    workload = tmp_path / "tiny.jsonl"
    workload.write_text("".join(json.dumps(line) + "\n" for line in TINY))
    out = tmp_path / "o.json"
    res = invoke("--workload", str(workload), "--max-new-tokens", "6", "--dtype", "gguf",
                 "--systems", "hf-greedy,agentspec-plain,agentspec", "--out", str(out))
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())
    assert summary["dtype"] == "gguf"
    assert summary["same_as_plain"]["agentspec"] == 1.0
