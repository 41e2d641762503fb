"""The glibc malloc settings a CPU target applies (agentspec.engine.malloc), on a fake libc."""

from __future__ import annotations

import ctypes
import os

import pytest

from agentspec.engine import malloc as _malloc


class FakeMallopt:
    """glibc's ``mallopt`` as ctypes gives it (argtypes and restype are set on it)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = 1

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


class FakeLibc:
    def __init__(self) -> None:
        self.mallopt = FakeMallopt()

    @property
    def calls(self) -> list[tuple[int, int]]:
        return self.mallopt.calls

    @property
    def answer(self) -> int:
        return self.mallopt.answer

    @answer.setter
    def answer(self, value: int) -> None:
        self.mallopt.answer = value


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> FakeLibc:
    fake = FakeLibc()
    for name in [n for n in os.environ if n.startswith("MALLOC_") or n == _malloc.ENV]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(ctypes, "CDLL", lambda path: fake)
    monkeypatch.setattr(_malloc.platform, "system", lambda: "Linux")
    monkeypatch.setattr(_malloc.platform, "libc_ver", lambda: ("glibc", "2.41"))
    return fake


def test_sets_the_mmap_threshold_first_then_the_trim_threshold(libc: FakeLibc):
    assert _malloc._apply() == "tuned"
    # the trim threshold alone would freeze the mmap threshold at 128 KiB (every large
    # temporary mapped anew): the order matters
    assert libc.calls == [(_malloc.M_MMAP_THRESHOLD, 32 * 2**20),
                          (_malloc.M_TRIM_THRESHOLD, 512 * 2**20)]


def test_the_users_choice_wins(libc: FakeLibc, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(_malloc.ENV, "default")
    assert _malloc._apply().startswith("off") and not libc.calls
    monkeypatch.delenv(_malloc.ENV)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert _malloc._apply() == "off (MALLOC_ variables set)" and not libc.calls


def test_a_bad_value_is_named(libc: FakeLibc, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(_malloc.ENV, "fast")
    with pytest.raises(ValueError, match="'fast'"):
        _malloc._apply()


def test_off_glibc_or_refused_nothing_is_claimed(libc: FakeLibc, monkeypatch: pytest.MonkeyPatch):
    libc.answer = 0
    assert _malloc._apply() == "off (mallopt refused)"
    monkeypatch.setattr(_malloc.platform, "libc_ver", lambda: ("", ""))
    assert _malloc._apply() == "off (not glibc)"


def test_a_cpu_target_applies_them_once():
    from tests.tiny_model import tiny_target

    tiny_target().fork()
    assert _malloc.tune.cache_info().misses == 1  # applied by the first target, once
    assert _malloc.state() == _malloc.tune()  # what the bench reports
