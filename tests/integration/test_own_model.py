"""A model of the user's own: a hub id through transformers' download and cache (offline here:
a real hub cache built from the packaged model's converted folder), a folder of an unsupported
architecture, and ``device``/``dtype``/``memory`` on both ``from_pretrained``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentspec import Speculator, UnsupportedModelError
from agentspec.engine import compat
from agentspec.engine.load import load_target, resolve_model_dir
from agentspec.engine.quant.model import weights_mode

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: huggingface_hub and transformers read HF_HUB_OFFLINE and the
# cache's place when they are imported.
_HUB_SCRIPT = """
import json, sys
from agentspec import ModelNotAvailableError, Speculator
out = {}
hub = Speculator.from_pretrained("agentspec-test/smollm2-135m-instruct", memory=None,
                                speculate=False)
packaged = Speculator.from_pretrained("smollm2-135m-instruct", memory=None, speculate=False,
                                     dtype="float32")
held = Speculator.from_pretrained("smollm2-135m-instruct", memory=None, speculate=False)
prompt = [{"role": "user", "content": "Name three colours."}]
out["hub"] = list(hub.generate(prompt, 12).token_ids)
out["packaged"] = list(packaged.generate(prompt, 12).token_ids)
out["fingerprints"] = [hub.target.fingerprint, packaged.target.fingerprint,
                       held.target.fingerprint]
try:
    Speculator.from_pretrained("agentspec-test/not-cached", memory=None)
except ModelNotAvailableError as exc:
    out["error"] = str(exc)
json.dump(out, sys.stdout)
"""


def _hub_cache(root: Path, repo_id: str, folder: Path) -> None:
    """``folder``'s files as one revision of ``repo_id`` in a hub cache at ``root``
    (huggingface_hub's layout: ``models--org--name/{refs/main, snapshots/<rev>/...}``)."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        if file.name != "agentspec-converted.json":
            (snapshot / file.name).symlink_to(file.resolve())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


@pytest.mark.slow
def test_hub_id_loads_from_the_hub_cache_offline(tmp_path: Path) -> None:
    _, folder = resolve_model_dir("smollm2-135m-instruct")  # converted once, as the package is
    _hub_cache(tmp_path / "hub", "agentspec-test/smollm2-135m-instruct", folder)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _HUB_SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["hub"] == out["packaged"] and len(out["hub"]) > 0
    # the same model by the repository's name, and on the file's own weights (the CPU's
    # default for the packaged model): one fingerprint, one memory
    assert out["fingerprints"][0] == out["fingerprints"][1] == out["fingerprints"][2]
    error = out["error"]
    assert "'agentspec-test/not-cached'" in error and "HF_HUB_OFFLINE is set" in error
    assert str(tmp_path / "hub") in error


def test_unsupported_architecture_is_named(tmp_path: Path, monkeypatch) -> None:
    """Refused from its config, before any weights are read (the folder holds none)."""
    monkeypatch.delenv("AGENTSPEC_ALLOW_UNTESTED", raising=False)
    folder = tmp_path / "my-gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2}))
    loads = ", ".join(sorted(compat.ARCHITECTURES))
    with pytest.raises(UnsupportedModelError, match=r"model type 'gpt2' \(GPT2LMHeadModel\) is "
                       rf"not supported; agentspec loads {loads} "):
        load_target(str(folder), device="cpu")


def test_bad_dtype_and_device_fail_before_loading() -> None:
    with pytest.raises(ValueError, match="dtype must be.*got 'bfloat'"):
        Speculator.from_pretrained("no-such-model", dtype="bfloat")
    with pytest.raises(ValueError, match="device must be a torch device.*got 'gpu'"):
        Speculator.from_pretrained("no-such-model", device="gpu")


@pytest.mark.slow
def test_device_dtype_and_memory_on_both_from_pretrained(tmp_path: Path) -> None:
    spec = Speculator.from_pretrained("smollm2-135m-instruct", memory=None, device="cpu",
                                      dtype="bfloat16")
    param = next(spec.target.model.parameters())
    # bfloat16 on the CPU: SmolLM2's weights held in bfloat16 tables for the native forward
    assert weights_mode(spec.target.model) == "bfloat16" and spec.target.forward.native
    assert param.device.type == "cpu" and spec.memory is None

    pytest.importorskip("langchain_core")
    from agentspec.adapters.langchain import ChatAgentSpec

    url = f"sqlite:///{tmp_path / 'chat.db'}"
    chat = ChatAgentSpec.from_pretrained("smollm2-135m-instruct", device=torch.device("cpu"),
                                         dtype=torch.float32, memory=url, max_tokens=6)
    spec = chat.speculator
    assert next(spec.target.model.parameters()).dtype == torch.float32
    assert spec.memory is not None and (tmp_path / "chat.db").exists()
    assert chat.max_tokens == 6
    bare = ChatAgentSpec.from_pretrained("smollm2-135m-instruct", memory=None, dtype="float32")
    assert bare.speculator.memory is None
