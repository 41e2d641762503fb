"""The server's page (``GET /``) in a real headless Chromium, over the real model.

Three requests of one tenant (the second repeats the first, so it drafts from the first's
record), then the page, opened with that tenant's key: the DOM's coloured runs must add up,
per origin, to each answer's own stats (``accepted_by_source`` for the draft sources, one
token of the model's own per step), and each colour's tokens to the same counts; their text
must be the answer's; the charts and the memory table must be drawn. A key of another scope
sees none of it. The same comparison, fed runs one token off, fails (its power). A screenshot
is saved under the test's tmp_path.

Skips, saying why, where selenium, Chromium or its driver is not installed (``.ci/run``
installs Debian's ``chromium`` and ``chromium-driver``).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.inproc import Live, chat, serving, speculator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
KEYS = {"key-a": ("tenant-a",), "key-b": ("tenant-b",)}
PROMPTS = ["Name three colours of the rainbow.", "Name three colours of the rainbow.",
           "Count from one to ten in words."]
TOKENS = 20


def _browser_or_skip() -> Any:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed: pip install -e '.[dev]'")
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                  "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no headless browser: apt-get install chromium chromium-driver "
                    f"(found chromium={binary}, chromedriver={driver})")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1400", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(driver))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = _browser_or_skip()
    try:
        yield driver
    finally:
        driver.quit()


def open_page(browser: Any, live: Live, key: str, requests: int) -> dict[str, Any]:
    """Open the page with ``key`` in its fragment, wait for a poll that shows ``requests``
    requests, and read the DOM at once: per request its runs and legend; the charts, the
    memory table, the shown scopes."""
    browser.get("about:blank")  # a new document: the fragment is read again
    browser.get(f"{live.root}/#key={key}")
    deadline = time.monotonic() + 30
    while True:
        seen = browser.execute_script(READ_DOM)
        if seen["polls"] >= 1 and len(seen["requests"]) == requests:
            return seen  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"the page did not show {requests} requests: {seen}"
        time.sleep(0.2)


READ_DOM = """
const rgb = c => { const d = document.createElement('div'); d.style.background = c;
  document.body.appendChild(d); const v = getComputedStyle(d).backgroundColor; d.remove(); return v; };
return {
  polls: Number(document.body.dataset.polls || 0),
  fragment: location.hash,
  scopes: document.getElementById('scopes').textContent,
  tints: Object.fromEntries(Object.entries(TINTS).map(([k, v]) => [k, rgb(v)])),
  acceptance: [...document.querySelectorAll('#chart-acceptance polyline')].map(p => p.dataset.source),
  bars: [...document.querySelectorAll('#chart-tokens rect')].map(r => r.dataset.source),
  memory: [...document.querySelectorAll('#memory tbody tr')].map(
    tr => [...tr.children].map(td => td.textContent)),
  requests: [...document.querySelectorAll('#requests .request')].map(r => ({
    id: r.dataset.id, scope: r.dataset.scope,
    runs: [...r.querySelectorAll('.answer .step .tok')].map(t => ({
      source: t.dataset.source, tokens: Number(t.dataset.tokens), text: t.textContent,
      step: Number(t.parentElement.dataset.step),
      color: getComputedStyle(t).backgroundColor})),
    steps: [...r.querySelectorAll('.answer .step')].map(s => [s.className, getComputedStyle(s).borderBottomColor]),
    legend: Object.fromEntries([...r.querySelectorAll('.legend .key')].map(
      k => [k.dataset.source, Number(k.dataset.count)])),
  })),
};
"""


def mismatches(shown: dict[str, Any], answer: dict[str, Any], tints: dict[str, str]) -> list[str]:
    """Where one request as the page shows it disagrees with its answer."""
    stats, text = answer["agentspec"]["stats"], answer["choices"][0]["message"]["content"]
    expected = {**stats["accepted_by_source"], "target": stats["steps"]}
    expected = {k: v for k, v in expected.items() if v}
    runs, out = shown["runs"], []
    counts: dict[str, int] = {}
    by_colour: dict[str, int] = {}
    for run in runs:
        counts[run["source"]] = counts.get(run["source"], 0) + run["tokens"]
        by_colour[run["color"]] = by_colour.get(run["color"], 0) + run["tokens"]
    if counts != expected:
        out.append(f"runs count {counts}, the stats say {expected}")
    if shown["legend"] != expected:
        out.append(f"the legend says {shown['legend']}, the stats {expected}")
    colours = {tints[k]: v for k, v in expected.items()}
    if by_colour != colours:
        out.append(f"tokens by colour {by_colour}, the stats' sources' colours {colours}")
    if len({r["step"] for r in runs}) != stats["steps"] or len(shown["steps"]) != stats["steps"]:
        out.append(f"{len(shown['steps'])} steps shown, {stats['steps']} taken")
    if "".join(r["text"] for r in runs) != text:
        out.append("the runs' text is not the answer's")
    return out


@pytest.fixture(scope="module")
def served(spec: Any, one_thread: None) -> Iterator[tuple[Live, list[dict[str, Any]]]]:
    """A server (keys: :data:`KEYS`) and tenant-a's three answers."""
    with serving(speculator(spec), max_tokens=TOKENS, key_scopes=KEYS) as live:
        answers = []
        for text in PROMPTS:
            res = chat(live, text, max_tokens=TOKENS, headers={"Authorization": "Bearer key-a"})
            assert res.status_code == 200, res.text
            answers.append(res.json())
        # Each answer ran to its length: no stop cut an accepted draft token off its text.
        assert [a["choices"][0]["finish_reason"] for a in answers] == ["length"] * 3
        assert answers[1]["agentspec"]["stats"]["accepted_by_source"].get("memory", 0) > 0
        yield live, answers


