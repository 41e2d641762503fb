"""Turns a :class:`~agentspec.bench.results.BenchResult` into numbers, a table, JSON, markdown
and a plot.

``speedup`` is a system's tokens/s over ``hf-greedy``'s tokens/s on the same requests;
``median_speedup`` is the median over requests of the same ratio per request. With
temperature 0, ``exact_match`` is the fraction of requests whose output (token ids cut before
the first stop token) equals ``hf-greedy``'s. ``first_token_ms`` (the table's ``TTFT ms``) is the median
over requests of the time to a call's first new token: tokenisation, the prompt's prefill and
the first step (transformers' systems: the same call cut to one token, timed apart; an
agentspec system's prefill skips what its KV or prefix cache holds, as a user's call does). With temperature > 0 outputs are random, so a
distribution check stands in for it (see :func:`distribution_check`).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from agentspec.bench.results import REFERENCE, BenchResult, Outcome, RequestResult

SOURCES = ("prompt_lookup", "memory", "suffix")
_GROUPED_ID = re.compile(r"^([A-Za-z]+)-\d+$")


def _tokens(outcomes: tuple[Outcome, ...]) -> int:
    return sum(len(o.token_ids) for o in outcomes)


def _seconds(outcomes: tuple[Outcome, ...]) -> float:
    return sum(o.seconds for o in outcomes)


def request_speedup(request: RequestResult, name: str) -> float:
    """tokens/s of ``name`` over the reference's on one request (time ratio if one made none)."""
    ref, own = request.outcomes[REFERENCE], request.outcomes[name]
    if _tokens(ref) and _tokens(own):
        return (_tokens(own) / _seconds(own)) / (_tokens(ref) / _seconds(ref))
    return _seconds(ref) / _seconds(own)


def _merge(dicts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def system_totals(requests: tuple[RequestResult, ...], name: str) -> dict[str, Any]:
    """Sums over ``requests`` of one system: seconds, tokens, tokens/s, speedups, acceptance."""
    outs = [o for r in requests for o in r.outcomes[name]]
    seconds, tokens = sum(o.seconds for o in outs), sum(len(o.token_ids) for o in outs)
    ref = [o for r in requests for o in r.outcomes[REFERENCE]]
    ref_tps = sum(len(o.token_ids) for o in ref) / max(sum(o.seconds for o in ref), 1e-9)
    tps = tokens / max(seconds, 1e-9)
    row: dict[str, Any] = {
        "seconds": round(seconds, 3), "new_tokens": tokens, "tokens_per_second": round(tps, 2),
        "speedup": round(tps / ref_tps, 3) if ref_tps else None,
        "median_speedup": round(statistics.median(request_speedup(r, name) for r in requests), 3)
        if requests else None,
    }
    firsts = [o.first_token_seconds for o in outs if o.first_token_seconds is not None]
    # Time to first token: tokenisation, the prompt's prefill (less what the KV held) and
    # the first step; the median over requests, in milliseconds.
    row["first_token_ms"] = round(1000 * statistics.median(firsts), 1) if firsts else None
    if outs and outs[0].steps is not None:
        steps = sum(o.steps or 0 for o in outs)
        row["steps"] = steps
        row["tokens_per_step"] = round(tokens / steps, 3) if steps else None
        accepted, drafted = _merge([o.accepted for o in outs]), _merge([o.drafted for o in outs])
        row["accepted_by_source"] = {s: accepted.get(s, 0) for s in sorted({*SOURCES, *accepted})}
        row["drafted_by_source"] = {s: drafted.get(s, 0) for s in sorted({*SOURCES, *drafted})}
        prompt = sum(r.prompt_tokens * len(r.outcomes[name]) for r in requests)
        # The share of the prompts' tokens no forward computed (prefix reuse, prefix cache).
        row["cached_prompt_share"] = round(sum(o.cached_tokens for o in outs) / prompt, 3) \
            if prompt else None
    return row


def exact_match(requests: tuple[RequestResult, ...], name: str,
                reference: str = REFERENCE) -> float:
    """Fraction of requests on which every sample of ``name`` equals ``reference``'s."""
    same = sum(all(a.token_ids == b.token_ids for a, b in
                   zip(r.outcomes[name], r.outcomes[reference], strict=True)) for r in requests)
    return round(same / len(requests), 4) if requests else 1.0


PLAIN = "agentspec-plain"


def same_as_plain(requests: tuple[RequestResult, ...], names: list[str]) -> dict[str, float]:
    """Per agentspec system, the fraction of requests equal to ``agentspec-plain``: the
    draft-invariance figure (in bf16 transformers' own kernels round otherwise, so identity
    with hf-greedy is not the promise there; identity with agentspec's plain decoding is)."""
    if PLAIN not in names:
        return {}
    return {n: exact_match(requests, n, PLAIN) for n in names
            if n.startswith("agentspec") and n != PLAIN}


def distribution_check(requests: tuple[RequestResult, ...], name: str, *,
                       rounds: int = 4000, alpha: float = 0.01) -> dict[str, Any]:
    """A cheap sanity check of sampled outputs against the reference's (temperature > 0).

    Per request, the mean output length over the seeds of ``name`` minus the reference's is
    ``d_i``; under "same distribution" each ``d_i`` is symmetric around 0, so a paired
    sign-flip permutation test of ``|mean(d)|`` gives a p-value. It has little power (it sees
    lengths only, over few samples) and catches gross errors, such as a wrong temperature or a
    broken stop; exactness itself is proven by the statistical tests of the verifier.
    """
    import numpy as np

    def mean_len(outs: tuple[Outcome, ...]) -> float:
        return sum(len(o.token_ids) for o in outs) / len(outs)

    d = np.array([mean_len(r.outcomes[name]) - mean_len(r.outcomes[REFERENCE]) for r in requests])
    observed = abs(d.mean()) if d.size else 0.0
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=(rounds, d.size))
    p = float(((np.abs((signs * d).mean(axis=1)) >= observed - 1e-12).sum() + 1) / (rounds + 1))
    return {"statistic": "mean output length, paired sign-flip permutation test",
            "mean_length_difference": round(float(d.mean()) if d.size else 0.0, 3),
            "p_value": round(p, 4), "ok": p >= alpha}


