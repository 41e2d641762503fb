"""The figures of :mod:`agentspec.bench.servers`: the summary, its table, markdown and plot.

The summary is plain JSON (written by ``--out`` as :func:`agentspec.bench.report.write_json`
writes the other benches'): per system and level a row, the ratios to llama.cpp at each level,
the systems' agreement with each other at level 1, why any system failed, the processor, and
the instruction set both systems were built for (``kernels``: ``AGENTSPEC_KERNEL_MARCH``).
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentspec.bench.load import percentile
from agentspec.bench.workload import WorkloadItem
from agentspec.engine.quant.native import ARCH

BASELINE = "llama.cpp"
"""The server every level's ratios are taken against."""


def processor() -> str:
    """The processor's model name (Linux), else what Python knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def valid_call(answer_calls: Sequence[Mapping[str, str]], tools: Sequence[Mapping[str, Any]]
               ) -> bool:
    """Whether an answer is one or more calls of the bound ``tools``: each call names a bound
    tool, its arguments are a JSON object holding the tool's required parameters and no
    parameter the tool lacks."""
    if not answer_calls:
        return False
    by_name = {t.get("name"): t.get("parameters") or {} for t in tools}
    for call in answer_calls:
        if call.get("name") not in by_name:
            return False
        try:
            args = json.loads(call.get("arguments") or "")
        except json.JSONDecodeError:
            return False
        schema = by_name[call["name"]]
        known = schema.get("properties")
        if not isinstance(args, dict) or not set(schema.get("required") or ()) <= set(args):
            return False
        if isinstance(known, dict) and not set(args) <= set(known):
            return False
    return True


def _row(p: Any, solo: Mapping[str, str] | None, tools: Mapping[str, Any] | None
         ) -> dict[str, Any]:
    answers = [c.answer for c in p.calls]
    tokens = sum(a.completion_tokens for a in answers)
    steps = [a.steps for a in answers]
    row: dict[str, Any] = {
        "system": p.system, "concurrency": p.concurrency, "requests": len(answers),
        "tokens": tokens, "seconds": round(p.seconds, 3),
        "tokens_per_second": round(tokens / p.seconds, 2) if p.seconds > 0 else 0.0,
        "latency_ms_p50": round(1e3 * percentile([a.seconds for a in answers], 0.5), 1),
        "latency_ms_p99": round(1e3 * percentile([a.seconds for a in answers], 0.99), 1),
        "ttft_ms_p50": round(1e3 * percentile([a.first_token_seconds for a in answers], 0.5), 1),
        "ttft_ms_p99": round(1e3 * percentile([a.first_token_seconds for a in answers], 0.99), 1),
        "tokens_per_step": round(tokens / sum(s or 0 for s in steps), 3)
        if steps and all(s for s in steps) else None,
        "tokens_counted_by_server": all(a.counted for a in answers),
        "same_as_level_1": None, "valid_calls": None,
    }
    if solo is not None:
        same = [solo.get(c.id) == c.answer.output() for c in p.calls if c.id in solo]
        row["same_as_level_1"] = round(sum(same) / len(same), 4) if same else None
    if tools is not None:
        valid = [valid_call(c.answer.tool_calls, tools.get(c.id, ())) for c in p.calls]
        row["valid_calls"] = round(sum(valid) / len(valid), 4) if valid else None
    return row


def summarize(passes: Sequence[Any], failed: Mapping[str, str],
              items: Sequence[WorkloadItem], *, tools: bool) -> dict[str, Any]:
    """Rows per system and level, ratios to :data:`BASELINE`, agreement, failures;
    ``passes`` are :class:`agentspec.bench.servers.Pass` values."""
    solo = {p.system: {c.id: c.answer.output() for c in p.calls}
            for p in passes if p.concurrency == 1}
    bound = {i.id: (i.grammar or {}).get("tools") or () for i in items} if tools else None
    rows = [_row(p, solo.get(p.system), bound)
            for p in sorted(passes, key=lambda p: (p.concurrency, p.system))]
    versus: dict[str, dict[str, float]] = {}
    for level in sorted({r["concurrency"] for r in rows}):
        rates = {r["system"]: r["tokens_per_second"] for r in rows if r["concurrency"] == level}
        if rates.get(BASELINE):
            versus[str(level)] = {s: round(v / rates[BASELINE], 3) for s, v in rates.items()
                                  if s != BASELINE}
    names = sorted(solo)
    agreement = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            shared = [k for k in solo[a] if k in solo[b]]
            if shared:
                agreement[f"{a} = {b}"] = round(
                    sum(solo[a][k] == solo[b][k] for k in shared) / len(shared), 4)
    return {"rows": rows, "versus_llama_cpp": versus, "agreement_at_1": agreement,
            "failed": dict(failed), "tools": tools, "processor": processor(),
            "kernels": ARCH,
            "answers": {f"{p.system}@{p.concurrency}": {c.id: c.answer.output() for c in p.calls}
                        for p in passes}}


_COLUMNS = ("clients", "system", "tok/s", "x llama.cpp", "latency ms p50/p99",
            "TTFT ms p50/p99", "tok/step", "= its level 1", "valid calls")


def table_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    """One row of strings per system and level, columns as :data:`_COLUMNS`."""
    out = []
    for r in summary["rows"]:
        ratio = summary["versus_llama_cpp"].get(str(r["concurrency"]), {}).get(r["system"])
        out.append([
            str(r["concurrency"]), r["system"], f"{r['tokens_per_second']:.1f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            f"{r['latency_ms_p50']:.0f} / {r['latency_ms_p99']:.0f}",
            f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f}",
            "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}",
            "-" if r["same_as_level_1"] is None else
            f"{round(r['same_as_level_1'] * r['requests'])}/{r['requests']}",
            "-" if r["valid_calls"] is None else f"{r['valid_calls']:.0%}",
        ])
    return out


def title(summary: Mapping[str, Any]) -> str:
    return (f"{Path(str(summary.get('workload', ''))).stem}: {summary.get('requests', '?')} "
            f"requests{' with tools' if summary.get('tools') else ''}, "
            f"{summary.get('gguf_name', '')}, {summary.get('threads', '?')} threads, "
            f"{summary.get('processor', '')}"
            f"{'' if summary.get('kernels', 'native') == 'native' else ', built for ' + summary['kernels']}")


def rich_table(summary: Mapping[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=title(summary))
    for column in _COLUMNS:
        table.add_column(column, justify="left" if column == "system" else "right")
    for row in table_rows(summary):
        table.add_row(*row)
    return table


def notes(summary: Mapping[str, Any]) -> list[str]:
    """Agreement between the systems and failures, one line each."""
    lines = [f"answers at 1 client, {pair}: {share:.0%}"
             for pair, share in summary["agreement_at_1"].items()]
    lines += [f"{name} failed {why.splitlines()[0]}" for name, why in summary["failed"].items()]
    return lines


def to_markdown(summary: Mapping[str, Any]) -> str:
    header = "| " + " | ".join(_COLUMNS) + " |\n|" + "---|" * len(_COLUMNS) + "\n"
    body = "".join("| " + " | ".join(r) + " |\n" for r in table_rows(summary))
    extra = "".join(f"- {line}\n" for line in notes(summary))
    return f"## {title(summary)}\n\n{header}{body}\n{extra}"


def write_markdown(summary: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_markdown(summary), encoding="utf-8")


def plot(summary: Mapping[str, Any], path: Path) -> None:
    """Tokens/s and p50 latency by clients, a line per system (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in sorted({r["system"] for r in summary["rows"]}):
        rows = [r for r in summary["rows"] if r["system"] == name]
        levels = [r["concurrency"] for r in rows]
        ax1.plot(levels, [r["tokens_per_second"] for r in rows], marker="o", label=name)
        ax2.plot(levels, [r["latency_ms_p50"] for r in rows], marker="o", label=name)
    ax1.set_title("tokens/s by clients")
    ax2.set_title("request latency p50 (ms) by clients")
    for ax in (ax1, ax2):
        ax.set_xlabel("clients")
        ax.legend(fontsize=8)
    fig.suptitle(title(summary), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
