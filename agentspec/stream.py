"""What :meth:`Speculator.stream <agentspec.speculator.Speculator.stream>` returns: text
deltas, then the finished Generation, the one public way to get both from one call."""

from __future__ import annotations

from collections.abc import Generator
from types import TracebackType
from typing import Any

from agentspec.types import Generation, TokenLogprob


class Stream(Generator[str, None, Generation]):
    """The text deltas of one :meth:`Speculator.stream` call, as its steps commit them.

    Iterate it for the text; once it is exhausted, :attr:`generation` is the finished
    :class:`~agentspec.types.Generation` (token ids, statistics, finish reason), the same
    object ``generate`` returns. It is None before, and stays None when the stream is closed
    early (``close()``, ``break`` out of a ``with`` block, ``throw()``). The generator's return
    value is that Generation too (``gen = yield from spec.stream(...)``).

    Between two deltas the stream holds no lock: other calls run while the caller works, and
    an abandoned stream blocks nobody. Closing it (or dropping it) ends the call at once.

    Example:
        >>> with spec.stream("def add(a, b):", 32) as stream:
        ...     for delta in stream:
        ...         print(delta, end="")
        >>> stream.generation.stats.tokens_per_step
    """

    def __init__(self, deltas: Generator[str, None, Generation],
                 logprobs: list[TokenLogprob] | None = None) -> None:
        self._deltas = deltas
        self._logprobs = logprobs
        self.generation: Generation | None = None

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The log-probabilities of the tokens committed so far (with
        ``SamplingParams.logprobs``; None without), one per token in order. They may run ahead
        of the text yielded (text held back at a possible stop string or an incomplete
        character) and past a stop string's cut; the finished ``generation.logprobs`` are cut
        to its tokens."""
        return None if self._logprobs is None else tuple(self._logprobs)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        return self.send(None)

    def send(self, value: None) -> str:
        try:
            return self._deltas.send(value)
        except StopIteration as stop:
            self.generation = stop.value
            raise

    def throw(self, typ: Any, val: Any = None, tb: TracebackType | None = None) -> str:
        try:
            if val is None and tb is None:
                return self._deltas.throw(typ)
            return self._deltas.throw(typ, val, tb)
        except StopIteration as stop:
            self.generation = stop.value
            raise

    def close(self) -> None:
        self._deltas.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
