"""``GET /metrics``: what it counts equals what the answers said (tokens, steps, drafts and
acceptances by source, requests by status), the memory's rows and lookups, scope labels only
when asked, its key, and one registry per server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from agentspec.adapters.lifecycle import ServiceConfig
from agentspec.adapters.metrics import ServerMetrics
from agentspec.types import Generation, GenerationStats
from tests.server.inproc import (
    AUTH,
    MODEL,
    chat,
    scrape,
    serving,
    speculator,
    stream_events,
    total,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
CHAT = "/v1/chat/completions"
PROMPTS = ["List three colours of the rainbow.", "Count from one to five in words.",
           "Name the days of the week."]


def _stats(answer: dict[str, Any]) -> dict[str, Any]:
    stats: dict[str, Any] = answer["agentspec"]["stats"]
    return stats


def expected(answers: list[dict[str, Any]]) -> dict[str, float]:
    """What the metrics must say after ``answers`` (each answer's ``agentspec.stats``)."""
    out: dict[str, float] = {}
    for stats in map(_stats, answers):
        for name, key in (("prompt", "prompt_tokens"), ("generation", "new_tokens"),
                          ("steps", "steps")):
            out[name] = out.get(name, 0) + stats[key]
        for kind in ("drafted", "accepted"):
            for source, n in stats[f"{kind}_by_source"].items():
                out[f"{kind}:{source}"] = out.get(f"{kind}:{source}", 0) + n
    return out


def measured(samples: dict[Any, float], sources: set[str]) -> dict[str, float]:
    """The same figures read from a scrape."""
    out = {"prompt": total(samples, "agentspec_prompt_tokens_total"),
           "generation": total(samples, "agentspec_generation_tokens_total"),
           "steps": total(samples, "agentspec_target_steps_total")}
    for kind in ("drafted", "accepted"):
        for source in sources:
            n = total(samples, f"agentspec_{kind}_tokens_total", source=source)
            if n:
                out[f"{kind}:{source}"] = n
    return out


def _sources(answers: list[dict[str, Any]]) -> set[str]:
    return {s for st in map(_stats, answers) for k in ("drafted", "accepted")
            for s in st[f"{k}_by_source"]}


def test_metrics_equal_the_sums_of_the_answers(spec: Any) -> None:
    fast = speculator(spec)
    answers: list[dict[str, Any]] = []
    with serving(fast, max_tokens=16) as live:
        for i, text in enumerate(PROMPTS * 2):  # the second round drafts from the memory
            if i % 2:
                events = stream_events(live, text, max_tokens=12)
                answers.append(next(e for e in events if isinstance(e, dict) and "agentspec" in e))
            else:
                res = chat(live, text, max_tokens=12)
                assert res.status_code == 200, res.text
                answers.append(res.json())
        refused = httpx.post(f"{live.url}/chat/completions", json={"model": MODEL}, timeout=30)
        bad = chat(live, "hi", max_tokens=999)
        assert (refused.status_code, bad.status_code) == (401, 400)
        assert httpx.get(f"{live.url}/models", headers=AUTH).status_code == 200
        assert httpx.get(f"{live.url}/no-such-thing", headers=AUTH).status_code == 404
        unkeyed = httpx.get(f"{live.root}/metrics", timeout=30)
        assert unkeyed.status_code == 401 and unkeyed.json()["error"]["code"] == "invalid_api_key"
        samples = scrape(live)
    sources = _sources(answers)
    assert "memory" in sources and sum(_stats(a)["accepted_by_source"].get("memory", 0)
                                       for a in answers) > 0  # the memory drafted, and won
    assert measured(samples, sources) == expected(answers)
    assert total(samples, "agentspec_requests_total", endpoint=CHAT, status="200") == 6
    assert total(samples, "agentspec_requests_total", endpoint=CHAT, status="401") == 1
    assert total(samples, "agentspec_requests_total", endpoint=CHAT, status="400") == 1
    assert total(samples, "agentspec_requests_total", endpoint="/v1/models", status="200") == 1
    assert total(samples, "agentspec_requests_total", endpoint="other", status="404") == 1
    assert total(samples, "agentspec_requests_total") == 10  # the probes are not counted
    assert total(samples, "agentspec_time_to_first_token_seconds_count") == 6
    assert total(samples, "agentspec_request_duration_seconds_count") == 8  # every admitted POST
    tokens = [_stats(a)["new_tokens"] for a in answers]
    assert total(samples, "agentspec_time_per_output_token_seconds_count") == \
        sum(n > 1 for n in tokens)
    assert total(samples, "agentspec_requests_running") == 0
    assert total(samples, "agentspec_requests_waiting") == 0
    # The memory: a row per distinct completion, one lookup per generation, the repeats hit.
    assert total(samples, "agentspec_memory_rows") == len(fast.memory.store) == 3
    assert total(samples, "agentspec_memory_lookups_total") == 6
    drafted_from_memory = sum(_stats(a)["drafted_by_source"].get("memory", 0) > 0
                              for a in answers)
    assert drafted_from_memory <= total(samples, "agentspec_memory_hits_total") <= 5
    assert total(samples, "agentspec_memory_up") == 1
    assert not any(dict(labels).get("scope") for _, labels in samples)  # no scope labels


def test_scope_labels_public_metrics_and_one_registry_per_server(spec: Any) -> None:
    """Two servers in one process (each its own registry, or the second could not even
    register its metrics): one labels by scope and serves /metrics without a key, the other
    neither."""
    fast = speculator(spec)
    with serving(fast, ServiceConfig(metrics_scopes=True, metrics_public=True)) as labelled, \
            serving(speculator(spec, memory=False)) as plain:
        for scope in ("team-a", "team-b", "team-a"):
            res = chat(labelled, "Say hello.", max_tokens=4, headers={"X-Agentspec-Scope": scope})
            assert res.status_code == 200, res.text
        assert chat(plain, "Say hello.", max_tokens=4).status_code == 200
        samples = scrape(labelled, key=False)
        assert httpx.get(f"{plain.root}/metrics", timeout=30).status_code == 401
        others = scrape(plain)
    ok = {"endpoint": CHAT, "status": "200"}
    assert total(samples, "agentspec_requests_total", scope="team-a", **ok) == 2
    assert total(samples, "agentspec_requests_total", scope="team-b", **ok) == 1
    assert total(samples, "agentspec_generation_tokens_total", scope="team-b") > 0
    assert total(samples, "agentspec_memory_rows", scope="team-a") == 1
    assert total(samples, "agentspec_memory_rows", scope="team-b") == 1
    assert total(others, "agentspec_requests_total", **ok) == 1  # its own count only
    assert ("agentspec_memory_rows", ()) not in others  # no memory, no memory metrics


def _generation(drafted: dict[str, int], accepted: dict[str, int]) -> Generation:
    stats = GenerationStats(steps=3, new_tokens=5, prompt_tokens=7, seconds=0.5,
                            drafted=drafted, accepted=accepted, first_token_seconds=0.1)
    return Generation("abcde", (1, 2, 3, 4, 5), stats, "length")


class _AcceptedAsDrafted(ServerMetrics):
    """Wrong on purpose: counts every drafted token as accepted."""

    def generation(self, gen: Generation, scope: str | None, *, waited: float) -> None:
        stats = gen.stats
        wrong = GenerationStats(steps=stats.steps, new_tokens=stats.new_tokens,
                                prompt_tokens=stats.prompt_tokens, seconds=stats.seconds,
                                drafted=stats.drafted, accepted=stats.drafted,
                                first_token_seconds=stats.first_token_seconds)
        super().generation(Generation(gen.text, gen.token_ids, wrong, gen.finish_reason),
                           scope, waited=waited)


@pytest.mark.parametrize("metrics_class", [ServerMetrics, _AcceptedAsDrafted])
def test_the_comparison_catches_metrics_that_count_wrong(metrics_class: type) -> None:
    """The check of the first test, on generations fed directly: the right metrics pass it,
    metrics that take drafted tokens for accepted ones fail it."""
    from prometheus_client.parser import text_string_to_metric_families

    gens = [_generation({"memory": 6, "prompt_lookup": 2}, {"memory": 4}),
            _generation({"suffix": 3}, {"suffix": 1})]
    metrics = metrics_class()
    for gen in gens:
        metrics.generation(gen, "s", waited=0.0)
    text = metrics.render()[0].decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    answers = [{"agentspec": {"stats": g.stats.as_dict()}} for g in gens]
    same = measured(samples, _sources(answers)) == expected(answers)
    assert same is (metrics_class is ServerMetrics)
