"""Object stores: protocols by ability, a local-directory store (default), memory and S3 stores.

`open_store(url)` opens one from a URL; `S3Store` lives in `weighthub.store.s3` (it imports
botocore, which the core does not depend on).
"""

from .base import Deletable, Listable, RangeReadable, Readable, ReadableStore, Store, Writable, check_key
from .local import LocalStore
from .memory import MemoryStore
from .open import open_store

__all__ = ["Deletable", "Listable", "LocalStore", "MemoryStore", "RangeReadable", "Readable",
           "ReadableStore", "Store", "Writable", "check_key", "open_store"]
