"""Offline replay of vLLM's model-free proposers over vLLM's own greedy outputs.

    python -m agentspec.bench.vllm_replay --workload bfcl-live --outputs out/vllm-plain-bfcl-live.json

Greedy decoding is deterministic, so once vLLM's plain output of every line is known, a
proposer's accepted tokens per step follow from its drafts alone: each step commits the
longest prefix of the row's draft that matches the output, and one more token. This replays
agentspec's :class:`~agentspec.adapters.vllm.Proposer` and vLLM's ``suffix`` (Arctic
Inference's ``SuffixDecodingCache``, driven as vLLM 0.32's ``SuffixDecodingProposer`` drives
it) through the passes of :mod:`agentspec.bench.vllm`: the warmup lines at 8 streams, the
measured lines at one stream, then at 8. A proposer change is measured in a few minutes
instead of the bench's quarter hour. Tokens per second are modeled: every step priced as
``--cost``'s ``base + per_token * tokens verified``; the bench has the last word. A third
method, ``ceiling``, runs agentspec's proposer but sends, each step, the one of its sources'
proposals the output accepts furthest, cut one token past that: what no choice or sizing among
agentspec's sources can beat.

The outputs are generated once (vLLM plain, all lines at 8 streams, in an engine process of its
own) and cached in ``--outputs``. Two things differ from a live engine: a request's memory
lookup is done before the next step (live, it finishes during the next step or two), and the
accepted draft is cut at ``max_tokens`` as vLLM cuts it. Needs vLLM's environment (``make
test-vllm`` builds it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from agentspec.bench.vllm import run_child, workload_items
from agentspec.text import encode_prompt

ROWS = 8  # vLLM's persistent batch rows (max_num_seqs) in every pass


@dataclass
class Request:
    """One request in the simulated batch, with vLLM's greedy output for it."""

    rid: str
    prompt: list[int]
    answer: list[int]  # vLLM's greedy output (EOS included where it stopped on one)
    out: list[int] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    steps: int = 0
    accepted: int = 0


Propose = Callable[[list[Request], list[list[int]], np.ndarray, np.ndarray], list[list[int]]]


class Batch:
    """vLLM's persistent batch as a proposer sees it: rows filled in order, a finished
    request's hole filled by the last row (``InputBatch.condense``), ``streams`` at a time."""

    def __init__(self, propose: Propose, max_len: int, cost: tuple[float, float] = (0.0, 0.0),
                 rows: int = ROWS) -> None:
        self.propose, self.cost = propose, cost
        self.seconds = 0.0  # the modeled time of the steps run
        self.drafted = 0  # the draft tokens they verified
        self.tokens = np.zeros((rows, max_len), dtype=np.int32)
        self.num = np.zeros(rows, dtype=np.int32)
        self.rows: list[Request] = []

    def run(self, reqs: list[Request], streams: int) -> None:
        waiting = list(reqs)
        while waiting or self.rows:
            while waiting and len(self.rows) < streams:
                self.add(waiting.pop(0))
            self.step()

    def add(self, req: Request) -> None:
        """``req`` takes the first free row."""
        row = len(self.rows)
        self.tokens[row, : len(req.prompt)] = req.prompt
        self.num[row] = len(req.prompt)
        self.rows.append(req)

    def step(self) -> None:
        """One engine step: every row commits its draft's accepted prefix and one more token,
        the proposer drafts the next, finished rows leave."""
        base, per_token = self.cost
        drafted = sum(len(req.draft) for req in self.rows)
        self.drafted += drafted
        self.seconds += base + per_token * (len(self.rows) + drafted)
        sampled = []
        for row, req in enumerate(self.rows):
            pos, left = len(req.out), len(req.answer) - len(req.out)
            accepted = 0
            while (accepted < len(req.draft) and accepted < left - 1
                   and req.draft[accepted] == req.answer[pos + accepted]):
                accepted += 1
            new = req.answer[pos : pos + accepted + 1]
            n = int(self.num[row])
            self.tokens[row, n : n + len(new)] = new
            self.num[row] = n + len(new)
            req.out += new
            req.steps += 1
            req.accepted += accepted
            sampled.append(list(new))
        drafts = self.propose(self.rows, sampled, self.num, self.tokens)
        for req, draft in zip(self.rows, drafts, strict=True):
            req.draft = list(draft)
        for row in range(len(self.rows) - 1, -1, -1):
            if len(self.rows[row].out) >= len(self.rows[row].answer):
                last = len(self.rows) - 1
                if row != last:
                    self.tokens[row] = self.tokens[last]
                    self.num[row] = self.num[last]
                    self.rows[row] = self.rows[last]
                self.tokens[last] = 0
                self.num[last] = 0
                self.rows.pop()