def _data(live: Live, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{live.root}/v1/agentspec/dashboard", timeout=30, headers=headers)


def test_the_data_follows_the_answers_and_the_keys(served) -> None:
    """Without a browser: each answer's runs add up to its stats and its text; a key sees
    its own scopes only; no key, no data; the page is served whole."""
    live, answers = served
    mine = _data(live, "key-a").json()
    assert mine["scopes"] == ["tenant-a"] and mine["queue"] == {"running": 0, "waiting": 0}
    by_id = {r["id"]: r for r in mine["requests"]}
    for answer in answers:
        shown = by_id[answer["id"]]
        counts: dict[str, int] = {}
        for piece in shown["pieces"]:
            counts[piece["source"]] = counts.get(piece["source"], 0) + piece["tokens"]
        runs = [dict(p, color=p["source"]) for p in shown["pieces"]]
        steps = [["step", str(i % 2)] for i in range(len({p["step"] for p in runs}))]
        view = {"runs": runs, "legend": counts, "steps": steps}
        assert mismatches(view, answer, {s: s for s in counts}) == []
    assert [m["scope"] for m in mine["memory"]] == ["tenant-a"]
    assert mine["memory"][0]["rows"] == 2 and mine["series"]
    theirs = _data(live, "key-b").json()
    assert theirs["requests"] == [] and theirs["scopes"] == ["tenant-b"]
    assert all(m["scope"] != "tenant-a" for m in theirs["memory"])
    master = _data(live, "inproc-key").json()  # a key without scopes: every scope
    assert master["scopes"] is None and len(master["requests"]) == 3
    assert _data(live, None).status_code == 401 and _data(live, "nope").status_code == 401
    page = httpx.get(f"{live.root}/", timeout=30)
    assert page.status_code == 200 and "<svg id=\"chart-acceptance\"" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for fetches in ("src=", "href=", "<link", "@import", "url("):  # nothing from elsewhere
        assert fetches not in page.text


def test_the_page_colours_each_token_by_its_origin(served, browser: Any, tmp_path) -> None:
    live, answers = served
    seen = open_page(browser, live, "key-a", 3)
    browser.save_screenshot(str(tmp_path / "dashboard.png"))
    other = open_page(browser, live, "key-b", 0)
    assert seen["fragment"] == ""  # the key left the address bar
    assert seen["scopes"] == "scopes: tenant-a"
    by_id = {r["id"]: r for r in seen["requests"]}
    for answer in answers:
        shown = by_id[answer["id"]]
        assert shown["scope"] == "tenant-a"
        assert mismatches(shown, answer, seen["tints"]) == []
        parities = {cls: colour for cls, colour in shown["steps"]}
        assert len(set(parities.values())) == 2 or len(shown["steps"]) == 1  # steps alternate
    assert "memory" in seen["acceptance"] and seen["bars"]  # the charts are drawn
    memory = {row[0]: row[1:] for row in seen["memory"]}
    assert list(memory) == ["tenant-a"] and memory["tenant-a"][0] == "2"  # rows: two answers
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Another tenant's key sees neither the requests nor the memory of tenant-a.
    assert other["requests"] == [] and other["scopes"] == "scopes: tenant-b"
    assert all(row[0] != "tenant-a" for row in other["memory"])


def test_the_comparison_sees_a_run_one_token_off() -> None:
    """``mismatches`` has the power to see a page that books one token to the wrong origin."""
    tints = {"memory": "green", "target": "clear"}
    answer = {"agentspec": {"stats": {"accepted_by_source": {"memory": 3}, "steps": 2}},
              "choices": [{"message": {"content": "abcde"}}]}
    runs = [{"source": "memory", "tokens": 3, "text": "abc", "step": 0, "color": "green"},
            {"source": "target", "tokens": 1, "text": "d", "step": 0, "color": "clear"},
            {"source": "target", "tokens": 1, "text": "e", "step": 1, "color": "clear"}]
    right = {"runs": runs, "legend": {"memory": 3, "target": 2},
             "steps": [["step", "a"], ["step odd", "b"]]}
    assert mismatches(right, answer, tints) == []
    off = [dict(runs[0], tokens=2), dict(runs[1], tokens=2), runs[2]]
    assert mismatches({**right, "runs": off}, answer, tints)
    recoloured = [runs[0], dict(runs[1], color="green"), runs[2]]
    assert mismatches({**right, "runs": recoloured}, answer, tints)
