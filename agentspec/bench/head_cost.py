"""The draft head's cost against the target's: one beam tree versus one verification forward;
and its acceptance on a bench run's requests.

    python -m agentspec.bench.head_cost --scope bfcl-GorillaFileSystem
    python -m agentspec.bench.head_cost --lines out/lines.json

Loads the model and its trained head (``agentspec head train``), prefills about ``--context``
tokens, then times (best of ``--repeats``, interleaved) the head's beam search at each width
and depth asked and the target's forward scoring the root plus the head's spine. Prints JSON.

``--lines`` (a greedy bench run's outputs, ``agentspec bench --lines``) measures instead the
head's acceptance per depth on the run's measured requests, as ``head train`` measures its
held-out records (:func:`~agentspec.drafters.head_train.acceptance_by_depth`): requests the
head was never trained on, when its corpus left the bench's tasks out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


@torch.inference_mode()
def lines_acceptance(target: Any, head: Any, lines: Sequence[Any], *, depth: int = 6) -> dict[str, Any]:
    """The head's acceptance per depth over ``lines`` (:class:`~agentspec.bench.replay.Line`),
    each run through the target in one forward; plus the share of their output tokens in the
    head's vocabulary."""
    from agentspec.drafters.head_train import Replayed, acceptance_by_depth

    data = []
    for line in lines:
        ids, prompt = [*line.prompt_ids, *line.output_ids], len(line.prompt_ids)
        if prompt < 2 or len(line.output_ids) < 2:
            continue
        rows = target.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        # hidden[i]: the row that predicted tokens[i] (as head_train.replay lays them out)
        data.append(Replayed(torch.tensor(ids[prompt - 1 :]),
                             rows[prompt - 2 : len(ids) - 1].float(), torch.zeros(0)))
    vocab = set(head.vocab.tolist())
    outputs = [t for line in lines for t in line.output_ids]
    return {**acceptance_by_depth(head, data, depth=depth), "lines": len(data),
            "in_vocab": sum(t in vocab for t in outputs) / len(outputs) if outputs else 0.0}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--scope", default=None, help="the head's scope (with --lines: default "
                        "every scope of the run's measured lines)")
    parser.add_argument("--lines", type=Path, default=None,
                        help="a bench run's outputs: measure acceptance on its measured lines")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", default="1x6,4x6,8x6",
                        help="beam width x depth, comma-separated")
    args = parser.parse_args(argv)
    if args.lines is None and args.scope is None:
        parser.error("--scope is required without --lines")

    from agentspec.drafters.head import beam_search, head_path, load_head
    from agentspec.engine.load import load_target
    from agentspec.engine.plan import draft_member
    from agentspec.types import Draft

    target = load_target(args.model, device="cpu")
    if args.lines is not None:
        return _lines(target, args.lines, args.scope)
    head = load_head(head_path(target.fingerprint, args.scope), target.model,
                     fingerprint=target.fingerprint)
    if head is None:
        print(f"no head for {target.fingerprint} in scope {args.scope!r}", file=sys.stderr)
        return 1
    prompt = [1 + t % (target.vocab_size - 1) for t in range(args.context)]
    seq = target.new_sequence(cached=False)
    target.prefill(seq, prompt)
    hidden = target.run([draft_member(seq, prompt[-1], Draft())], hidden=True).hidden[0]
    assert hidden is not None
    h = hidden[0].float().clone()
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
            target.run([draft_member(seq, prompt[-1], spine)])  # nothing is committed
            target_s.append(time.perf_counter() - started)
        best_head, best_target = min(head_s), min(target_s)
        out["shapes"][shape] = {  # type: ignore[index]
            "tree_nodes": len(tree.token_ids), "head_ms": round(best_head * 1e3, 3),
            "target_forward_ms": round(best_target * 1e3, 2),
            "ratio": round(best_head / best_target, 4)}
    print(json.dumps(out, indent=2))
    return 0


def _lines(target: Any, path: Path, scope: str | None) -> int:
    from agentspec.bench.replay_lines import load_lines
    from agentspec.drafters.head import head_path, load_head

    measured = [line for line in load_lines(path) if line.phase == "measure"
                and (scope is None or line.scope == scope)]
    out: dict[str, Any] = {"model": target.fingerprint, "scopes": {}}
    for name in sorted({line.scope for line in measured}):
        head = load_head(head_path(target.fingerprint, name), target.model,
                         fingerprint=target.fingerprint)
        if head is not None:
            out["scopes"][name] = lines_acceptance(
                target, head, [line for line in measured if line.scope == name])
    if not out["scopes"]:
        print(f"no head for {target.fingerprint} in the scopes of {path}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