def groups(requests: tuple[RequestResult, ...]) -> dict[str, tuple[RequestResult, ...]]:
    """Requests by id prefix when every id reads ``<word>-<number>`` (``grounded-3``)."""
    out: dict[str, list[RequestResult]] = {}
    for r in requests:
        m = _GROUPED_ID.match(r.item.id)
        if m is None:
            return {}
        out.setdefault(m.group(1), []).append(r)
    return {k: tuple(v) for k, v in out.items()} if len(out) > 1 else {}


def _ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Throughput ratios of the agentspec systems over hf-pld (when both ran)."""
    out = {}
    if "hf-pld" in systems:
        base = systems["hf-pld"]["tokens_per_second"]
        for name in ("agentspec-pld", "agentspec", "agentspec-chain", "agentspec-suffix"):
            if name in systems and base:
                out[f"{name}/hf-pld"] = round(systems[name]["tokens_per_second"] / base, 3)
    return out


def tool_call_steps(requests: tuple[RequestResult, ...], names: list[str]) -> dict[str, Any]:
    """Tokens per target step on the outputs that are tool calls (requests decoded under a
    ``tool_calls`` grammar whose output starts like a call), per agentspec system."""
    out: dict[str, Any] = {}
    for name in names:
        outs = [o for r in requests if (r.item.grammar or {}).get("type") == "tool_calls"
                for o in r.outcomes[name][:1]
                if o.steps and o.text is not None and o.text.lstrip()[:1] in ("[", "{")]
        steps = sum(o.steps or 0 for o in outs)
        if outs and steps:
            out[name] = {"calls": len(outs), "tokens": sum(len(o.token_ids) for o in outs),
                         "steps": steps,
                         "tokens_per_step": round(sum(len(o.token_ids) for o in outs) / steps, 3)}
    return out


# The draftless baselines that draft from one kind of source: the prompt (prompt lookup) or
# the earlier outputs (SuffixDecoding / REST). The full system should never be slower than
# the best of them (issue 13).
SINGLE_SOURCE = ("agentspec-pld", "agentspec-suffix")


def versus(systems: dict[str, dict[str, Any]], ceiling: float | None) -> dict[str, Any]:
    """``agentspec`` against the best single-source system that ran (aggregate tokens/s) and
    against the replay ceiling's tokens per step; ``{}`` when agentspec did not run."""
    full = systems.get("agentspec")
    if not full:
        return {}
    out: dict[str, Any] = {}
    single = [n for n in SINGLE_SOURCE if n in systems and systems[n]["tokens_per_second"]]
    if single:
        best = max(single, key=lambda n: systems[n]["tokens_per_second"])
        out["best_single_source"] = best
        out["over_best_single_source"] = round(
            full["tokens_per_second"] / systems[best]["tokens_per_second"], 3)
    if ceiling and full.get("tokens_per_step"):
        out["ceiling_tokens_per_step"] = round(ceiling, 3)
        out["of_ceiling"] = round(full["tokens_per_step"] / ceiling, 3)
    return out


