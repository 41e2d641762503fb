"""A separate writer process for the multi-process store tests (run as a script).

``write URL TAG N TOTAL``: record N completions through a CompletionMemory, wait until the store
holds TOTAL rows, then print how many vectors this process's index holds after a lookup.
``burst URL``: add records forever (the caller kills it with SIGKILL).
"""

from __future__ import annotations

import sys
import time

from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores import SQLStore
from agentspec.types import Record


def write(url: str, tag: str, n: int, total: int) -> None:
    memory = CompletionMemory.open(url, embedder=HashEmbedder(), sync_interval_s=0.0,
                                   max_tokens_per_scope=None, max_tokens_total=None)
    for i in range(n):
        memory.record(scope="shared", model="m", request_text=f"{tag} request {i}",
                      key_text=f"{tag} key {i}", completion_text=f"{tag} completion {i}",
                      completion_ids=list(range(i % 7 + 1)))
    deadline = time.monotonic() + 120
    while len(memory.store) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    memory.lookup("anything", scope="shared", model="m", k=1)
    print(memory.stats()["indexes"]["shared"], flush=True)
    memory.close()


def burst(url: str) -> None:
    store = SQLStore(url)
    embedder = HashEmbedder()
    i = 0
    while True:
        key = f"burst key {i} " + "x" * (i % 500)
        store.add(Record(scope="burst", model="m", request_text="r" * (i % 3000), key_text=key,
                         completion_text=f"completion {i}", completion_ids=tuple(range(i % 300 + 1)),
                         embedding=embedder.embed([key])[0], embedder=embedder.name))
        if i == 20:
            print("writing", flush=True)
        i += 1


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        burst(sys.argv[2])
