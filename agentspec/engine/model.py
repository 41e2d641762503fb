"""A model's identity: what memory rows, heads and costs are kept under, and what ends a
generation. Shared by the in-process engine (:class:`~agentspec.engine.target.HFTarget`) and
agentspec's proposer inside vLLM (``agentspec.adapters.vllm``), so both draft from each
other's records and stop on the same tokens."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Config entries that say where and how a model was loaded, not what it is: the folder it was
# read from (another user's $AGENTSPEC_HOME, a moved cache), the transformers release that
# wrote the config, the dtype it was loaded in.
_NOT_IDENTITY = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")


def fingerprint(name: str, model: Any, tokenizer: Any) -> str:
    """Model + tokenizer identity: memory entries of another fingerprint are never drafted from.

    ``model`` is anything with a transformers ``config``. The same model loaded from another
    folder, by another transformers release or in another dtype has the same fingerprint, so
    agents on several machines share one memory's rows and heads (outputs still depend on the
    dtype; drafts are only drafts)."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    for key in _NOT_IDENTITY:
        config.pop(key, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return f"{name}:{h.hexdigest()[:16]}"


def stop_ids(sources: Iterable[Any]) -> frozenset[int]:
    """The tokens that end a generation, from end-of-sequence entries that are each an int, a
    list of ints or None (a generation config's, a tokenizer's, a model config's)."""
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)


@dataclass(frozen=True)
class ModelIdentity:
    """``fingerprint`` (:func:`fingerprint`) and the stop tokens of a model."""

    fingerprint: str
    stop_token_ids: frozenset[int]

    @classmethod
    def of(cls, name: str, model: Any, tokenizer: Any, eos: Iterable[Any]) -> ModelIdentity:
        """The identity of a model (anything with a transformers ``config``) and its
        tokenizer; ``eos``: its end-of-sequence entries (each an int, a list or None)."""
        return cls(fingerprint(name, model, tokenizer), stop_ids(eos))