def versus_line(summary: dict[str, Any]) -> str:
    """One line: agentspec over the best single-source system and over the replay ceiling."""
    v = summary.get("versus") or {}
    parts = []
    if "best_single_source" in v:
        parts.append(f"agentspec/{v['best_single_source']} {v['over_best_single_source']:.2f}x "
                     "(tokens/s)")
    if "of_ceiling" in v:
        parts.append(f"agentspec tok/step {v['of_ceiling']:.0%} of the replay ceiling "
                     f"({v['ceiling_tokens_per_step']:.2f})")
    return f"{summary['workload']}: " + "; ".join(parts) if parts else ""


def cached_line(summary: dict[str, Any]) -> str:
    """One line: each agentspec system's share of prompt tokens it did not prefill."""
    shares = [f"{name} {s['cached_prompt_share']:.0%}" for name, s in summary["systems"].items()
              if s.get("cached_prompt_share") is not None]
    return ("prompt tokens read from the KV (prefix reuse, prefix cache): " + ", ".join(shares)
            if shares else "")


def _row(request: RequestResult, names: list[str]) -> dict[str, Any]:
    ref = request.outcomes[REFERENCE][0].token_ids
    row: dict[str, Any] = {"id": request.item.id, "scope": request.item.scope,
                           "prompt_tokens": request.prompt_tokens, "systems": {}}
    for name in names:
        outs = request.outcomes[name]
        cell: dict[str, Any] = {"seconds": round(_seconds(outs), 4), "new_tokens": _tokens(outs),
                                "speedup": round(request_speedup(request, name), 3),
                                "matches_reference": outs[0].token_ids == ref}
        if outs[0].steps is not None:
            cell["steps"] = sum(o.steps or 0 for o in outs)
            cell["accepted_by_source"] = _merge([o.accepted for o in outs])
            cell["cached_tokens"] = sum(o.cached_tokens for o in outs)
        row["systems"][name] = cell
    return row


def summarize(result: BenchResult) -> dict[str, Any]:
    """The JSON document of ``agentspec bench --out`` and ``--json`` (see the module docstring)."""
    names, reqs, config = list(result.config.systems), result.requests, result.config
    systems = {name: system_totals(reqs, name) for name in names}
    others = [n for n in names if n != REFERENCE]
    summary: dict[str, Any] = {
        "workload": Path(result.workload).stem, "workload_path": result.workload,
        "model": result.model, "device": result.device, "dtype": result.dtype,
        "gpu_name": result.gpu_name, "torch_version": result.versions.get("torch"),
        "transformers_version": result.versions.get("transformers"),
        "notes": list(result.notes), "measured_requests": len(reqs),
        "warmup_requests": result.warmup_requests, "temperature": config.temperature,
        "samples_per_request": config.samples if config.temperature > 0 else 1,
        "max_new_tokens": config.max_new_tokens, "load_average": list(result.load_average),
        "systems": systems, "ratios": _ratios(systems),
        "versus": versus(systems, result.ceiling_tokens_per_step),
        "exact_match": {n: exact_match(reqs, n) for n in others} if config.temperature == 0
        else {},
        "same_as_plain": same_as_plain(reqs, names),
        "median_speedup": {n: systems[n]["median_speedup"] for n in names},
        "tool_calls": tool_call_steps(reqs, names),
    }
    if config.temperature > 0:
        summary["distribution_check"] = {n: distribution_check(reqs, n) for n in others}
    summary["groups"] = {
        g: {"requests": len(rs), "systems": {n: system_totals(rs, n) for n in names},
            "ratios": _ratios({n: system_totals(rs, n) for n in names})}
        for g, rs in groups(reqs).items()
    }
    summary["requests"] = [_row(r, names) for r in reqs]
    return summary


def write_json(summary: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


# --- rendering -------------------------------------------------------------------------------
_COLUMNS = ("system", "tokens", "seconds", "tok/s", "speedup", "median", "TTFT ms", "tok/step",
            "accepted (pl/mem/sfx)", "exact", "= plain")


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    """One row of strings per system, columns as :data:`_COLUMNS`."""
    rows = []
    for name, s in summary["systems"].items():
        acc = s.get("accepted_by_source")
        exact = summary["exact_match"].get(name)
        check = summary.get("distribution_check", {}).get(name)
        rows.append([
            name, str(s["new_tokens"]), f"{s['seconds']:.1f}", f"{s['tokens_per_second']:.1f}",
            f"{s['speedup']:.2f}x", f"{s['median_speedup']:.2f}x",
            f"{s['first_token_ms']:.0f}" if s.get("first_token_ms") is not None else "-",
            f"{s['tokens_per_step']:.2f}" if s.get("tokens_per_step") else "-",
            "/".join(str(acc.get(k, 0)) for k in SOURCES) if acc else "-",
            f"{exact:.2f}" if exact is not None else
            (f"p={check['p_value']:.3f}" if check else "ref"),
            f"{summary['same_as_plain'][name]:.2f}" if name in summary.get("same_as_plain", {})
            else "-",
        ])
    return rows


def rich_table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=_title(summary))
    for i, column in enumerate(_COLUMNS):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in table_rows(summary):
        table.add_row(*row)
    return table