def suffix_proposer(k: int, max_len: int) -> tuple[Propose, Callable[[], None]]:
    """vLLM's ``suffix`` method at its defaults (vLLM 0.32's ``SuffixDecodingProposer``)."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    depth, factor, min_prob = 24, 1.0, 0.1
    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10000)

    def propose(rows: list[Request], sampled: list[list[int]], num: np.ndarray,
                tokens: np.ndarray) -> list[list[int]]:
        out = []
        for i, (req, ids) in enumerate(zip(rows, sampled, strict=True)):
            if req.rid not in cache.active_requests:
                if req.rid in cache.cached_requests:
                    cache.evict_cached_response(req.rid)
                cache.start_request(req.rid, np.array(req.prompt, dtype=np.int32))
            cache.add_active_response(req.rid, ids)
            n = int(num[i])
            pattern = tokens[i, max(0, n - depth) : n]
            draft = cache.speculate(req.rid, pattern, max_spec_tokens=min(k, max_len - n - 1),
                                    max_spec_factor=factor, min_token_prob=min_prob)
            out.append(list(draft.token_ids))
        for rid in cache.active_requests - {r.rid for r in rows}:
            cache.stop_request(rid)
        return out

    def idle() -> None:
        for rid in list(cache.active_requests):
            cache.stop_request(rid)

    return propose, idle


def agentspec_proposer(k: int, max_len: int, model: str, db: str, tokenizer: Any,
                       cost: tuple[float, float]) -> tuple[Propose, Callable[[], None], Any]:
    """agentspec's proposer on a fresh memory, with the vLLM config fields it reads."""
    from agentspec.adapters.vllm import Proposer

    hf = json.loads((Path(model) / "config.json").read_text())
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k, method="custom_class"),
        model_config=SimpleNamespace(model=model, tokenizer=model, max_model_len=max_len,
                                     hf_config=SimpleNamespace(**hf)),
        additional_config={"agentspec": {"db": db, "cost": list(cost)}})
    proposer = Proposer(config, tokenizer=tokenizer)
    proposer.load_model(None)

    def propose(rows: list[Request], sampled: list[list[int]], num: np.ndarray,
                tokens: np.ndarray) -> list[list[int]]:
        out = proposer.propose(sampled, num, tokens)
        proposer.settle()  # the lookups and records done before the next step
        return out

    def idle() -> None:  # the pause between passes: the bench's idle engine finishes them
        proposer.finish_live("idle")
        proposer.settle()

    return propose, idle, proposer


def ceiling_proposer(k: int, max_len: int, model: str, db: str, tokenizer: Any,
                     cost: tuple[float, float]) -> tuple[Propose, Callable[[], None], Any]:
    """agentspec's proposer choosing with hindsight: each step, of the proposals its chain
    was given (the memory's, the suffix drafter's), the one the output accepts furthest, cut
    one token past that: what no choice or sizing among agentspec's sources can beat."""
    from agentspec.types import Draft

    inner, idle, proposer = agentspec_proposer(k, max_len, model, db, tokenizer, cost)

    def propose(rows: list[Request], sampled: list[list[int]], num: np.ndarray,
                tokens: np.ndarray) -> list[list[int]]:
        out = inner(rows, sampled, num, tokens)
        for i, req in enumerate(rows):
            live = proposer.rows.by_row.get(i)
            if live is None or not out[i]:
                continue
            truth = req.answer[len(req.out) :]
            best: tuple[int, list[int], str] = (-1, [], "")
            for key, spine in proposer.chain.proposals(live.context):
                ids = list(spine[:k])
                n = next((j for j, (a, b) in enumerate(zip(ids, truth, strict=False)) if a != b),
                         min(len(ids), len(truth)))
                if n > best[0]:
                    best = (n, ids[: n + 1], key.split("|")[0].split("/")[0])
            if best[1]:
                out[i] = best[1]
                live.draft = Draft.chain(best[1], best[2])
        return out

    return propose, idle, proposer


