"""vLLM with and without agentspec's proposer, side by side on one workload.

``python -m agentspec.bench.vllm --workload bfcl-live`` runs, each in an engine process of its
own, all of them alive at once: vLLM plain, vLLM's ``ngram``, vLLM's ``suffix`` (Arctic
Inference's SuffixDecoding) and vLLM with :class:`agentspec.adapters.vllm.Proposer`. Each
engine first runs the workload's warmup lines (untimed; the methods that learn from past
outputs, ``suffix`` and agentspec, learn from them), then its measured lines at each stream
count, the methods taking turns so that a slower or faster minute of the machine falls on all
of them: at one stream (one request at a time) request by request, at ``n`` streams (all the
lines submitted at once to an engine that runs ``n`` at a time) pass by pass, ``--repeats``
times, the median pass counting; the order rotates from turn to turn.

Per method and stream count it reports tokens per second, accepted and drafted tokens per step
(``accepted / (generated - accepted)``: every step of a request commits its accepted draft
tokens and one more; vLLM's own counters) and how many outputs are token-identical to vLLM
plain's (greedy). For
agentspec it adds the proposer's host time per engine step and its accepted tokens by source.
The passes repeat the same requests, so a pass after the first also finds the earlier pass's
outputs in what ``suffix`` and agentspec remember. Lines are decoded without their grammar.
``--methods ...,oracle`` adds a proposer that drafts plain's own outputs
(:mod:`agentspec.bench.vllm_oracle`): what no proposer can beat at that ``k`` on that machine.

Needs vLLM (``pip install agentspec-llm[vllm]``, or ``make test-vllm``'s environment); nothing
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
# Each engine's KV when all of them are alive at once (8 streams of bfcl-live hold ~0.6 GiB).
SIDE_KV_CACHE_BYTES = 1 << 30


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
                stats_path: str | None, max_model_len: int, oracle_pairs: str | None = None,
                kv_cache_bytes: int = KV_CACHE_BYTES) -> dict[str, Any]:
    """``LLM(**engine_args(...))`` for one method (greedy float32 on the CPU build);
    ``oracle_pairs``: the oracle's file of prompts and their outputs."""
    args: dict[str, Any] = {"model": model, "dtype": "float32", "enforce_eager": True,
                            "max_model_len": max_model_len, "max_num_seqs": streams,
                            "disable_log_stats": False, "seed": 0,
                            # an explicit KV size: the default reserves most of the host's memory
                            "kv_cache_memory_bytes": kv_cache_bytes}
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


