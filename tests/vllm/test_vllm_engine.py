"""agentspec's proposer inside vLLM's CPU build, with the packaged SmolLM2 (``make test-vllm``).

Each engine runs in a process of its own (:func:`agentspec.bench.vllm.run_child`, one
``LLM`` per process, as replicas are), on bfcl-live requests, greedy:

- outputs with the proposer token-identical to vLLM without speculation, at one stream and
  at several, and draft tokens accepted;
- two engine processes sharing one PostgreSQL memory: the second's first pass over the
  first's requests drafts from what the first recorded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agentspec.bench.vllm import run_child, workload_items
from agentspec.engine.load import resolve_model

pytestmark = pytest.mark.vllm

WARMUP, MEASURE, MAX_NEW = 8, 6, 64


@pytest.fixture(scope="module")
def model() -> str:
    return resolve_model("smollm2-135m-instruct")[1]


@pytest.fixture(scope="module")
def items() -> tuple[list[Any], list[Any]]:
    warm, meas = workload_items("bfcl-live", None, MAX_NEW)
    return warm[:WARMUP], meas[:MEASURE]


def engine(method: str, model: str, warm: list[Any], meas: list[Any], streams: list[int],
           db: str | None, stats: Path | None, log: Path) -> dict[str, Any]:
    return run_child({"method": method, "model": model, "k": 8, "streams": streams,
                      "warmup": warm, "measure": meas, "db": db,
                      "stats_path": None if stats is None else str(stats),
                      "max_model_len": 2048}, timeout=1800, log=log)


def summary(result: dict[str, Any]) -> str:
    """One line per pass (shown by ``pytest -rP``): the figures the assertions read."""
    rows = []
    for p in result["passes"]:
        stats = p.get("proposer") or {}
        rows.append(json.dumps({
            "method": result["method"], "streams": p["streams"], "generated": p["generated"],
            "accepted": p["accepted"], "tokens_per_step": round(1 + p["accepted_per_step"], 3),
            "tokens_per_second": round(p["tokens_per_second"], 1),
            "accepted_by_source": stats.get("accepted"),
            "host_ms_per_step": round(1000 * stats["host_seconds"] / stats["steps"], 3)
            if stats.get("steps") else None}))
    return "\n".join(rows)


def test_greedy_outputs_identical_and_drafts_accepted(model, items, tmp_path):
    warm, meas = items
    plain = engine("plain", model, [], meas, [1, 3], None, None, tmp_path / "plain.log")
    ours = engine("agentspec", model, warm, meas, [1, 3], f"sqlite:///{tmp_path}/m.db",
                  tmp_path / "stats.json", tmp_path / "agentspec.log")
    print(summary(plain), summary(ours), sep="\n")
    for mine, ref in zip(ours["passes"], plain["passes"], strict=True):
        assert mine["streams"] == ref["streams"]
        assert mine["outputs"] == ref["outputs"], f"outputs differ at {mine['streams']} streams"
        assert mine["accepted"] > 0
    stats = ours["passes"][-1]["proposer"]
    assert stats and stats["recorded"] >= len(warm) and stats["steps"] > 0


def test_two_replicas_share_a_postgres_memory(model, items, tmp_path):
    url = os.environ.get("AGENTSPEC_TEST_PG_URL")
    if not url:
        pytest.skip("needs AGENTSPEC_TEST_PG_URL (make test-vllm starts a private cluster)")
    from sqlalchemy import create_engine

    schema = f"t_vllm_{os.getpid()}"
    admin = create_engine(url)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    db = f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"
    _, meas = items
    try:
        # Replica A: its requests twice (the second pass is a warm single replica).
        a = engine("agentspec", model, [], meas, [1, 1], db, tmp_path / "a.json",
                   tmp_path / "a.log")
        # Replica B, another process: its first pass over A's requests.
        b = engine("agentspec", model, [], meas, [1], db, tmp_path / "b.json",
                   tmp_path / "b.log")
        print(summary(a), summary(b), sep="\n")
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()
    assert b["passes"][0]["outputs"] == a["passes"][0]["outputs"]
    accepted_b = b["passes"][0]["proposer"]["accepted"]
    assert accepted_b.get("memory", 0) > 0, accepted_b
    warm_a = 1 + a["passes"][1]["accepted_per_step"]
    first_b = 1 + b["passes"][0]["accepted_per_step"]
    assert abs(first_b - warm_a) <= 0.1 * warm_a, (first_b, warm_a)
