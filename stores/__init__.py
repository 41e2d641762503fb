"""Where the completion memory keeps its records (SQL, in-memory) and its vector indexes.

Nothing here imports torch or transformers: ``agentspec cache`` commands stay fast.
"""

from agentspec.stores.faiss_index import FaissIndex
from agentspec.stores.memory_store import BruteForceIndex, InMemoryStore
from agentspec.stores.sql import SQLStore, mask_url
from agentspec.stores.sql_schema import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "BruteForceIndex", "FaissIndex", "InMemoryStore", "SQLStore", "mask_url"]
