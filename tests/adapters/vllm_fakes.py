"""Doubles for the vLLM proposer's tests: vLLM's config object, a character tokenizer, and a
batch that drives ``propose`` as vLLM's model runner does, without vLLM.

:class:`FakeBatch` keeps ``token_ids_cpu`` and ``num_tokens_no_spec`` like vLLM's input batch:
a request takes the first free row, each step commits the accepted prefix of the row's last
draft plus one token of the request's fixed greedy answer, and a finished request's row is
filled by moving the last row into it (``InputBatch.condense``): the replay bench's batch
(:mod:`agentspec.bench.vllm_replay`). What a request generates is its answer whatever the
drafts, as under vLLM's verification; the tests look at the drafts.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from agentspec.bench.vllm_replay import Batch, Request
from agentspec.memory.completion import CompletionMemory
from agentspec.memory.embedder import HashEmbedder
from agentspec.stores.memory_store import InMemoryStore

EOS = 3  # the character tokenizer's end of sequence (a control character no text holds)
VOCAB = 256


class CharTokenizer:
    """One token per character (code points below :data:`VOCAB`)."""

    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return "".join(chr(int(i)) for i in ids if not (skip_special_tokens and int(i) == EOS))


def chatml(system: str, user: str) -> str:
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def vllm_config(k: int = 4, max_model_len: int = 1024, **agentspec: Any) -> Any:
    """The parts of vLLM's ``VllmConfig`` the proposer reads."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k, method="custom_class"),
        model_config=SimpleNamespace(model="/models/char", tokenizer=None,
                                     max_model_len=max_model_len,
                                     hf_config=SimpleNamespace(vocab_size=VOCAB, eos_token_id=EOS)),
        additional_config={"agentspec": {"model_id": "char-model", **agentspec}})


def memory() -> CompletionMemory:
    return CompletionMemory(InMemoryStore(), embedder=HashEmbedder(), sync_interval_s=0)


class FakeBatch:
    """vLLM's persistent batch as far as ``propose`` sees it (module docstring): the replay
    bench's :class:`~agentspec.bench.vllm_replay.Batch` driving a proposer, whose lookups are
    done before each next step (deterministic tests)."""

    def __init__(self, proposer: Any, rows: int = 4, max_len: int = 1024) -> None:
        self.proposer = proposer
        self.drafts: list[list[int]] = []  # every non-empty proposal
        self.added = 0
        self.batch = Batch(self._propose, max_len, rows=rows)

    def _propose(self, rows: list[Request], sampled: list[list[int]], num: np.ndarray,
                 tokens: np.ndarray) -> list[list[int]]:
        drafts = self.proposer.propose(sampled, num, tokens)
        assert len(drafts) == len(sampled)
        self.drafts += [list(d) for d in drafts if len(d)]
        self.proposer.settle()
        return [list(d) for d in drafts]

    @property
    def rows(self) -> list[Request]:
        return self.batch.rows

    @property
    def tokens(self) -> np.ndarray:
        return self.batch.tokens

    def add(self, prompt: str, answer: str) -> Request:
        self.added += 1
        req = Request(f"r{self.added}", CharTokenizer().encode(prompt),
                      CharTokenizer().encode(answer) + [EOS])
        self.batch.add(req)
        return req

    def step(self) -> None:
        self.batch.step()

    def run(self, *pairs: tuple[str, str]) -> list[Request]:
        """Run requests together to their end; returns them."""
        reqs = [self.add(p, a) for p, a in pairs]
        while self.rows:
            self.step()
        return reqs
