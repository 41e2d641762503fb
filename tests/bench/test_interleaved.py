"""The interleaved-streams bench's loop: one delta of each stream in turn until all end."""

from __future__ import annotations

import pytest

from agentspec.bench import interleaved


class _FakeSpec:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def stream(self, prompt: str, max_new_tokens: int):
        for i in range(max_new_tokens):
            self.log.append(prompt)
            yield f"{prompt}{i} "


def test_streams_take_turns_and_each_keeps_its_own_text() -> None:
    log: list[str] = []
    texts = interleaved.interleave(_FakeSpec(log), [{"prompt": "a", "max_new_tokens": 3},
                                                    {"prompt": "b", "max_new_tokens": 1}])
    assert texts == ["a0 a1 a2 ", "b0 "]
    assert log == ["a", "b", "a", "a"]


@pytest.mark.parametrize("flag", ["--streams", "--rounds", "--max-new-tokens"])
def test_a_count_below_one_is_refused_by_name(flag: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        interleaved.main([flag, "0"])
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