def _title(summary: dict[str, Any]) -> str:
    load = "/".join(f"{x:.2f}" for x in summary["load_average"])
    where = ", ".join(str(x) for x in (summary["device"], summary.get("dtype"),
                                       summary.get("gpu_name")) if x)
    return (f"{summary['workload']}: {summary['measured_requests']} requests "
            f"(+{summary['warmup_requests']} warmup), {summary['model']} on {where}, "
            f"temperature {summary['temperature']}, load average {load}")


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def to_markdown(summary: dict[str, Any]) -> str:
    """The report: totals per system, per-group ratios, the check, then every request."""
    parts = [f"## {_title(summary)}", "", _md_table(list(_COLUMNS), table_rows(summary)), ""]
    parts.append(f"speedup = tokens/s over {REFERENCE}'s on the same requests; median = median "
                 "per-request speedup; accepted = accepted draft tokens by source.")
    versions = [f"{k} {summary[f'{k}_version']}" for k in ("torch", "transformers")
                if summary.get(f"{k}_version")]
    if versions:
        parts.append("Versions: " + ", ".join(versions) + ".")
    parts += [f"Note: {note}" for note in summary.get("notes", [])]
    if summary["ratios"]:
        parts.append("Ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in summary["ratios"].items()))
    if summary.get("tool_calls"):
        parts.append("Tool-call outputs, tokens per target step: " + ", ".join(
            f"{n} {c['tokens_per_step']:.2f} ({c['calls']} calls)"
            for n, c in summary["tool_calls"].items()))
    if versus_line(summary):
        parts.append("Versus: " + versus_line(summary))
    if cached := cached_line(summary):
        parts.append(cached[0].upper() + cached[1:] + ".")
    for group, g in summary["groups"].items():
        parts += ["", f"### Requests with ids `{group}-*` ({g['requests']})", ""]
        rows = [[n, f"{s['tokens_per_second']:.1f}", f"{s['speedup']:.2f}x",
                 f"{s['median_speedup']:.2f}x"] for n, s in g["systems"].items()]
        parts.append(_md_table(["system", "tok/s", "speedup", "median"], rows))
        if g["ratios"]:
            parts.append("\nRatios: " + ", ".join(f"{k} {v:.2f}x" for k, v in g["ratios"].items()))
    checks: dict[str, Any] = summary.get("distribution_check", {})
    if checks:
        parts += ["", f"Distribution check (temperature > 0, {summary['samples_per_request']} "
                  "seeds per request): " + distribution_check.__doc__.split("\n\n")[1].strip()
                  if distribution_check.__doc__ else "", ""]
        parts.append(", ".join(f"{n}: p={c['p_value']:.3f} ({'ok' if c['ok'] else 'FAIL'})"
                               for n, c in checks.items()))
    names = list(summary["systems"])
    rows = [[r["id"], str(r["prompt_tokens"]), str(r["systems"][REFERENCE]["new_tokens"])]
            + [f"{r['systems'][n]['speedup']:.2f}x" + ("" if r["systems"][n]["matches_reference"]
                                                       else " ≠") for n in names[1:]]
            for r in summary["requests"]]
    parts += ["", "### Per request (speedup over hf-greedy; ≠ marks an output that differs)", "",
              _md_table(["id", "prompt tok", "new tok"] + names[1:], rows), ""]
    return "\n".join(parts)


def write_markdown(summary: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_markdown(summary), encoding="utf-8")


def plot(summary: dict[str, Any], path: Path) -> None:
    """tokens/s per system, per-request speedups, accepted draft tokens by source (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["systems"])
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    ax1.bar(names, [summary["systems"][n]["tokens_per_second"] for n in names], color="tab:blue")
    ax1.set_title("tokens/s (all measured requests)")
    others = names[1:]
    data = [[r["systems"][n]["speedup"] for r in summary["requests"]] for n in others]
    if others:
        ax2.boxplot(data, tick_labels=others)
    ax2.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax2.set_title("per-request speedup over hf-greedy")
    spec_names = [n for n in names if "accepted_by_source" in summary["systems"][n]]
    bottom = [0.0] * len(spec_names)
    for source in SOURCES:
        values = [summary["systems"][n]["accepted_by_source"].get(source, 0) for n in spec_names]
        ax3.bar(spec_names, values, bottom=bottom, label=source)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax3.set_title("accepted draft tokens by source")
    ax3.legend()
    for ax in (ax1, ax2, ax3):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(_title(summary), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
