"""Issue 50's serve figures on loopback: a bounded load, SIGTERM under load, SIGKILL under load.

``python -m tests.server.serve_figures OUT_DIR`` (from the repository root) starts ``agentspec
serve`` as a process (``--max-queue 16 --max-batch 16``) and prints one JSON line per figure:
64 clients at once (each answer a 200 or a 429 with Retry-After, and the requests /metrics
counted); SIGTERM with 16 requests in flight (how many completed, the exit code, the rows
recorded); kill -9 with requests in flight, then a restart on the same memory (rows, torn rows,
the restart's memory line). A command, not a test: it takes minutes; test_backpressure.py and
test_lifecycle.py check the same behaviours on smaller loads in `make test`.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import MASTER_KEY, MODEL, Server, start_server
from tests.server.test_lifecycle import _rows, _whole

AUTH = {"Authorization": f"Bearer {MASTER_KEY}"}
ARGS = ("--max-tokens", "32", "--max-queue", "16", "--max-batch", "16", "--grace", "120")


def ask(server: Server, text: str, scope: str) -> Any:
    """One chat request's answer, or the transport error it met."""
    try:
        return httpx.post(f"{server.url}/chat/completions", timeout=600,
                          headers={**AUTH, "X-Agentspec-Scope": scope},
                          json={"model": MODEL, "temperature": 0, "max_tokens": 32,
                                "messages": [{"role": "user", "content": text}]})
    except httpx.HTTPError as e:
        return e


def metrics(server: Server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url[:-3] + "/metrics", headers=AUTH, timeout=60).text.splitlines():
        if line.startswith(("agentspec_requests_total{", "agentspec_requests_running ")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def bounded_load(server: Server) -> dict[str, Any]:
    started = time.perf_counter()
    with ThreadPoolExecutor(64) as pool:
        res = list(pool.map(lambda i: ask(server, f"Write one sentence about the number {i}.",
                                          "load"), range(64)))
    codes = [r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in res]
    counted = sum(v for k, v in metrics(server).items()
                  if k.startswith("agentspec_requests_total{") and "chat/completions" in k)
    return {"clients": 64, "seconds": round(time.perf_counter() - started, 1),
            "200": codes.count(200), "429": codes.count(429),
            "other": [c for c in codes if c not in (200, 429)],
            "429s_with_retry_after": all("Retry-After" in r.headers for r in res
                                         if isinstance(r, httpx.Response) and r.status_code == 429),
            "counted_by_metrics": counted}


def sigterm_under_load(server: Server) -> dict[str, Any]:
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(ask, server, f"Tell a short tale about the city number {i}.", "term")
                   for i in range(16)]
        while (metrics(server).get("agentspec_requests_running", 0) < 16
               and not all(f.done() for f in futures)):
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        res = [f.result() for f in futures]
    code = server.proc.wait(300)
    ok = [r for r in res if isinstance(r, httpx.Response) and r.status_code == 200]
    return {"in_flight": 16, "completed_200": len(ok), "exit": code,
            "rows_of_scope": len([r for r in _rows(server.db) if r[0] == "term"])}


def sigkill_under_load(tmp: Path, tokenizer: Any) -> dict[str, Any]:
    server = start_server(tmp, *ARGS)
    done: list[Any] = []

    def one(i: int) -> None:
        r = ask(server, f"Describe the colour number {i} in a few words.", "kill")
        if isinstance(r, httpx.Response) and r.status_code == 200:
            done.append(r)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    while len(done) < 4:
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(60)
    for t in threads:
        t.join(60)
    restarted = start_server(tmp, *ARGS)
    log = restarted.log_tail(20000)
    rows = _rows(restarted.db)
    out = {"completed_before_kill": len(done),
           "rows_of_scope": len([r for r in rows if r[0] == "kill"]), "all_rows": len(rows),
           "torn": sum(not _whole(r, tokenizer) for r in rows),
           "restart_memory_line": [x for x in log.splitlines() if x.startswith("memory:")],
           "errors_in_restart_log": "Traceback" in log or "MemoryFaultWarning" in log}
    restarted.proc.send_signal(signal.SIGTERM)
    out["restart_exit"] = restarted.proc.wait(120)
    return out


def main(out_dir: str) -> None:
    from transformers import AutoTokenizer

    from agentspec.engine.load import resolve_model_dir

    tmp = Path(out_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(MODEL)[1])
    server = start_server(tmp, *ARGS)
    print(json.dumps({"bounded_load": bounded_load(server)}), flush=True)
    print(json.dumps({"sigterm_under_load": sigterm_under_load(server)}), flush=True)
    print(json.dumps({"sigkill_under_load": sigkill_under_load(tmp, tokenizer)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
