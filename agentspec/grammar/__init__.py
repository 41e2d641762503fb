"""Grammar-constrained decoding: what a grammar is (:mod:`.spec`), the tokenizer bridge and the
masks shared across requests (:mod:`.tokenizer`), one request's state (:mod:`.state`), and the
same constraint for ``transformers.generate`` (:mod:`.hf`)."""

from agentspec.grammar.spec import Grammar, GrammarError, compiled

__all__ = ["Grammar", "GrammarError", "compiled"]