class Engine:
    """One method's ``LLM`` over a workload's lines, in a process of its own (what
    :func:`run_engine` and a side-by-side child drive).

    Args:
        spec: ``method``, ``model``, ``k``, ``streams`` (the engine runs ``max(streams)`` at a
            time), ``warmup`` and ``measure`` (workload lines as JSON), ``max_model_len``, and
            optionally ``db``, ``stats_path`` (agentspec's) and ``plain_outputs`` (the oracle's:
            plain's outputs of the measured lines; more can be told later, :meth:`know`).
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.method, self.spec = spec["method"], spec
        tokenizer = AutoTokenizer.from_pretrained(spec["model"])

        def inputs(items: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
            return [(TokensPrompt(prompt_token_ids=encode_prompt(
                tokenizer, it["messages"] if it.get("messages") else it["prompt"])),
                SamplingParams(temperature=0.0, max_tokens=it["max_new_tokens"])) for it in items]

        self.warm, self.measure = inputs(spec["warmup"]), inputs(spec["measure"])
        self.pairs: str | None = None
        self.known: dict[int, list[int]] = {}
        if self.method == "oracle":  # plain's outputs of the measured lines, by prompt
            self.pairs = str(Path(spec["stats_path"]).with_suffix(".pairs.json"))
            for i, out in enumerate(spec.get("plain_outputs") or []):
                self.know(i, out)
            if not self.known:
                Path(self.pairs).write_text("[]")
        started = time.perf_counter()
        self.llm = LLM(**engine_args(self.method, spec["model"], k=spec["k"],
                                     streams=max(spec["streams"]), db=spec.get("db"),
                                     stats_path=spec.get("stats_path"),
                                     max_model_len=spec["max_model_len"],
                                     oracle_pairs=self.pairs,
                                     kv_cache_bytes=spec.get("kv_cache_bytes", KV_CACHE_BYTES)))
        self.start_seconds = time.perf_counter() - started

    def know(self, line: int, output: list[int]) -> None:
        """Tell the oracle plain's output of measured line ``line`` (others: ignored)."""
        if self.pairs is None:
            return
        self.known[line] = list(output)
        staged = Path(self.pairs).with_suffix(".part")
        staged.write_text(json.dumps([[list(self.measure[i][0]["prompt_token_ids"]), out]
                                      for i, out in sorted(self.known.items())]))
        staged.replace(self.pairs)  # whole: the proposer reads it from another process

    def warmup(self) -> None:
        """The warmup lines, untimed, for the methods that learn from past outputs."""
        if self.warm and self.method in ("suffix", "agentspec"):
            self.llm.generate([p for p, _ in self.warm], [s for _, s in self.warm],
                              use_tqdm=False)

    def run(self, lines: list[int] | None = None, *, together: bool = False) -> dict[str, Any]:
        """Time measured ``lines`` (None: all): one request at a time, or all submitted at
        once (``together``). Returns the seconds, the outputs and vLLM's counters' growth."""
        todo = [self.measure[i] for i in (range(len(self.measure)) if lines is None else lines)]
        before = _counters(self.llm)
        started = time.perf_counter()
        if together:
            outs = self.llm.generate([p for p, _ in todo], [s for _, s in todo], use_tqdm=False)
        else:
            outs = [self.llm.generate(p, s, use_tqdm=False)[0] for p, s in todo]
        seconds = time.perf_counter() - started
        after = _counters(self.llm)
        accepted, drafted = (after.get(name, 0.0) - before.get(name, 0.0) for name in (
            "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens"))
        return {"seconds": seconds, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "accepted": accepted, "drafted": drafted}

    def proposer_stats(self) -> dict[str, Any] | None:
        """agentspec's proposer counters: it records a pass's last requests after 1 s idle
        and writes its counters about once a second."""
        if not self.spec.get("stats_path") or self.method != "agentspec":
            return None
        time.sleep(2.5)
        return _read_json(self.spec.get("stats_path"))


def pass_result(streams: int, seconds: float, outputs: list[list[int]], accepted: float,
                drafted: float) -> dict[str, Any]:
    """One pass's figures: tokens/s, and accepted and drafted tokens a step (``accepted /
    (generated - accepted)``: every step of a request commits its accepted tokens and one
    more)."""
    generated = sum(len(o) for o in outputs)
    steps = generated - accepted
    return {"streams": streams, "seconds": seconds, "generated": generated,
            "tokens_per_second": generated / seconds if seconds else 0.0,
            "accepted": accepted, "drafted": drafted,
            "accepted_per_step": accepted / steps if steps > 0 else 0.0,
            "drafted_per_step": drafted / steps if steps > 0 else 0.0, "outputs": outputs}


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine, every pass of ``spec`` one after another: the warmup lines untimed, then
    the measured lines at each stream count."""
    engine = Engine(spec)
    result: dict[str, Any] = {"method": engine.method, "start_seconds": engine.start_seconds,
                              "passes": []}
    engine.warmup()
    for n in spec["streams"]:
        r = engine.run(together=n > 1)
        result["passes"].append(pass_result(n, r["seconds"], r["outputs"], r["accepted"],
                                            r["drafted"]))
        result["passes"][-1]["proposer"] = engine.proposer_stats()
    return result


def _read_json(path: str | None) -> dict[str, Any] | None:
    if not path or not Path(path).is_file():
        return None
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data


def _spawn_args(*flags: str) -> dict[str, Any]:
    """``subprocess`` arguments of an engine process: this module with ``flags``."""
    return {"args": [sys.executable, "-m", "agentspec.bench.vllm", *flags],
            "env": {**os.environ, "TOKENIZERS_PARALLELISM": "false"}}


def _failed(method: str, code: int | None, log: Path | None) -> RuntimeError:
    """An engine process's failure, with the end of its output when it went to ``log``."""
    tail = "" if log is None else "\n" + "\n".join(log.read_text().splitlines()[-30:])
    return RuntimeError(f"the {method} engine failed (exit {code}){tail}")


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
            proc = subprocess.run(**_spawn_args("--child", str(spec_file), "--child-out",
                                                str(out_file)),
                                  timeout=timeout, stdout=sink, stderr=sink)
        finally:
            if sink is not None:
                sink.close()
        if proc.returncode != 0 or not out_file.is_file():
            raise _failed(spec["method"], proc.returncode, log)
        data: dict[str, Any] = json.loads(out_file.read_text())
        return data


