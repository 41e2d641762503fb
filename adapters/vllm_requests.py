"""Which request each row of vLLM's batch holds, seen only through its token ids.

vLLM's speculative proposer is handed the batch as arrays: per row, the request's token ids
(``token_ids_cpu[row, :num_tokens_no_spec[row]]``) and the tokens sampled this step. It is
told nothing about requests: rows are reused by later requests, and when a request finishes,
the last rows move into the hole (``InputBatch.condense``); a request that is not scheduled
in a step (preempted, or over the token budget) leaves the batch and may come back elsewhere.

So a request is recognised by its tokens. :class:`Rows` keeps, per live request, a copy of
the tokens it has seen; a row still holds that request when the row's first ``n`` tokens are
those (one array compare per row per step). Otherwise the row is matched against every other
live request (a request that moved), else it is a new request: its prompt is what the row held
before this step's sampled tokens.

The memory scope and key come from the prompt's text (:func:`prompt_identity`): the chat
template's turns are read back out of it, the scope is a digest of the system prompt (an
agent's role and its tool schemas), the key is :func:`agentspec.text.conversation_key` of the
turns, as the in-process engine keys its calls.
"""

from __future__ import annotations

import hashlib
import json
import re
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentspec.protocols import DraftContext
from agentspec.text import conversation_key
from agentspec.types import EMPTY_DRAFT, Draft, Verdict

# Chat templates whose turns are read back out of a prompt's text: ChatML (SmolLM2, Qwen),
# Llama 3's headers, Gemma's turns. Each match is (role, content).
TURN_PATTERNS = (
    re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", re.S),
    re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.S),
    re.compile(r"<start_of_turn>(\w+)\n(.*?)<end_of_turn>", re.S),
)


@dataclass(frozen=True)
class PromptIdentity:
    """What the memory knows a request by: its ``scope``, lookup key and record text."""

    scope: str
    key_text: str
    request_text: str


def prompt_turns(text: str) -> list[dict[str, str]]:
    """The complete turns of a chat-templated prompt, in order (empty: no known template).
    The open generation turn at the end is not one."""
    for pattern in TURN_PATTERNS:
        turns = [{"role": role, "content": content} for role, content in pattern.findall(text)]
        if turns:
            return turns
    return []


def prompt_identity(text: str, scope: str | None = None) -> PromptIdentity:
    """The scope, key and record text of a prompt given as text.

    Args:
        text: the prompt's token ids decoded, chat template included.
        scope: a fixed scope; None derives it from the system prompt: requests sharing one
            (one agent role, one tool set) share a scope, and a prompt without one (or in an
            unknown template) is in ``"vllm:default"``.
    """
    turns = prompt_turns(text)
    if turns:
        system = "\n".join(t["content"] for t in turns if t["role"] == "system")
        key, shown = conversation_key(turns), json.dumps(turns)
    else:
        system, key, shown = "", conversation_key(text), text
    if scope is None:
        scope = ("vllm:" + hashlib.sha256(system.encode()).hexdigest()[:16]) if system \
            else "vllm:default"
    return PromptIdentity(scope, key, shown)


@dataclass
class Live:
    """One request the proposer follows.

    Attributes:
        context: the drafters' view of it (its tokens grow as the row does).
        ids: a copy of the request's tokens seen so far (``ids[:n]``), to recognise its row.
        n: how many tokens have been seen.
        begun: the drafters' ``begin`` and the identity, running off the step path; the request
            drafts once it is done.
        identity: its scope, key and record text (set by ``begun``).
        ready: ``begun`` is done and the tokens generated meanwhile were observed.
        draft: the draft proposed at the last step (what this step's sampled tokens verified).
        seen: the proposer's step count when its row was last seen.
    """

    context: DraftContext
    ids: np.ndarray
    n: int
    begun: Future[Any] | None = None
    identity: PromptIdentity | None = None
    ready: bool = False
    draft: Draft = EMPTY_DRAFT
    seen: int = 0
    failed: bool = field(default=False)

    def holds(self, row: np.ndarray, before: int, max_gap: int) -> bool:
        """Whether ``row`` is this request: its first ``n`` tokens are those seen, and the row
        held ``n`` to ``n + max_gap`` tokens before this step's sampled ones (``before``; more
        than ``n`` after a step without a proposal). A longer gap is another request whose
        prompt starts with this one's tokens (an agent's next turn)."""
        n = self.n
        return n <= before <= n + max_gap and np.array_equal(row[:n], self.ids[:n])

    def take(self, row: np.ndarray, total: int) -> list[int]:
        """The row's tokens after those seen, up to ``total``; now seen."""
        new = row[self.n : total]
        if total > len(self.ids):
            grown = np.empty(max(total, 2 * len(self.ids)), dtype=self.ids.dtype)
            grown[: self.n] = self.ids[: self.n]
            self.ids = grown
        self.ids[self.n : total] = new
        self.n = total
        out: list[int] = new.tolist()
        self.context.tokens.extend(out)
        return out

    @property
    def generated(self) -> list[int]:
        return self.context.tokens[self.context.prompt_len :]