def replay(method: str, lines: list[dict[str, Any]], k: int, max_len: int, model: str,
           tokenizer: Any, streams: list[int], cost: tuple[float, float]) -> dict[str, Any]:
    """Every pass of one method; per measured pass, accepted tokens per step."""
    with tempfile.TemporaryDirectory() as tmp:
        stats: Any = None
        if method == "suffix":
            propose, idle = suffix_proposer(k, max_len)
        elif method in ("agentspec", "ceiling"):
            make = agentspec_proposer if method == "agentspec" else ceiling_proposer
            propose, idle, stats = make(k, max_len, model, f"sqlite:///{tmp}/memory.db",
                                        tokenizer, cost)
        else:
            raise ValueError(f"unknown method {method!r}; known: suffix, agentspec, ceiling")
        batch = Batch(propose, max_len, cost)
        counter = 0

        def requests(phase: str) -> list[Request]:
            nonlocal counter
            out = []
            for line in lines:
                if line["phase"] == phase:
                    counter += 1
                    out.append(Request(f"r{counter}", line["prompt_ids"], line["output_ids"]))
            return out

        batch.run(requests("warmup"), ROWS)
        idle()
        passes = []
        for n in streams:
            reqs = requests("measure")
            batch.seconds, batch.drafted = 0.0, 0
            batch.run(reqs, n)
            idle()
            accepted = sum(r.accepted for r in reqs)
            generated = sum(len(r.out) for r in reqs)
            passes.append({"streams": n, "accepted": accepted, "generated": generated,
                           "drafted": batch.drafted,
                           "accepted_per_step": accepted / (generated - accepted),
                           "modeled_tokens_per_second": generated / batch.seconds,
                           "per_request": [r.accepted / r.steps for r in reqs]})
        result: dict[str, Any] = {"method": method, "passes": passes}
        if stats is not None:
            result["proposer"] = {key: stats.stats[key] for key in ("drafted", "accepted")}
            stats.close()
        return result


def plain_outputs(workload: str, model: str, max_new_tokens: int, max_len: int,
                  path: Path) -> list[dict[str, Any]]:
    """Every line with its prompt ids and vLLM's greedy output, cached in ``path``."""
    if path.is_file():
        cached: list[dict[str, Any]] = json.loads(path.read_text())
        return cached
    from transformers import AutoTokenizer

    warm, meas = workload_items(workload, None, max_new_tokens)
    spec = {"method": "plain", "model": model, "k": 1, "streams": [ROWS], "warmup": [],
            "measure": warm + meas, "max_model_len": max_len}
    outputs = run_child(spec)["passes"][0]["outputs"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    lines = []
    for phase, item, out in zip(["warmup"] * len(warm) + ["measure"] * len(meas), warm + meas,
                                outputs, strict=True):
        prompt = encode_prompt(tokenizer, item["messages"] if item.get("messages")
                               else item["prompt"])
        lines.append({"phase": phase, "prompt_ids": list(prompt), "output_ids": out})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(lines))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentspec.bench.vllm_replay",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="bfcl-live")
    ap.add_argument("--outputs", required=True,
                    help="vLLM plain's outputs, cached here (generated when missing)")
    ap.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2)")
    ap.add_argument("--methods", default="suffix,agentspec,ceiling",
                    help="of suffix, agentspec and ceiling (agentspec's sources chosen among "
                         "with hindsight)")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--cost", default="0.0747,0.00209",
                    help="a step's seconds as BASE,PER_TOKEN (tokens verified in the batch); "
                         "the default is the bench's fit at one stream; agentspec sizes its "
                         "drafts by it and the modeled tokens/s are priced on it")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from agentspec.engine.load import resolve_model

        model = resolve_model("smollm2-135m-instruct")[1]
    lines = plain_outputs(args.workload, model, args.max_new_tokens, args.max_model_len,
                          Path(args.outputs))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    streams = [int(s) for s in args.streams.split(",")]
    base, per_token = (float(x) for x in args.cost.split(","))
    results = [replay(m, lines, args.k, args.max_model_len, model, tokenizer, streams,
                      (base, per_token)) for m in args.methods.split(",")]
    first = {p["streams"]: p for p in results[0]["passes"]}
    print("| method | streams | accepted/step | x first method | modeled tok/s | x first method |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        for p in r["passes"]:
            f = first[p["streams"]]
            print(f"| {r['method']} | {p['streams']} | {p['accepted_per_step']:.3f} | "
                  f"{p['accepted_per_step'] / f['accepted_per_step']:.2f} | "
                  f"{p['modeled_tokens_per_second']:.1f} | "
                  f"{p['modeled_tokens_per_second'] / f['modeled_tokens_per_second']:.2f} |")
        if "proposer" in r:
            print(f"  {r['method']} drafted {r['proposer']['drafted']} "
                  f"accepted {r['proposer']['accepted']}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
