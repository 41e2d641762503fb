"""vLLM with and without agentspec's proposer, side by side on one workload.

``python -m agentspec.bench.vllm --workload bfcl-live`` runs, each in an engine process of its
own (one ``LLM`` per method, reused for every pass): vLLM plain, vLLM's ``ngram``, vLLM's
``suffix`` (Arctic Inference's SuffixDecoding) and vLLM with
:class:`agentspec.adapters.vllm.Proposer`. Each engine first runs the workload's warmup lines
(untimed; the methods that learn from past outputs, ``suffix`` and agentspec, learn from
them), then its measured lines at each stream count: one stream is one request at a time,
``n`` streams are all the lines submitted at once to an engine that runs ``n`` at a time.

Per method and stream count it reports tokens per second, accepted and drafted tokens per step
(``accepted / (generated - accepted)``: every step of a request commits its accepted draft
tokens and one more; vLLM's own counters) and how many outputs are token-identical to vLLM
plain's (greedy). For
agentspec it adds the proposer's host time per engine step and its accepted tokens by source.
The passes repeat the same requests, so a pass after the first also finds the earlier pass's
outputs in what ``suffix`` and agentspec remember. Lines are decoded without their grammar.
``--methods ...,oracle`` adds a proposer that drafts plain's own outputs
(:mod:`agentspec.bench.vllm_oracle`): what no proposer can beat at that ``k`` on that machine.

Needs vLLM (``pip install agentspec[vllm]``, or ``make test-vllm``'s environment); nothing
here is imported by the rest of agentspec.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentspec.bench.workload import load_workload, resolve_workload
from agentspec.text import encode_prompt

METHODS = ("plain", "ngram", "suffix", "agentspec")
"""The methods run by default; ``oracle`` (:mod:`agentspec.bench.vllm_oracle`) on request."""
KNOWN = (*METHODS, "oracle")
PROPOSER = "agentspec.adapters.vllm.Proposer"
ORACLE = "agentspec.bench.vllm_oracle.OracleProposer"
KV_CACHE_BYTES = 2 << 30


def speculative_config(method: str, k: int) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``method`` with ``k`` draft tokens at most."""
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    if method in ("agentspec", "oracle"):
        return {"method": "custom_class", "model": PROPOSER if method == "agentspec" else ORACLE,
                "num_speculative_tokens": k}
    raise ValueError(f"unknown method {method!r}; known: {', '.join(KNOWN)}")


def engine_args(method: str, model: str, *, k: int, streams: int, db: str | None,
                stats_path: str | None, max_model_len: int,
                oracle_pairs: str | None = None) -> dict[str, Any]:
    """``LLM(**engine_args(...))`` for one method (greedy float32 on the CPU build);
    ``oracle_pairs``: the oracle's file of prompts and their outputs."""
    args: dict[str, Any] = {"model": model, "dtype": "float32", "enforce_eager": True,
                            "max_model_len": max_model_len, "max_num_seqs": streams,
                            "disable_log_stats": False, "seed": 0,
                            # an explicit KV size: the default reserves most of the host's memory
                            "kv_cache_memory_bytes": KV_CACHE_BYTES}
    spec = speculative_config(method, k)
    if spec is not None:
        args["speculative_config"] = spec
    if method == "agentspec":
        # idle_finish_s: the pause between passes records every request of the last one
        args["additional_config"] = {"agentspec": {"db": db, "stats_path": stats_path,
                                                   "idle_finish_s": 1.0}}
    if method == "oracle":
        args["additional_config"] = {"agentspec_oracle": {"pairs": oracle_pairs}}
    return args


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            out[metric.name] = out.get(metric.name, 0.0) + float(value)
    return out


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine, every pass of ``spec`` (what :func:`main` hands a child process): the
    warmup lines untimed, then the measured lines at each stream count."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    method, model, streams = spec["method"], spec["model"], list(spec["streams"])
    tokenizer = AutoTokenizer.from_pretrained(model)

    def prompts(items: list[dict[str, Any]]) -> list[Any]:
        return [TokensPrompt(prompt_token_ids=encode_prompt(
            tokenizer, it["messages"] if it.get("messages") else it["prompt"])) for it in items]

    def params(items: list[dict[str, Any]]) -> list[Any]:
        return [SamplingParams(temperature=0.0, max_tokens=it["max_new_tokens"])
                for it in items]

    pairs = None
    if method == "oracle":  # plain's outputs of the measured lines, by prompt
        pairs = str(Path(spec["stats_path"]).with_suffix(".pairs.json"))
        Path(pairs).write_text(json.dumps([
            [list(p["prompt_token_ids"]), out] for p, out in zip(
                prompts(spec["measure"]), spec["plain_outputs"], strict=True)]))
    started = time.perf_counter()
    llm = LLM(**engine_args(method, model, k=spec["k"], streams=max(streams), db=spec.get("db"),
                            stats_path=spec.get("stats_path"),
                            max_model_len=spec["max_model_len"], oracle_pairs=pairs))
    result: dict[str, Any] = {"method": method, "start_seconds": time.perf_counter() - started,
                              "passes": []}
    if spec["warmup"] and method in ("suffix", "agentspec"):
        llm.generate(prompts(spec["warmup"]), params(spec["warmup"]), use_tqdm=False)
    measure = spec["measure"]
    for n in streams:
        before = _counters(llm)
        started = time.perf_counter()
        if n == 1:
            outs = [llm.generate(p, s, use_tqdm=False)[0]
                    for p, s in zip(prompts(measure), params(measure), strict=True)]
        else:
            outs = llm.generate(prompts(measure), params(measure), use_tqdm=False)
        seconds = time.perf_counter() - started
        after = _counters(llm)
        ids = [list(o.outputs[0].token_ids) for o in outs]
        generated = sum(len(i) for i in ids)
        accepted, drafted = (after.get(name, 0.0) - before.get(name, 0.0) for name in (
            "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens"))
        result["passes"].append({
            "streams": n, "seconds": seconds, "generated": generated,
            "tokens_per_second": generated / seconds if seconds else 0.0,
            "accepted": accepted, "drafted": drafted,
            "accepted_per_step": accepted / (generated - accepted) if generated > accepted else 0.0,
            "drafted_per_step": drafted / (generated - accepted) if generated > accepted else 0.0,
            "outputs": ids})
        # The proposer records a pass's last requests after 1 s idle and writes its counters
        # about once a second.
        time.sleep(2.5)
        result["passes"][-1]["proposer"] = _read_json(spec.get("stats_path"))
    return result