def verdict_for(draft: Draft, new: list[int]) -> tuple[Draft, Verdict]:
    """The draft and verdict a step's committed tokens ``new`` imply: vLLM verifies chains and
    commits the accepted draft tokens and one more, so ``new[:-1]`` is a prefix of ``draft``.
    When it is not (the draft was not the one verified: steps passed without a proposal, or
    the scheduler cut it), the tokens are observed as committed without a draft."""
    accepted = len(new) - 1
    if 0 <= accepted <= draft.num_nodes and draft.is_chain \
            and tuple(new[:accepted]) == draft.token_ids[:accepted]:
        return draft, Verdict.chain(new[:accepted], new[-1])
    return EMPTY_DRAFT, Verdict((), tuple(new[:-1]), new[-1])


class Rows:
    """Live requests by the batch row that held them last (see the module docstring)."""

    def __init__(self, max_gap: int) -> None:
        self.max_gap = max_gap  # tokens a row may gain between two proposals (Live.holds)
        self.by_row: dict[int, Live] = {}
        self.live: list[Live] = []

    def find(self, row_index: int, row: np.ndarray, before: int) -> Live | None:
        """The live request ``row`` holds: the one last seen there, else one that moved."""
        live = self.by_row.get(row_index)
        if live is not None and live.holds(row, before, self.max_gap):
            return live
        for other in self.live:
            if other is not live and other.holds(row, before, self.max_gap):
                self.place(row_index, other)
                return other
        return None

    def place(self, row_index: int, live: Live) -> None:
        """``live`` is in ``row_index`` now (and in no other row)."""
        for index, held in list(self.by_row.items()):
            if held is live:
                del self.by_row[index]
        self.by_row[row_index] = live

    def start(self, row_index: int, row: np.ndarray, before: int, total: int,
              make_context: Any) -> Live:
        """A new request in ``row_index``: its prompt is the row's first ``before`` tokens."""
        ids = np.array(row[: max(total, 1)], copy=True)
        context = make_context(ids[:before].tolist(), before)
        live = Live(context, ids, before)
        self.live.append(live)
        self.place(row_index, live)
        return live

    def drop(self, live: Live) -> None:
        """``live`` has finished: forgotten."""
        self.live = [other for other in self.live if other is not live]
        for index, held in list(self.by_row.items()):
            if held is live:
                del self.by_row[index]

    def stale(self, now: int, after: int) -> list[Live]:
        """The live requests not seen in the last ``after`` steps."""
        return [live for live in self.live if now - live.seen > after]


class StepClock:
    """vLLM's step time as ``base + per_token * tokens``, fitted as the engine runs.

    A step's time is measured between two proposals (from the end of one ``propose`` to the
    start of the next), and the tokens it verified are the rows' drafts plus one each. Only
    steps in which every row decoded, in both calls, count: a prefill's tokens are not seen
    here. The fit is least squares over a decayed window, so it follows a batch that grows or
    shrinks; the chain policy sizes each row's draft on it (:meth:`row_cost`).

    Args:
        decay: the weight left to a step after each later one.
        min_steps: steps before the fit is used.
    """

    def __init__(self, decay: float = 0.995, min_steps: int = 32) -> None:
        self.decay, self.min_steps = decay, min_steps
        self.w = self.x = self.y = self.xx = self.xy = self.rows = 0.0
        self.count = 0

    def add(self, tokens: int, seconds: float, rows: int) -> None:
        d = self.decay
        self.w = d * self.w + 1.0
        self.x = d * self.x + tokens
        self.y = d * self.y + seconds
        self.xx = d * self.xx + tokens * tokens
        self.xy = d * self.xy + tokens * seconds
        self.rows = d * self.rows + rows
        self.count += 1

    def row_cost(self) -> tuple[float, float] | None:
        """``(base, per_token)`` of one row's step: the fitted step time with the other rows'
        mean tokens in the base; None until ``min_steps`` steps (or no spread in tokens)."""
        if self.count < self.min_steps:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var <= 1e-9 or my <= 0:
            return None
        per_token = max(0.0, (self.xy / self.w - mx * my) / var)
        base = max(my - per_token * mx, 0.05 * my)
        others = mx * (1.0 - 1.0 / max(self.rows / self.w, 1.0))
        return base + per_token * others, per_token
