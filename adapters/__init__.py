"""Integrations: LangChain chat/LLM models (``agentspec.adapters.langchain``, needs
``langchain-core``) and agent-loop decorators (``agentspec.adapters.decorators``).

Nothing is imported here, so ``import agentspec.adapters`` stays light.
"""