def _read_json(path: str | None) -> dict[str, Any] | None:
    if not path or not Path(path).is_file():
        return None
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data


def run_child(spec: dict[str, Any], *, timeout: float | None = None,
              log: Path | None = None) -> dict[str, Any]:
    """:func:`run_engine` in a process of its own (vLLM spawns its engine processes; one
    engine per process is shut down cleanly with it); raises when it fails, with the end of
    its output when it went to ``log`` (None: this process's stdout and stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps(spec))
        sink = None if log is None else log.open("w")
        try:
            proc = subprocess.run([sys.executable, "-m", "agentspec.bench.vllm", "--child",
                                   str(spec_file), "--child-out", str(out_file)],
                                  timeout=timeout, stdout=sink, stderr=sink,
                                  env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        finally:
            if sink is not None:
                sink.close()
        if proc.returncode != 0 or not out_file.is_file():
            tail = "" if log is None else "\n" + "\n".join(log.read_text().splitlines()[-30:])
            raise RuntimeError(f"the {spec['method']} engine failed (exit {proc.returncode}){tail}")
        data: dict[str, Any] = json.loads(out_file.read_text())
        return data


def workload_items(name: str, limit: int | None, max_new_tokens: int) -> tuple[list[Any], list[Any]]:
    """``(warmup, measure)`` lines of a workload as JSON objects, each phase cut to ``limit``."""
    wl = load_workload(resolve_workload(name), default_max_new_tokens=max_new_tokens)
    warm = [i.to_json() for i in wl.warmup][:limit]
    meas = [i.to_json() for i in wl.measure][:limit]
    for item in warm + meas:
        item.setdefault("max_new_tokens", max_new_tokens)
    return warm, meas


def report(results: list[dict[str, Any]]) -> str:
    """The side-by-side table (Markdown)."""
    plain = next((r for r in results if r["method"] == "plain"), None)
    lines = ["| method | streams | tokens/s | accepted/step | drafted/step | equal to plain "
             "| host ms/step |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for p in r["passes"]:
            ref = None if plain is None else next(
                (q for q in plain["passes"] if q["streams"] == p["streams"]), None)
            equal = "-" if ref is None else (
                f"{sum(a == b for a, b in zip(p['outputs'], ref['outputs'], strict=True))}"
                f"/{len(ref['outputs'])}")
            stats = p.get("proposer") or {}
            host = (f"{1000 * stats['host_seconds'] / stats['steps']:.3f}"
                    if stats.get("steps") else "-")
            lines.append(f"| {r['method']} | {p['streams']} | {p['tokens_per_second']:.1f} | "
                         f"{p['accepted_per_step']:.3f} | {p.get('drafted_per_step', 0.0):.2f} | "
                         f"{equal} | {host} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentspec.bench.vllm", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="bfcl-live")
    ap.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated among {', '.join(KNOWN)} (oracle: drafts plain's "
                         f"outputs, the bound of any proposer; plain must come before it)")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--limit", type=int, default=None, help="lines per phase (default all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--db", default=None, help="agentspec's memory URL (default: a fresh SQLite)")
    ap.add_argument("--out", default=None, help="write every result as JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = run_engine(json.loads(Path(args.child).read_text()))
        Path(args.child_out).write_text(json.dumps(result))
        return 0
    model = args.model
    if model is None:
        from agentspec.engine.load import resolve_model

        model = resolve_model("smollm2-135m-instruct")[1]
    warm, meas = workload_items(args.workload, args.limit, args.max_new_tokens)
    streams = [int(s) for s in args.streams.split(",")]
    methods = args.methods.split(",")
    for method in methods:
        speculative_config(method, args.k)  # an unknown method fails before any engine
    if "oracle" in methods and "plain" not in methods[: methods.index("oracle")]:
        ap.error("--methods: the oracle drafts plain's outputs: list plain before oracle")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or f"sqlite:///{tmp}/memory.db"
        for method in methods:
            spec = {"method": method, "model": model, "k": args.k, "streams": streams,
                    "warmup": warm, "measure": meas, "db": db,
                    "stats_path": f"{tmp}/{method}-stats.json",
                    "max_model_len": args.max_model_len}
            if method == "oracle":
                spec["plain_outputs"] = results[methods.index("plain")]["passes"][0]["outputs"]
            results.append(run_child(spec))
            print(f"{method}: done", file=sys.stderr, flush=True)
    print(report(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
