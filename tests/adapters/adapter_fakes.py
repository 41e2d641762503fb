"""Test doubles: a tiny fake Speculator (for pure adapter and contextvar logic) and ONE real
Speculator per test process (module-level cache) for the checks that need the real model."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

from agentspec.session import Session, current_session
from agentspec.stream import Stream
from agentspec.types import Generation, GenerationStats

_REAL: list[Any] = []
_REAL_LOCK = threading.Lock()


def shared_speculator() -> Any:
    """The one real Speculator of this test process (loaded on first use)."""
    with _REAL_LOCK:
        if not _REAL:
            from agentspec import Speculator

            # No memory: tests must neither read nor write the user's default memory file.
            _REAL.append(Speculator.from_pretrained("smollm2-135m-instruct", memory=None))
        return _REAL[0]


class FakeTokenizer:
    """One token per character; a chat template without tool support."""

    chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    bos_token = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages: Sequence[dict[str, str]], tools: Any = None,
                            tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


class FakeSpeculator:
    """Streams a scripted reply in 3-character steps, with the real Speculator's session
    contract: the call's scope is ``scope`` or the session's, and the session observes it."""

    def __init__(self, reply: str | Callable[[Any], str] = "Hello there, friend!") -> None:
        self.reply = reply
        self.tokenizer = FakeTokenizer()
        self.calls: list[dict[str, Any]] = []

    def session(self, name: str, *, scope: str = "default") -> Session:
        return Session(self, name, scope=scope)

    def stream(self, prompt: Any, max_new_tokens: int = 128, *, sampling: Any = None,
               stop: Sequence[str] = (), scope: str | None = None) -> Stream:
        return Stream(self._deltas(prompt, max_new_tokens, stop=stop, scope=scope,
                                   session=current_session(self), sampling=sampling))

    def _deltas(self, prompt: Any, max_new_tokens: int, *, stop: Sequence[str],
                scope: str | None, session: Session | None,
                sampling: Any = None) -> Generator[str, None, Generation]:
        scope = scope or (session.scope if session else "default")
        text = self.reply(prompt) if callable(self.reply) else self.reply
        text = text[:max_new_tokens]
        cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
        text = text[: min(cuts)] if cuts else text
        self.calls.append({"prompt": prompt, "scope": scope, "stop": list(stop),
                           "sources": len(session.sources) if session else 0,
                           "grammar": getattr(sampling, "grammar", None)})
        for i in range(0, len(text), 3):
            yield text[i : i + 3]
        ids = tuple(ord(c) for c in text)
        stats = GenerationStats(steps=max(1, -(-len(text) // 3)), new_tokens=len(ids),
                                prompt_tokens=7, seconds=0.01, drafted={"prompt_lookup": 2},
                                accepted={"prompt_lookup": 1}, cached_tokens=3)
        gen = Generation(text, ids, stats, "stop" if cuts else "length")
        if session is not None:
            session.observe(gen)
        return gen

    def generate(self, prompt: Any, max_new_tokens: int = 128, **kw: Any) -> Generation:
        text = "".join(self.stream(prompt, max_new_tokens, **kw))
        return Generation(text, tuple(ord(c) for c in text), GenerationStats(new_tokens=len(text)), "length")


