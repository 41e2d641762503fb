"""The draft head's cost against the target's: one beam tree versus one verification forward.

    python -m agentspec.bench.head_cost --scope bfcl-GorillaFileSystem

Loads the model and its trained head (``agentspec head train``), prefills about ``--context``
tokens, then times (best of ``--repeats``, interleaved) the head's beam search at each width
and depth asked and the target's forward scoring the root plus the head's spine. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import torch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--scope", required=True)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", default="1x6,4x6,8x6",
                        help="beam width x depth, comma-separated")
    args = parser.parse_args(argv)

    from agentspec.drafters.head import beam_search, head_path, load_head
    from agentspec.target import load_target
    from agentspec.types import Draft

    target = load_target(args.model, device="cpu")
    head = load_head(head_path(target.fingerprint, args.scope), target.model,
                     fingerprint=target.fingerprint)
    if head is None:
        print(f"no head for {target.fingerprint} in scope {args.scope!r}", file=sys.stderr)
        return 1
    target.keep_hidden = True
    prompt = [1 + t % (target.vocab_size - 1) for t in range(args.context)]
    target.start(prompt)
    target.score(prompt[-1], Draft())
    assert target.hidden is not None
    h = target.hidden[0].float().clone()
    out: dict[str, object] = {"model": target.fingerprint, "scope": args.scope,
                              "vocab": int(head.vocab.shape[0]), "context": args.context,
                              "threads": torch.get_num_threads(), "shapes": {}}
    for shape in args.shapes.split(","):
        width, depth = (int(x) for x in shape.split("x"))
        tree = beam_search(head, h, prompt[-1], width=width, depth=depth)
        spine = Draft.chain(tree.token_ids[: tree.spine], "head")
        head_s, target_s = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            beam_search(head, h, prompt[-1], width=width, depth=depth)
            head_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            target.score(prompt[-1], spine)  # the KV keeps its length: nothing is committed
            target_s.append(time.perf_counter() - started)
        best_head, best_target = min(head_s), min(target_s)
        out["shapes"][shape] = {  # type: ignore[index]
            "tree_nodes": len(tree.token_ids), "head_ms": round(best_head * 1e3, 3),
            "target_forward_ms": round(best_target * 1e3, 2),
            "ratio": round(best_head / best_target, 4)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
