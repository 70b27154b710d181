"""Object stores: one small protocol, a local-directory store (default) and a memory store."""

from .base import Store, open_store
from .local import LocalStore
from .memory import MemoryStore

__all__ = ["LocalStore", "MemoryStore", "Store", "open_store"]