def serve(spec_file: str, address: str, authkey: str) -> None:
    """A side-by-side child: connect to the parent at ``address``, build the engine, then do
    what the parent asks (:class:`Child`) until it says ``quit``."""
    from multiprocessing.connection import Client

    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(authkey))
    engine = Engine(json.loads(Path(spec_file).read_text()))
    conn.send(engine.start_seconds)
    while True:
        name, args, kwargs = conn.recv()
        if name == "quit":
            break
        conn.send(getattr(engine, name)(*args, **kwargs))
    conn.close()


class Child:
    """One method's engine in a process of its own, asked over a connection (:func:`serve`);
    its output goes to ``log``."""

    def __init__(self, spec: dict[str, Any], listener: Any, authkey: str, log: Path,
                 tmp: Path) -> None:
        self.method = spec["method"]
        spec_file = tmp / f"{self.method}-spec.json"
        spec_file.write_text(json.dumps(spec))
        self.log = log
        with log.open("w") as sink:
            self.proc = subprocess.Popen(**_spawn_args(
                "--serve", str(spec_file), "--address", str(listener.address),
                "--authkey", authkey), stdout=sink, stderr=sink)
        self.conn = listener.accept()
        self.start_seconds = self._answer()

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The engine's ``name(*args, **kwargs)``, in the child."""
        self.conn.send((name, args, kwargs))
        return self._answer()

    def _answer(self) -> Any:
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None:
                raise _failed(self.method, self.proc.returncode, self.log)
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(("quit", (), {}))
            self.proc.wait(timeout=120)
        except Exception:  # a child that is gone or hangs: stopped
            self.proc.kill()
            self.proc.wait()


def turn_order(children: list[Any], turn: int) -> list[Any]:
    """The children in the order of ``turn`` (rotated, so none is always first), the oracle
    after plain (it drafts what plain generated)."""
    n = len(children)
    order = [children[(turn + j) % n] for j in range(n)]
    names = [c.method for c in order]
    if "oracle" in names and "plain" in names and names.index("oracle") < names.index("plain"):
        i, j = names.index("oracle"), names.index("plain")
        order[i], order[j] = order[j], order[i]
    return order


def _one_at_a_time(children: list[Child], lines: int) -> dict[str, dict[str, Any]]:
    """The one-stream pass: the methods take turns request by request (plain's output of
    each told to the oracle before its turn). Per method: seconds, outputs and counters."""
    oracle = next((c for c in children if c.method == "oracle"), None)
    runs: dict[str, list[dict[str, Any]]] = {c.method: [] for c in children}
    for i in range(lines):
        for child in turn_order(children, i):
            runs[child.method].append(child.call("run", [i]))
            if child.method == "plain" and oracle is not None:
                oracle.call("know", i, runs["plain"][-1]["outputs"][0])
    return {m: {"seconds": sum(r["seconds"] for r in rs),
                "outputs": [r["outputs"][0] for r in rs],
                "accepted": sum(r["accepted"] for r in rs),
                "drafted": sum(r["drafted"] for r in rs)} for m, rs in runs.items()}


