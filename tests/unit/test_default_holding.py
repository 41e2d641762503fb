"""Which way a GGUF's weights load when no dtype is named on the CPU
(``quant.model.default_as_stored``): as stored where the native kernels have vectors; without
vectors (their portable loops run many times slower than the float32 modules, BENCHMARKS.md)
the float32 model, unless its copy would not fit in half the memory available. The seams
replaced here are the build's lanes and the memory the kernel reports: the file is the
packaged one."""

from __future__ import annotations

import pytest

from agentspec.engine.load import gguf_file
from agentspec.engine.quant import model, native


@pytest.fixture
def packaged():
    return gguf_file("smollm2-135m-instruct")


def test_with_vectors_the_file_loads_as_stored(packaged):
    assert native.lanes() in (8, 16)  # this machine's build: AVX-512 or AVX2
    assert model.default_as_stored(packaged)


def test_without_vectors_it_loads_dequantised_where_that_fits(packaged, monkeypatch):
    monkeypatch.setattr(native, "lanes", lambda: 0)
    monkeypatch.setattr(model, "_available_memory", lambda: 64 * 2**30)
    with pytest.warns(UserWarning, match="loads dequantised to float32"):
        assert not model.default_as_stored(packaged)


def test_without_vectors_a_copy_that_does_not_fit_loads_as_stored(packaged, monkeypatch):
    monkeypatch.setattr(native, "lanes", lambda: 0)
    monkeypatch.setattr(model, "_available_memory", lambda: 512 * 2**20)  # 135M floats: 540 MB
    with pytest.warns(UserWarning, match="they load as stored"):
        assert model.default_as_stored(packaged)


def test_a_file_that_cannot_load_as_stored_never_does(packaged, monkeypatch):
    monkeypatch.setattr(model, "loads_as_stored", lambda path: False)
    assert not model.default_as_stored(packaged)
