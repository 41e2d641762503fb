"""A vLLM proposer that drafts each request's known output: the bound of any proposer.

``python -m agentspec.bench.vllm --methods plain,suffix,agentspec,oracle`` runs it as the
``oracle`` method: vLLM plain's greedy outputs of the measured lines are handed to it (plain
must run earlier in the same invocation), and each step it drafts the next ``k`` tokens of the
row's request, all of which the target accepts. Its tokens per second are what no proposer can
beat at that ``k`` on that machine: the gap between it and a method is what better drafts could
still win, and where the oracle itself is close to a method, the engine's verification, not
the drafts, sets the pace.

A row's request is found by its prompt (the longest known prompt the row starts with, whose
known output agrees with what the row has generated so far); a row matching none gets no draft.
The pairs file may grow while the engine runs (the side-by-side bench tells the oracle each
output as plain generates it): a row matching none reads it again when it has changed.
Bench only: nothing else imports it, and it imports nothing from vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

OPTION = "agentspec_oracle"
"""The ``additional_config`` key of the oracle's options: ``{"pairs": path}``, a JSON list of
``[prompt_ids, output_ids]``."""


class OracleProposer:
    """vLLM ``custom_class`` proposer drafting known outputs (module docstring).

    Args:
        vllm_config: read: ``speculative_config.num_speculative_tokens`` and
            ``additional_config["agentspec_oracle"]["pairs"]``.

    Raises:
        ValueError: no pairs file in the options.
    """

    def __init__(self, vllm_config: Any) -> None:
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        extra = getattr(vllm_config, "additional_config", None) or {}
        path = (extra.get(OPTION) or {}).get("pairs") if isinstance(extra, dict) else None
        if not path:
            raise ValueError(f"the oracle proposer needs additional_config[{OPTION!r}]['pairs']")
        self.path = Path(path)
        self.known: list[tuple[np.ndarray, list[int]]] = []
        self._read: tuple[int, int, int] | None = None
        self._load()

    def _load(self) -> bool:
        """Read the pairs file if it changed since the last read; whether it did."""
        st = self.path.stat()
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)  # the file is replaced, and grows
        if stamp == self._read:
            return False
        self._read = stamp
        pairs = json.loads(self.path.read_text())
        # Longest prompts first: a prompt that extends another is the better match.
        self.known = sorted(((np.asarray(p, dtype=np.int64), list(o)) for p, o in pairs),
                            key=lambda po: -len(po[0]))
        return True

    def load_model(self, model: Any = None) -> None:
        """vLLM's hook (nothing to load)."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """Per row, the next ``k`` tokens of its request's known output ([] when unknown)."""
        return [self.draft(token_ids_cpu[i], int(num_tokens_no_spec[i])) if sampled else []
                for i, sampled in enumerate(sampled_token_ids)]

    def draft(self, row: np.ndarray, total: int) -> list[int]:
        """The known continuation of the row's first ``total`` tokens, ``k`` at most."""
        found = self._find(row, total)
        if found is None and self._load():
            found = self._find(row, total)
        return found or []

    def _find(self, row: np.ndarray, total: int) -> list[int] | None:
        for prompt, output in self.known:
            n = len(prompt)
            if n > total or not np.array_equal(row[:n], prompt):
                continue
            done = total - n
            if done <= len(output) and row[n:total].tolist() == output[:done]:
                return output[done : done + self.k]
        return None