def _together(children: list[Child], repeats: int) -> dict[str, dict[str, Any]]:
    """The n-stream passes: every line submitted at once, the methods taking turns pass by
    pass, ``repeats`` times; per method its median pass and every pass's seconds."""
    reps: dict[str, list[dict[str, Any]]] = {c.method: [] for c in children}
    for turn in range(repeats):
        for child in turn_order(children, turn):
            reps[child.method].append(child.call("run", together=True))
    return {m: dict(sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2],
                    repeat_seconds=[r["seconds"] for r in rs]) for m, rs in reps.items()}


def side_by_side(specs: list[dict[str, Any]], *, repeats: int, tmp: Path,
                 report_progress: Any = None) -> list[dict[str, Any]]:
    """Every method's engine alive at once, its passes interleaved with the others': at one
    stream the methods take turns request by request, at ``n`` streams pass by pass,
    ``repeats`` times (the median pass counts). Results as :func:`run_engine`'s."""
    from multiprocessing.connection import Listener

    note = report_progress or (lambda message: None)
    key = os.urandom(16)
    with Listener(str(tmp / "bench.sock"), family="AF_UNIX", authkey=key) as listener:
        children: list[Child] = []
        try:
            for spec in specs:
                children.append(Child(spec, listener, key.hex(), tmp / f"{spec['method']}.log",
                                      tmp))
                note(f"{spec['method']}: engine up")
            for child in children:
                child.call("warmup")
            results = {c.method: {"method": c.method, "start_seconds": c.start_seconds,
                                  "passes": []} for c in children}
            for n in specs[0]["streams"]:
                merged = (_one_at_a_time(children, len(specs[0]["measure"])) if n == 1
                          else _together(children, repeats))
                for child in children:
                    got = merged[child.method]
                    p = pass_result(n, got["seconds"], got["outputs"], got["accepted"],
                                    got["drafted"])
                    if "repeat_seconds" in got:
                        p["repeat_seconds"] = got["repeat_seconds"]
                    p["proposer"] = child.call("proposer_stats")
                    results[child.method]["passes"].append(p)
                note(f"{n} stream(s): done")
            return [results[s["method"]] for s in specs]
        finally:
            for child in children:
                child.close()


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
                         f"outputs, the bound of any proposer; needs plain beside it)")
    ap.add_argument("--streams", default="1,8", help="1 and at most one count above it")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--limit", type=int, default=None, help="lines per phase (default all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--db", default=None, help="agentspec's memory URL (default: a fresh SQLite)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="passes at n streams per method, taking turns (the median counts)")
    ap.add_argument("--out", default=None, help="write every result as JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--address", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--authkey", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = run_engine(json.loads(Path(args.child).read_text()))
        Path(args.child_out).write_text(json.dumps(result))
        return 0
    if args.serve:
        serve(args.serve, args.address, args.authkey)
        return 0
    streams = [int(s) for s in args.streams.split(",")]
    if len(set(streams)) != len(streams) or any(n < 1 for n in streams) \
            or len([n for n in streams if n > 1]) > 1:
        ap.error(f"--streams: 1 and at most one count above it, got {args.streams!r}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    methods = args.methods.split(",")
    for method in methods:
        speculative_config(method, args.k)  # an unknown method fails before any engine
    if "oracle" in methods and "plain" not in methods:
        ap.error("--methods: the oracle drafts plain's outputs: list plain with it")
    model = args.model
    if model is None:
        from agentspec.engine.load import resolve_model

        model = resolve_model("smollm2-135m-instruct")[1]
    warm, meas = workload_items(args.workload, args.limit, args.max_new_tokens)
    with tempfile.TemporaryDirectory(prefix="agentspec-vllm-") as tmp:
        db = args.db or f"sqlite:///{tmp}/memory.db"
        specs = [{"method": method, "model": model, "k": args.k, "streams": streams,
                  "warmup": warm, "measure": meas, "db": db,
                  "stats_path": f"{tmp}/{method}-stats.json",
                  "max_model_len": args.max_model_len, "kv_cache_bytes": SIDE_KV_CACHE_BYTES}
                 for method in methods]
        results = side_by_side(specs, repeats=args.repeats, tmp=Path(tmp),
                               report_progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(report(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
