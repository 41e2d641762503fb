"""Hidden rows kept at generation time for head training (``SpecConfig(head_rows=True)``):
they are the target's own rows of the recorded completion, and a replay built from them
equals a forward replay's (shifted by one start), so training needs no forward for them."""

from __future__ import annotations

import torch

from agentspec import SpecConfig, Speculator
from agentspec.drafters.head_rows import load_rows, rows_dir, rows_key, save_rows
from agentspec.drafters.head_train import from_rows, replay, vocabulary
from agentspec.drafters.policy import CostModel
from agentspec.engine.target import HFTarget
from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores import InMemoryStore
from tests.tiny_model import DecodingTokenizer, tiny_target


def _speculator(target: HFTarget, **config) -> Speculator:  # noqa: ANN003
    memory = CompletionMemory(InMemoryStore(), embedder=HashEmbedder())
    return Speculator(target, memory=memory, config=SpecConfig(**config),
                      cost=CostModel(base=0.05, per_token=0.001))


def _forward_rows(target: HFTarget, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()  # [len(ids), hidden]: the final (normed) rows


def test_kept_rows_are_the_targets_rows_and_replace_a_forward_replay(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    base = tiny_target(3)
    target = HFTarget(base.model, DecodingTokenizer(), name="tiny-rows")
    spec = _speculator(target, head_rows=True)
    for prompt in ["1 2 3 4 5 6", "1 2 3 4 5 7 8"]:
        spec.generate(prompt, 12, scope="s")
    # again: the memory drafts the whole completion, so the rows kept now (the same file) are
    # those of accepted draft nodes, not of one-token steps
    again = spec.generate("1 2 3 4 5 7 8", 12, scope="s")
    assert sum(again.stats.accepted.values()) >= 3 and again.stats.steps < len(again.token_ids)
    records = list(spec.memory.records(scope="s"))
    assert len(records) == 2
    vocab = vocabulary(records, target.tokenizer)
    out_rows = target.model.get_output_embeddings().weight[vocab].detach()
    for record in records:
        kept = load_rows(target.fingerprint, "s", record.request_text, record.completion_ids)
        assert kept is not None
        tokens, rows = kept
        prompt = [int(t) for t in record.request_text.split()]
        completion = list(record.completion_ids)
        assert tokens.tolist() == [prompt[-1], *completion] and rows.shape[0] == len(completion)
        full = _forward_rows(target, prompt + completion)
        # row i processed token i of [last prompt token, completion...]
        want = full[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
        torch.testing.assert_close(rows.float(), want, atol=2e-2, rtol=2e-2)
        # a deliberately wrong alignment (one position late) is not these rows
        late = full[len(prompt) : len(prompt) + len(completion)]
        assert not torch.allclose(rows.float(), late, atol=2e-2, rtol=2e-2)
        # the replay built from them: a forward replay's starts 1 .. L - 1
        if len(completion) < 3:
            continue
        fwd = replay(target.model, target.tokenizer, [record], vocab)[0]
        kept_replay = from_rows(tokens, rows, out_rows)
        assert kept_replay.kept_rows and not fwd.kept_rows
        assert kept_replay.tokens.tolist() == fwd.tokens[1:-1].tolist()
        torch.testing.assert_close(kept_replay.hidden, fwd.hidden[1:-1], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(kept_replay.logp.float(), fwd.logp[1:-1].float(),
                                   atol=3e-2, rtol=3e-2)
        via = replay(target.model, target.tokenizer, [record], vocab,
                     rows_of=lambda r: load_rows(target.fingerprint, r.scope, r.request_text,
                                                 r.completion_ids))[0]
        assert via.kept_rows and torch.equal(via.logp, kept_replay.logp)


def test_rows_are_kept_only_when_asked_and_only_for_their_own_completion(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSPEC_HOME", str(tmp_path))
    base = tiny_target(3)
    target = HFTarget(base.model, DecodingTokenizer(), name="tiny-rows-off")
    spec = _speculator(target)
    spec.generate("1 2 3 4", 8, scope="s")
    assert not rows_dir(target.fingerprint, "s").exists()
    # a file is found by its request and completion only
    path = save_rows("fp", "s", "req", 7, [1, 2, 3], torch.ones(3, 4))
    assert path.name.startswith(rows_key("req", [1, 2, 3]))
    assert load_rows("fp", "s", "req", [1, 2, 3]) is not None
    assert load_rows("fp", "s", "req", [1, 2, 4]) is None
    assert load_rows("fp", "s", "other", [1, 2, 3]) is None
    path.write_bytes(b"not a tensor file")
    assert load_rows("fp", "s", "req", [1, 2, 3]) is None
    try:
        save_rows("fp", "s", "req", 7, [1, 2, 3], torch.ones(2, 4))
    except ValueError as e:
        assert "one row per completion token (3)" in str(e)
    else:
        raise AssertionError("a row count that does not match the completion was saved")
