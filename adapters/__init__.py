"""Integrations: LangChain chat/LLM models (``agentspec.adapters.langchain``, needs
``langchain-core``), an OpenAI-compatible HTTP server (``agentspec.adapters.openai_server``,
needs ``agentspec-llm[serve]``; ``agentspec serve``) and agent-loop decorators
(``agentspec.adapters.decorators``). ``agentspec.adapters.chat`` is what the LangChain models
and the server share.

Nothing is imported here, so ``import agentspec.adapters`` stays light.
"""
