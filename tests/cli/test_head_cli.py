"""``agentspec head train`` and ``agentspec head stats`` on a tiny random model folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agentspec.stores import SQLStore
from agentspec.types import Record
from tests.cli.conftest import EMBEDDER, make_invoke

WORDS = [f"w{i}" for i in range(20)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w19").save_pretrained(str(out))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(str(out))
    return out


def _fill(url: str, fingerprint: str) -> None:
    keys = [f"w1 w{2 + i} w3" for i in range(12)]
    vectors = EMBEDDER.embed(keys)
    with SQLStore(url) as store:
        store.add_many([Record(scope="tools", model=fingerprint, request_text=keys[i],
                               key_text=keys[i], completion_text="",
                               completion_ids=tuple(([4, 5, 6, 7] * 4)[i % 4 :][: 3 + i // 4]),
                               embedding=vectors[i],
                               embedder=EMBEDDER.name) for i in range(12)])


def test_train_then_stats(model_dir: Path, tmp_path: Path, home: Path):
    from agentspec.drafters.head import heads_exist
    from agentspec.engine.load import load_target

    fingerprint = load_target(str(model_dir), device="cpu").fingerprint
    url = f"sqlite:///{tmp_path / 'memory.db'}"
    _fill(url, fingerprint)
    cli = make_invoke(url)
    assert not heads_exist(fingerprint)
    empty = cli("head", "stats")
    assert empty.exit_code == 0 and "no trained heads" in empty.stdout
    res = cli("head", "train", "--model", str(model_dir), "--epochs", "2", "--depth", "3", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    (head,) = out["heads"]
    assert head["scope"] == "tools" and head["records"] == 12 and head["held_out_records"] == 1
    assert len(head["held_out_acceptance"]["rate"]) == 3
    acc = head["held_out_acceptance"]
    assert acc["width"] == 4 and acc["mean_accepted"] <= acc["tree_accepted"] <= 3
    assert Path(head["path"]).is_file() and heads_exist(fingerprint)
    stats = json.loads(cli("head", "stats", "--json").stdout)["heads"]
    assert [s["scope"] for s in stats] == ["tools"] and stats[0]["fingerprint"] == fingerprint
    assert stats[0]["stats"]["vocab"] == 5 and not stats[0]["warm_start"]
    # Retraining starts from the saved head.
    again = cli("head", "train", "--model", str(model_dir), "--epochs", "1", "--scope", "tools")
    assert again.exit_code == 0, again.output
    assert json.loads(cli("head", "stats", "--json").stdout)["heads"][0]["warm_start"]
    replays = Path(head["path"]).with_name("tools.replay.pt")  # kept: retraining replays only new rows
    assert replays.is_file()
    table = cli("head", "stats")
    assert table.exit_code == 0 and "tools" in table.stdout


def test_train_refuses_a_scope_without_completions(model_dir: Path, tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'memory.db'}"
    SQLStore(url).close()
    res = make_invoke(url)("head", "train", "--model", str(model_dir), "--scope", "nope")
    assert res.exit_code == 1
    assert "no completions" in res.output
