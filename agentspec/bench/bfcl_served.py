"""BFCL's own local-model runner against ``agentspec serve``, drafts on and off.

``python -m agentspec.bench.bfcl_served --categories simple_python,multiple,live_simple
--limit 10`` starts ``agentspec serve`` twice on the packaged model, one after the other: as
users run it (drafts from the memory, prompt lookup and suffix matching, recording on, a fresh
memory) and with ``--no-speculate`` (plain decoding on the same engine). Each time BFCL's
``bfcl generate`` runs against it with ``--skip-server-setup`` and ``REMOTE_OPENAI_BASE_URL``:
BFCL renders its prompts with its own handler (``Qwen/Qwen3-0.6B``'s prompting handler: SmolLM2
speaks ChatML, as Qwen does) and calls ``/v1/completions``, exactly as it drives a vLLM or
SGLang server. Then ``bfcl evaluate`` scores both result folders.

It reports, per category, BFCL's accuracy for each server, the wall time of each generation
phase, and how many of BFCL's recorded answers are byte-identical between the two: the promise
is that drafts change no answer, so the scores must be equal. The first ``--limit`` entries of
each category run (BFCL's ``--run-ids`` file); greedy (``--temperature 0``); BFCL is told the
model's context is ``--context`` tokens (:func:`bounded_copy`).

Needs the server extra, and BFCL with its own dependencies in a Python of its own
(``--bfcl-python``, default ``.venv-bfcl/bin/python``: ``make bfcl-venv`` builds it; the
project's environment holds ``bfcl-eval`` for its data only, without the API clients its
runner imports).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HANDLER = "Qwen/Qwen3-0.6B"
"""The BFCL model whose prompting handler formats the prompts (ChatML with a tools block)."""

SYSTEMS = {"agentspec": [], "agentspec-plain": ["--no-speculate"]}
"""Each server's extra ``agentspec serve`` options."""


def _entries(category: str, limit: int) -> list[str]:
    """The first ``limit`` test ids of a BFCL category, in BFCL's own order."""
    from bfcl_eval.utils import load_dataset_entry

    return [entry["id"] for entry in load_dataset_entry(category)][:limit]


def bounded_copy(model_dir: str, to: Path, context: int) -> str:
    """What BFCL reads of the model (its tokenizer and config; no weights) in ``to``, the
    config's ``max_position_embeddings`` set to ``context``: BFCL asks each request for the
    context left after its prompt, and a small model that repeats itself to the end of a
    4,096-token answer would hold the bench for hours. Both servers get the same bound."""
    import shutil

    to.mkdir(parents=True, exist_ok=True)
    for path in Path(model_dir).iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".bin", ".gguf")):
            shutil.copy(path, to / path.name)
    config = json.loads((to / "config.json").read_text())
    config["max_position_embeddings"] = context
    (to / "config.json").write_text(json.dumps(config, indent=1))
    return str(to)


