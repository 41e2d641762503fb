"""A stub OpenAI chat server for the servers bench's tests (run as a script, one process each).

It answers ``GET /health`` and streamed ``POST /v1/chat/completions``. An answer is a pure
function of the request (its last message), so two stubs agree, unless ``--by-load``: then the
answer also names how many requests were in flight when it arrived, as an engine whose outputs
depend on the batch would (the deliberately wrong server the invariance accounting must catch).
``--die-after N`` exits mid-stream on the N-th chat request; ``--tag`` is written into every
recorded line (which command started it); ``--steps llama|agentspec`` reports steps as that
server does; ``--calls`` answers a tools request with a call of its first tool (its required
parameters set) when the last message's length is even, else in prose.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ARGS: Any = None
LOCK = threading.Lock()
STATE = {"in_flight": 0, "chats": 0}


def answer_words(body: dict[str, Any], in_flight: int) -> list[str]:
    last = body["messages"][-1]["content"]
    digest = hashlib.sha256(last.encode()).hexdigest()
    words = [digest[i:i + 4] for i in range(0, 4 * (2 + len(last) % 5), 4)]
    if ARGS.by_load:
        words.append(f"load{in_flight}")
    return words[: body.get("max_tokens", 64)]


def tool_call(body: dict[str, Any]) -> dict[str, Any] | None:
    tools = body.get("tools") or []
    if not (ARGS.calls and tools and len(body["messages"][-1]["content"]) % 2 == 0):
        return None
    fn = tools[0]["function"]
    args = {k: "x" for k in (fn.get("parameters") or {}).get("required", [])}
    return {"index": 0, "id": "call_0", "type": "function",
            "function": {"name": fn["name"], "arguments": json.dumps(args)}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = b'{"status": "ok"}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _event(self, payload: Any) -> None:
        data = b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
        self.wfile.write(b"%x\r\n%s\n\n\r\n" % (len(data) + 2, data))
        self.wfile.flush()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with LOCK:
            STATE["in_flight"] += 1
            STATE["chats"] += 1
            n, in_flight = STATE["chats"], STATE["in_flight"]
            with open(ARGS.record, "a") as f:
                f.write(json.dumps({"tag": ARGS.tag, "body": body}) + "\n")
        time.sleep(0.01)  # let concurrent requests overlap
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            call = tool_call(body)
            words = [] if call else answer_words(body, in_flight)
            for i, word in enumerate(words):
                if ARGS.die_after and n >= ARGS.die_after and i == 1:
                    os._exit(7)
                self._event({"choices": [{"index": 0, "delta": {"content": word + " "}}]})
            if call:
                self._event({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
            tokens = max(len(words), 1)
            last: dict[str, Any] = {"choices": [{"index": 0, "delta": {},
                                                 "finish_reason": "tool_calls" if call else "stop"}]}
            if ARGS.steps == "agentspec":
                last["agentspec"] = {"stats": {"steps": (tokens + 1) // 2}}
            elif ARGS.steps == "llama":
                last["timings"] = {"predicted_n": tokens, "draft_n": tokens,
                                   "draft_n_accepted": tokens // 2}
            self._event(last)
            self._event({"choices": [], "usage": {"completion_tokens": tokens}})
            self._event(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
        finally:
            with LOCK:
                STATE["in_flight"] -= 1


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--record", required=True)
    ap.add_argument("--tag", default="")
    ap.add_argument("--by-load", action="store_true")
    ap.add_argument("--die-after", type=int, default=0)
    ap.add_argument("--steps", choices=("none", "llama", "agentspec"), default="none")
    ap.add_argument("--calls", action="store_true")
    ap.add_argument("--fail-start", action="store_true")
    ARGS = ap.parse_args()
    if ARGS.fail_start:
        raise SystemExit("stub: told to fail at start")
    ThreadingHTTPServer(("127.0.0.1", ARGS.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
