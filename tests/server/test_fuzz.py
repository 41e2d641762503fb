"""A thousand generated request bodies against the server: every answer a 2xx or a 4xx.

Hypothesis builds bodies for both generation endpoints: a valid request with fields replaced
by values of any JSON type, fields added or dropped, nested junk, text with control
characters and lone surrogates, and bodies that are not JSON objects at all. The server is
the real app over the session's model (in this process, :mod:`tests.server.inproc`), with a
token limit of two so the bodies that are valid cost a forward or two. A 5xx, or an answer
whose body is not the OpenAI error shape when it is a 4xx, fails. The control: an app whose
validation is bypassed (a field's type error reaching the engine) gives a 5xx that the same
check catches.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.server.inproc import AUTH, MODEL, serving, speculator  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

EXAMPLES = 1000
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=24)
"""Any code points, control characters and lone surrogates included."""
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "seed", "stop", "stream", "tools", "tool_choice", "response_format",
          "logprobs", "top_logprobs", "echo", "n", "user", "stream_options"]


@st.composite
def bodies(draw: Any) -> tuple[str, bytes]:
    """``(path, body bytes)``: a mutated valid request, or something that is not one."""
    path = draw(st.sampled_from(["/chat/completions", "/completions"]))
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "json", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "json":
        return path, json.dumps(draw(JSON)).encode()
    body: dict[str, Any] = dict(CHAT if path == "/chat/completions" else COMPLETION)
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(FIELDS + [draw(TEXT)]))
        if draw(st.booleans()) and field in body:
            del body[field]
        else:
            body[field] = draw(JSON)
    if "max_tokens" in body and isinstance(body["max_tokens"], int) and body["max_tokens"] > 2:
        body["max_tokens"] = 2  # a valid body costs a forward or two, not a long answer
    return path, json.dumps(body).encode()


def check(res: httpx.Response) -> None:
    assert res.status_code < 500, (res.status_code, res.text[:300])
    if res.status_code >= 400:
        error = res.json()["error"]
        assert isinstance(error["message"], str) and error["message"]


@pytest.fixture(scope="module")
def live(spec: Any) -> Any:
    with serving(speculator(spec, memory=False), max_tokens=2) as server:
        yield server


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(case=bodies())
def test_no_generated_body_gets_a_5xx(live: Any, case: tuple[str, bytes]) -> None:
    path, body = case
    res = httpx.post(f"{live.url}{path}", content=body, timeout=60,
                     headers={**AUTH, "Content-Type": "application/json"})
    check(res)


def test_the_check_catches_a_5xx(live: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: a server whose generation raises on a valid body answers 500, and the
    same check fails on it."""
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("a value the validation let through")

    monkeypatch.setattr(live.server.spec, "stream", broken)
    res = httpx.post(f"{live.url}/chat/completions", json=CHAT, headers=AUTH, timeout=60)
    with pytest.raises(AssertionError):
        check(res)