def start_server(model_dir: str, served_as: str, db: str, extra: list[str],
                 log: Path) -> tuple[subprocess.Popen, str]:
    """``agentspec serve`` of ``model_dir`` on a free port under the name ``served_as`` (the
    path BFCL sends as ``model``); returns the process and its base URL once it serves."""
    cmd = [sys.executable, "-m", "agentspec.cli", "serve", "--model", model_dir, "--port", "0",
           "--served-model-name", served_as, "--db", db, "--max-tokens", "4096",
           "--log-level", "warning", *extra]
    out = log.open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            out.write(line)
            out.flush()
            found = re.search(r"serving .* at (http://\S+/v1)", line)
            if found and not url:
                url.append(found.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(600) or not url:
        proc.kill()
        raise RuntimeError(f"agentspec serve did not start; its log: {log}")
    return proc, url[0]


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_bfcl(python: str, args: list[str], env: dict[str, str], log: Path) -> None:
    with log.open("a") as out:
        done = subprocess.run([python, "-m", "bfcl_eval", *args], env=env, stdout=out,
                              stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        raise RuntimeError(f"bfcl {args[0]} exited {done.returncode}; its log: {log}")


def _answers(result_dir: Path) -> dict[str, Any]:
    """Every recorded answer under a BFCL result folder, by test id."""
    found: dict[str, Any] = {}
    for path in result_dir.rglob("*_result.json"):
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                found[row["id"]] = row.get("result")
    return found


def _scores(score_dir: Path) -> dict[str, float]:
    """BFCL's accuracy per category from its score files (each file's first line)."""
    out: dict[str, float] = {}
    for path in score_dir.rglob("*_score.json"):
        first = json.loads(path.read_text().splitlines()[0])
        name = re.sub(r"^BFCL_v\d+_|_score\.json$", "", path.name)
        out[name] = float(first.get("accuracy", 0.0))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m agentspec.bench.bfcl_served",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--categories", default="simple_python,multiple,live_simple")
    ap.add_argument("--limit", type=int, default=10, help="entries per category")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=1024,
                    help="the context BFCL is told the model has (it asks each request for "
                         "what is left of it after the prompt)")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    ap.add_argument("--keep", default=None, help="keep BFCL's folders and the logs here")
    ap.add_argument("--bfcl-python", default=".venv-bfcl/bin/python",
                    help="the Python with bfcl-eval and its dependencies (make bfcl-venv)")
    args = ap.parse_args(argv)
    if args.limit < 1:
        ap.error(f"--limit must be >= 1, got {args.limit}")
    if not Path(args.bfcl_python).exists():
        ap.error(f"--bfcl-python {args.bfcl_python!r} does not exist; `make bfcl-venv` builds "
                 "the default")
    from agentspec.engine.load import resolve_model

    served_dir = str(resolve_model(args.model)[1])
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    work = Path(args.keep or tempfile.mkdtemp(prefix="agentspec-bfcl-served-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = bounded_copy(served_dir, work / "model", args.context)
    ids = {c: _entries(c, args.limit) for c in categories}
    (work / "test_case_ids_to_generate.json").write_text(json.dumps(ids))
    summary: dict[str, Any] = {"categories": categories, "limit": args.limit, "model": model_dir,
                               "handler": HANDLER, "systems": {}}
    for system, extra in SYSTEMS.items():
        log = work / f"{system}.log"
        proc, url = start_server(served_dir, model_dir, f"sqlite:///{work / (system + '.db')}",
                                 extra, log)
        env = {**os.environ, "BFCL_PROJECT_ROOT": str(work), "REMOTE_OPENAI_BASE_URL": url,
               "REMOTE_OPENAI_API_KEY": "EMPTY"}
        results, scores = work / f"result-{system}", work / f"score-{system}"
        try:
            started = time.perf_counter()
            run_bfcl(args.bfcl_python, ["generate", "--model", HANDLER, "--run-ids", "--temperature", "0",
                      "--backend", "vllm", "--skip-server-setup", "--local-model-path", model_dir,
                      "--result-dir", str(results), "--num-threads", "1"], env, log)
            seconds = time.perf_counter() - started
        finally:
            stop_server(proc)
        run_bfcl(args.bfcl_python, ["evaluate", "--model", HANDLER, "--test-category", ",".join(categories),
                  "--result-dir", str(results), "--score-dir", str(scores), "--partial-eval"],
                 env, log)
        summary["systems"][system] = {"generate_seconds": round(seconds, 1),
                                      "accuracy": _scores(scores), "answers": _answers(results)}
        print(f"{system}: {seconds:.1f} s, accuracy {summary['systems'][system]['accuracy']}",
              flush=True)
    a = summary["systems"]["agentspec"]["answers"]
    b = summary["systems"]["agentspec-plain"]["answers"]
    summary["identical_answers"] = sum(a.get(k) == v for k, v in b.items())
    summary["answers"] = len(b)
    summary["speedup"] = round(summary["systems"]["agentspec-plain"]["generate_seconds"]
                               / summary["systems"]["agentspec"]["generate_seconds"], 3)
    summary["scores_equal"] = (summary["systems"]["agentspec"]["accuracy"]
                               == summary["systems"]["agentspec-plain"]["accuracy"])
    print(f"identical answers {summary['identical_answers']}/{summary['answers']}, scores equal "
          f"{summary['scores_equal']}, agentspec {summary['speedup']}x plain (generate phase)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
