"""A tiny random Llama on a 12-token vocabulary, its heads and records (no hub): shared by
the draft-head tests (tests/unit/test_head*.py, test_malloc.py, tests/bench/test_head_bench.py)."""

from __future__ import annotations

import torch

from agentspec.drafters.head import RecurrentHead
from agentspec.engine.target import HFTarget
from agentspec.types import Record

V = 12


class TinyTokenizer:
    """Token ids written as numbers ("1 2 3"); a vocabulary of ``vocab`` ids, the last the
    end of sequence."""

    def __init__(self, vocab: int = V) -> None:
        self.vocab = vocab
        self.eos_token_id = vocab - 1

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.vocab)}

    def __len__(self) -> int:
        return self.vocab

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [int(t) for t in text.split()]}


class DecodingTokenizer(TinyTokenizer):
    """A :class:`TinyTokenizer` that decodes (a completion's text: " 8 6")."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:  # noqa: ANN001
        return "".join(f" {int(i)}" for i in ids)


def tiny_target(seed: int = 0) -> HFTarget:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, initializer_range=0.5)
    return HFTarget(LlamaForCausalLM(config).eval(), TinyTokenizer(), name=f"tiny-{seed}")


def random_head(target: HFTarget, vocab: list[int], seed: int = 1) -> RecurrentHead:
    torch.manual_seed(seed)
    model = target.model
    head = RecurrentHead(model.get_input_embeddings().weight.float(),
                         model.get_output_embeddings().weight.float(), torch.tensor(vocab))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    return head.eval()


def cycle_records(n: int) -> list[Record]:
    """Distinct completions of a tiny 'agent' whose outputs follow a fixed cycle (3 4 5 6)."""
    out = []
    for i in range(n):
        prompt = f"1 {2 + i % 3} 5"
        completion = tuple(([3, 4, 5, 6] * 4)[i % 4 :][: 4 + i // 4])
        out.append(Record(scope="s", model="m", request_text=prompt, key_text=prompt,
                          completion_text="", completion_ids=completion, id=i + 1))
    return out


# Two conversations' openings; each turn is a record whose completion is 3 4 5 6.
OPENING_A, OPENING_B = [1, 2, 5, 3, 4, 5, 6], [1, 3, 5, 6, 3, 4, 5]


def turn_records(turns: list[list[int]]) -> list[Record]:
    return [Record(scope="s", model="m", request_text=" ".join(map(str, p)), key_text=str(i),
                   completion_ids=(3, 4, 5, 6), completion_text="", id=i + 1)
            for i, p in enumerate(turns)]
