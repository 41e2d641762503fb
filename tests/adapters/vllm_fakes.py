"""Doubles for the vLLM proposer's tests: vLLM's config object, a character tokenizer, and a
batch that drives ``propose`` as vLLM's model runner does, without vLLM.

:class:`FakeBatch` keeps ``token_ids_cpu`` and ``num_tokens_no_spec`` like vLLM's input batch:
a request takes the first free row, each step commits the accepted prefix of the row's last
draft plus one token of the request's fixed greedy answer, and a finished request's row is
filled by moving the last row into it (``InputBatch.condense``). What a request generates is
its answer whatever the drafts, as under vLLM's verification; the tests look at the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

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


@dataclass
class Req:
    prompt: list[int]
    answer: list[int]  # the greedy output, ending with EOS
    out: list[int] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    steps: int = 0


class FakeBatch:
    """vLLM's persistent batch as far as ``propose`` sees it (module docstring)."""

    def __init__(self, proposer: Any, rows: int = 4, max_len: int = 1024) -> None:
        self.proposer = proposer
        self.tokens = np.zeros((rows, max_len), dtype=np.int32)
        self.num = np.zeros(rows, dtype=np.int32)
        self.rows: list[Req] = []
        self.drafts: list[list[int]] = []  # every non-empty proposal

    def add(self, prompt: str, answer: str) -> Req:
        req = Req(CharTokenizer().encode(prompt), CharTokenizer().encode(answer) + [EOS])
        row = len(self.rows)
        self.tokens[row, : len(req.prompt)] = req.prompt
        self.num[row] = len(req.prompt)
        self.rows.append(req)
        return req

    def step(self) -> None:
        sampled = []
        for row, req in enumerate(self.rows):
            pos = len(req.out)
            accepted = 0
            while (accepted < len(req.draft) and pos + accepted < len(req.answer) - 1
                   and req.draft[accepted] == req.answer[pos + accepted]):
                accepted += 1
            new = req.answer[pos : pos + accepted + 1]
            n = int(self.num[row])
            self.tokens[row, n : n + len(new)] = new
            self.num[row] = n + len(new)
            req.out += new
            req.steps += 1
            sampled.append(list(new))
        drafts = self.proposer.propose(sampled, self.num, self.tokens)
        assert len(drafts) == len(sampled)
        for req, draft in zip(self.rows, drafts, strict=True):
            req.draft = list(draft)
            if draft:
                self.drafts.append(list(draft))
        self.proposer.settle()  # the lookups done before the next step: deterministic tests
        self._condense()

    def _condense(self) -> None:
        for row in range(len(self.rows) - 1, -1, -1):
            if len(self.rows[row].out) >= len(self.rows[row].answer):
                last = len(self.rows) - 1
                if row != last:  # the last row moves into the hole
                    self.tokens[row] = self.tokens[last]
                    self.num[row] = self.num[last]
                    self.rows[row] = self.rows[last]
                self.tokens[last] = 0
                self.num[last] = 0
                self.rows.pop()

    def run(self, *pairs: tuple[str, str]) -> list[Req]:
        """Run requests together to their end; returns them."""
        reqs = [self.add(p, a) for p, a in pairs]
        while self.rows:
            self.step()
        return reqs
