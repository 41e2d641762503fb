"""The forward widths' probe verdicts kept on disk (:mod:`agentspec.engine.width_cache`).

A second target over another model object of the same computation reads the first one's
verdict and runs no probe forward; a change of a part of the computation (the dtype, the
engine's code, the software's versions) is probed again; a damaged file is probed again
and rewritten; a kept verdict is taken as the probe's own, warnings included. A key that left
out the dtype would hand the fp32 verdict to a bf16 model: the same check fails on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agentspec.engine import probe, width_cache
from agentspec.engine.target import HFTarget
from tests.tiny_model import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    yield tmp_path


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The widths of every probe forward run from here on."""
    seen: list[int] = []
    real = probe._probe

    def counted(forward: Any, ids: list[int], width: int) -> torch.Tensor:
        seen.append(width)
        return real(forward, ids, width)

    monkeypatch.setattr(probe, "_probe", counted)
    return seen


def verdict(target: HFTarget) -> tuple[Any, ...]:
    return target.widths, target.prefill_widths, target.batches


def kept_files(home: Path) -> list[Path]:
    return sorted((home / "costs").glob("widths-*.json"))


def test_a_second_target_reads_the_verdict_and_probes_nothing(home: Path, probes: list[int]) -> None:
    first = tiny_target(0)
    first.check_widths()
    assert probes and len(kept_files(home)) == 1
    probes.clear()
    second = tiny_target(0)  # another model object: the in-process memo does not hold it
    assert second.model is not first.model
    second.check_widths()
    assert probes == [] and verdict(second) == verdict(first)


def probes_after(changed: Callable[[], HFTarget], home: Path, probes: list[int]) -> int:
    """Probe forwards run for the target ``changed`` builds (of an altered computation), after
    a target of the unaltered one kept its verdict."""
    tiny_target(0).check_widths()
    probes.clear()
    changed().check_widths()
    return len(probes)


def _bf16() -> HFTarget:
    model = tiny_target(0).model.to(torch.bfloat16)
    return HFTarget(model, tiny_target(0).tokenizer, name="tiny-0")


@pytest.mark.parametrize("change", ["dtype", "engine code", "torch version"])
def test_a_changed_computation_is_probed_again(change: str, home: Path, probes: list[int],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def changed() -> HFTarget:
        if change == "dtype":
            return _bf16()
        if change == "engine code":
            monkeypatch.setattr(width_cache, "_engine_digest", lambda: "edited")
        else:
            monkeypatch.setattr(width_cache, "_versions",
                                lambda: {"torch": "9.9", "transformers": "", "triton": ""})
        return tiny_target(0)

    assert probes_after(changed, home, probes) > 0
    assert len(kept_files(home)) == 2


def test_a_key_without_the_dtype_hands_a_verdict_across_dtypes(
        home: Path, probes: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The deliberately wrong key: the fp32 verdict is read for the bf16 model, unprobed."""
    real = width_cache.cache_file

    def without_dtype(model: Any, asked: tuple[Any, ...], device: Any) -> Path:
        return real(model, asked[:3] + asked[4:], device)

    monkeypatch.setattr(width_cache, "cache_file", without_dtype)
    assert probes_after(_bf16, home, probes) == 0


def test_a_damaged_file_is_probed_again_and_rewritten(home: Path, probes: list[int]) -> None:
    tiny_target(0).check_widths()
    (path,) = kept_files(home)
    good = json.loads(path.read_text())
    path.write_text('{"version": 1, "widths": [2, 4')
    probes.clear()
    again = tiny_target(0)
    again.check_widths()
    assert probes and json.loads(path.read_text()) == good


def test_a_kept_verdict_is_taken_as_the_probes_own(home: Path, probes: list[int]) -> None:
    """A verdict that drops widths and batching is used, with the probe's warnings; one that
    names widths the target was not asked for is no verdict on it, and is probed again."""
    first = tiny_target(0)
    first.check_widths()
    (path,) = kept_files(home)
    asked = first.widths
    path.write_text(json.dumps({"version": 1, "widths": list(asked[:2]),
                                "prefill_widths": list(first.prefill_widths), "batches": False}))
    probes.clear()
    second = tiny_target(0)
    with pytest.warns(UserWarning) as caught:
        second.check_widths()
    assert probes == [] and second.widths == asked[:2] and second.batches is False
    messages = " ".join(str(w.message) for w in caught)
    assert "compute rows in another order" in messages and "carries one sequence" in messages
    path.write_text(json.dumps({"version": 1, "widths": [*asked, 999],
                                "prefill_widths": [], "batches": True}))
    third = tiny_target(0)
    third.check_widths()
    assert probes and verdict(third) == verdict(first)
