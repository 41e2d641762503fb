"""``python -m agentspec.bench.engine``: the engine on one device, in two figures.

1. The cost of one verification forward per draft size, eager and (on CUDA) as a CUDA graph,
   at ``--context`` tokens of KV: the median of ``--repeats`` timed forwards; on CUDA the
   graph once more on the model's modules instead of the fused forward.
2. Draft invariance: greedy outputs of plain decoding (no prefix reuse) against prompt-lookup
   speculation with prefix reuse, and eager against graphed forwards, on the core prompts.
3. With ``--ops 1024,2048,4096``: the operations of one 64-row forward that reads the whole
   KV of each capacity, as a CUDA graph holds it (each is a kernel there, and a graph's replay
   costs about its kernel count), in all and inside attention; views and casts to the dtype a
   tensor already has are not counted. Once for the model's modules, once for the fused
   forward (:mod:`agentspec.engine.fused`; a Triton kernel counts one). Any device: on the
   CPU the count is the figure. With ``--family NAME`` (``qwen3``, ``olmo2``, ...) the model
   is a tiny random checkpoint of that family as deep as its reference checkpoint
   (:mod:`agentspec.bench.families`): the count depends on the layers, not on the widths.

Writes a JSON file with ``--out FILE``. A figure, not a test: GPU tests live in ``tests/gpu``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from agentspec.bench.families import REFERENCES, tiny_model
from agentspec.bench.prompts import ALL_PROMPTS
from agentspec.drafters.policy import DEFAULT_COST
from agentspec.engine.load import load_target
from agentspec.engine.plan import draft_member
from agentspec.engine.target import HFTarget
from agentspec.engine.torch_thread import on_torch_thread
from agentspec.speculator import Speculator
from agentspec.types import Draft, Verdict

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def forward_ms(target: HFTarget, sizes: tuple[int, ...], context: int, repeats: int) -> dict[int, float]:
    """Median milliseconds of one engine ``run`` over ``1 + n`` rows of one sequence at
    ``context`` tokens of KV, rolled back after each (a scratch sequence the pool never
    caches)."""
    prompt = [1 + t % (target.vocab_size - 1) for t in range(context)]
    seq = target.new_sequence(cached=False)
    try:
        target.prefill(seq, prompt)
        out: dict[int, float] = {}
        for n in sizes:
            draft = Draft.chain([7] * n, "cost") if n else Draft()
            times = []
            for i in range(repeats + 2):  # two warm-up forwards (the first captures the graph)
                t0 = time.perf_counter()
                logits = target.run([draft_member(seq, prompt[-1], draft)])[0]
                assert logits is not None
                float(logits[0, 0])  # waits for the device
                if i >= 2:
                    times.append(time.perf_counter() - t0)
                seq.commit(prompt[-1], Verdict((), (), prompt[-1]))
                seq.truncate(context - 1)
            out[n + 1] = round(1000 * statistics.median(times), 3)
        return out
    finally:
        seq.release()


_VIEWS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.expand.default", "aten.t.default",
    "aten.transpose.int", "aten.unsqueeze.default", "aten.slice.Tensor", "aten.select.int",
    "aten.reshape.default", "aten.permute.default", "aten.as_strided.default",
    "aten.alias.default", "aten.detach.default", "aten.squeeze.dim", "aten._reshape_alias.default",
    "aten.split.Tensor", "aten.unbind.int"})


def _filled(base: HFTarget, capacity: int, width: int, model: Any = None) -> tuple[HFTarget, Any]:
    """A target on ``model`` (default the base's; else fused) and the member of a
    ``width``-row chain after ``capacity - width`` committed positions of a sequence: a
    forward that fills the sequence's ``capacity // KEY_BLOCK`` blocks and reads every one.
    The committed positions hold no computed rows (zeros; committed without a forward): the
    count is structural."""
    if capacity < 2 * width:
        raise ValueError(f"capacity {capacity} is below two forwards of {width} rows")
    target = HFTarget(model or base.model, base.tokenizer, name=base.name, reuse_prefix=False,
                      fused=False if model is None else True,
                      widths=(width,) if model is None else (16, 32, 64), prefill_widths=())
    seq = target.new_sequence(cached=False)
    seq.reserve(capacity)
    rest = capacity - width - 1
    seq.commit(7, Verdict.chain([7] * rest))
    return target, draft_member(seq, 7, Draft.chain([7] * (width - 1), "ops"))


def forward_ops(base: HFTarget, capacities: tuple[int, ...], width: int = 64) -> dict[str, dict[str, int]]:
    """Operations of one ``width``-row forward of the model's modules over a sequence whose KV
    fills each capacity, read whole (on CUDA a graph's forward is one kernel an operation)."""
    return on_torch_thread(_forward_ops, base, capacities, width)


def _forward_ops(base: HFTarget, capacities: tuple[int, ...], width: int) -> dict[str, dict[str, int]]:
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AttentionInterface

    from agentspec.engine import kv

    class Count(TorchDispatchMode):
        """Operations inside the model's own forward (the engine's layout, built before it,
        is host work the count leaves out)."""

        def __init__(self) -> None:
            super().__init__()
            self.total = self.attention = 0
            self.inside = self.in_model = False

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name, first = str(func), (args[0] if args else None)
            noop = isinstance(first, torch.Tensor) and (
                (name == "aten.to.dtype" and first.dtype == args[1])
                or (name == "aten.contiguous.default" and first.is_contiguous()))
            if self.in_model and name not in _VIEWS and not noop:
                self.total += 1
                self.attention += self.inside
            return func(*args, **(kwargs or {}))

    count = Count()

    def attention(*args: Any, **kwargs: Any) -> Any:
        count.inside = True
        try:
            return kv.agentspec_sdpa(*args, **kwargs)
        finally:
            count.inside = False

    def enter(*args: Any) -> None:
        count.in_model = True

    def leave(*args: Any) -> None:
        count.in_model = False

    out: dict[str, dict[str, int]] = {}
    AttentionInterface.register(kv.ATTENTION, attention)
    hooks = [base.model.register_forward_pre_hook(enter), base.model.register_forward_hook(leave)]
    try:
        for capacity in capacities:
            target, member = _filled(base, capacity, width)
            target.run([member])  # the first packs the linear layers' weights
            count.total = count.attention = 0
            with count:
                target.run([member])  # the rows are written again: nothing was committed
            out[str(capacity)] = {"operations": count.total, "in attention": count.attention}
    finally:
        for hook in hooks:
            hook.remove()
        AttentionInterface.register(kv.ATTENTION, kv.agentspec_sdpa)
    return out


_ALLOCATIONS = frozenset({"aten.empty.memory_format", "aten.empty_like.default",
                          "aten.empty_strided.default"})


def fused_ops(base: HFTarget, capacities: tuple[int, ...], width: int = 64) -> dict[str, dict[str, int]]:
    """Kernels of one ``width``-row fused forward (:mod:`agentspec.engine.fused`) over a
    sequence whose KV fills each capacity: each Triton launch counts one, and so does every
    tensor operation outside them that is no view or allocation (the embedding), as a CUDA
    graph of the forward holds them (the staging's copy before it is not). The kernels are
    counted, not run (outputs only allocated: the count is
    structural, and the CPU's interpreter is slow); the rows before are written by the modules.
    A float32 model is counted on a bf16 copy, the dtype the fused forward runs."""
    return on_torch_thread(_fused_ops, base, capacities, width)


def _fused_ops(base: HFTarget, capacities: tuple[int, ...], width: int) -> dict[str, dict[str, int]]:
    import copy

    from torch.utils._python_dispatch import TorchDispatchMode

    from agentspec.engine.fused import kernels
    from agentspec.engine.fused.llama import select, unsupported

    model = base.model
    if next(model.parameters()).dtype == torch.float32:
        model = copy.deepcopy(model).to(torch.bfloat16)
    if select(model, required=False) is None:
        return {"unsupported": {str(unsupported(model)): 0}}

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.kernels = self.other = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = str(func)
            if name not in _VIEWS and name not in _ALLOCATIONS and not kernels.inside_launch():
                self.other += 1
            return func(*args, **(kwargs or {}))

    out: dict[str, dict[str, int]] = {}
    for capacity in capacities:
        target, member = _filled(base, capacity, width, model)
        count = Count()

        def launched(name: str, count: Count = count) -> None:
            count.kernels += 1

        with torch.inference_mode(), kernels.launches_seen(launched, run=False):
            target.forward.run([member], width=width)  # stages the inputs: not the graph's
            (run,) = target.forward.fused_runs()
            count.kernels = count.other = 0
            with count:
                run.run(None)  # what a CUDA graph of the forward holds
        out[str(capacity)] = {"operations": count.kernels + count.other,
                              "Triton kernels": count.kernels}
    return out


def invariance(base: HFTarget, max_new: int) -> dict[str, Any]:
    """Identical outputs out of ``len(ALL_PROMPTS)``, against plain decoding without reuse."""
    def twin(**kw: Any) -> HFTarget:
        return HFTarget(base.model, base.tokenizer, name=base.name, **kw)

    plain = Speculator(twin(reuse_prefix=False), speculate=False, cost=DEFAULT_COST, memory=None)
    runs = {"prompt lookup, prefix reuse": Speculator(twin(), memory=None, cost=DEFAULT_COST)}
    if base.device.type == "cuda":
        runs["plain, eager forwards"] = Speculator(twin(cuda_graphs=False, reuse_prefix=False),
                                                   speculate=False, cost=DEFAULT_COST, memory=None)
        # Not an invariance: the modules' kernels round otherwise (within bf16 rounding).
        runs["plain on the modules (not the fused forward)"] = Speculator(
            twin(fused=False, reuse_prefix=False), speculate=False, cost=DEFAULT_COST, memory=None)
    refs = [plain.generate(p, max_new).token_ids for p in ALL_PROMPTS]
    result: dict[str, Any] = {"prompts": len(ALL_PROMPTS)}
    for name, spec in runs.items():
        outs = [spec.generate(p, max_new) for p in ALL_PROMPTS]
        result[name] = sum(o.token_ids == r for o, r in zip(outs, refs, strict=True))
        steps = sum(o.stats.steps for o in outs)
        result[f"{name}: tokens per step"] = round(sum(len(o.token_ids) for o in outs) / steps, 2)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m agentspec.bench.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted([*DTYPES, "gguf"]), default=None,
                        help="default bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ops", default=None, metavar="CAPACITIES",
                        help="comma-separated KV capacities: count one 64-row forward's "
                             "operations at each, and do nothing else")
    parser.add_argument("--family", default=None, choices=sorted(REFERENCES),
                        help="with --ops: count a tiny random checkpoint of this family, as "
                             "deep as its reference checkpoint, instead of --model")
    args = parser.parse_args(argv)
    capacities: tuple[int, ...] = ()
    if args.ops is not None:
        try:
            capacities = tuple(int(c) for c in args.ops.split(",") if c.strip())
        except ValueError:
            parser.error(f"--ops takes comma-separated integers, got {args.ops!r}")
        if not capacities or min(capacities) < 128:
            parser.error(f"--ops takes KV capacities of at least 128 slots, got {args.ops!r}")
    elif args.family is not None:
        parser.error(f"--family {args.family} counts operations only: give --ops too")
    dtype = args.dtype or ("bf16" if args.device.startswith("cuda") or args.family else "fp32")
    if args.family is not None:
        base, name = family_target(args.family, args.device, DTYPES[dtype])
    else:
        base, name = load_target(args.model, device=args.device,
                                 dtype=DTYPES.get(dtype, dtype)), args.model
    if capacities:
        result_ops: dict[str, Any] = {"model": name, "device": args.device, "dtype": dtype,
                                      "forward_rows": 64,
                                      "ops": forward_ops(base, capacities),
                                      "fused ops": fused_ops(base, capacities)}
        _emit(result_ops, args.out)
        return result_ops
    sizes = (0, 3, 7, 15, 31, 63)
    result: dict[str, Any] = {
        "model": args.model, "device": args.device, "dtype": dtype, "context": args.context,
        "gpu_name": torch.cuda.get_device_name() if base.device.type == "cuda" else None,
        "widths": list(base.check_widths()),
        "forward_ms_eager": forward_ms(HFTarget(base.model, base.tokenizer, cuda_graphs=False),
                                       sizes, args.context, args.repeats)}
    if base.device.type == "cuda":
        result["fused"] = base.forward.fused is not None
        result["forward_ms_graph"] = forward_ms(HFTarget(base.model, base.tokenizer), sizes,
                                                args.context, args.repeats)
        result["forward_ms_graph_modules"] = forward_ms(
            HFTarget(base.model, base.tokenizer, fused=False), sizes, args.context, args.repeats)
    result["invariance"] = invariance(base, args.max_new_tokens)
    _emit(result, args.out)
    return result


def family_target(family: str, device: str, dtype: torch.dtype) -> tuple[HFTarget, str]:
    """A target on a tiny random checkpoint of ``family`` as deep as its reference (nothing
    reads its tokenizer: the counts score fixed ids)."""
    reference = REFERENCES[family]
    model = tiny_model(family, layers=reference.layers, dtype=dtype).to(device)
    name = f"tiny {family}, {reference.layers} layers as {reference.checkpoint}"
    return HFTarget(model, None, name=name, reuse_prefix=False), name


def _emit(result: dict[str, Any], path: Path | None) -> None:
    print(json.dumps(result, indent=2))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
