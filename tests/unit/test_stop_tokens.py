"""A stop string keeps the same tokens however the steps split them: the kept count is the
first token that completes the stop, as one token a step finds it, so a multi-token step
(an accepted draft) does not change a generation's token ids."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from agentspec.text import StopStrings, TextDeltas


class _Chars:
    """One token per character."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _run(text: str, stops: list[str], split: list[int]) -> tuple[str, int]:
    deltas, ids, pos = TextDeltas(_Chars(), StopStrings(stops)), [ord(c) for c in text], 0
    for size in split:
        _, hit = deltas.push(ids[pos:pos + size])
        pos += size
        if hit:
            break
    return deltas.text, deltas.kept_tokens


@pytest.mark.parametrize("split", [[1] * 20, [3, 9, 8], [20], [2, 18], [11, 9]])
def test_kept_tokens_do_not_depend_on_the_steps(split: list[int]) -> None:
    text = "Red, green. Blue!xyz"
    assert _run(text, [". B"], split) == ("Red, green", 13)
    assert _run(text, ["!", "een"], split) == ("Red, gr", 10)


def test_the_old_count_would_fail() -> None:
    """Counting every token of the step that hit the stop (the old way) differs from the
    token-a-step count on a multi-token step."""
    deltas = TextDeltas(_Chars(), StopStrings([". B"]))
    deltas.push([ord(c) for c in "Red, green. Blue!xyz"])
    assert deltas.kept_tokens == 13 != len(deltas.tokens)
