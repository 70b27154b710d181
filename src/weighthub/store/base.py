"""The Store protocol and `open_store(url)`.

Keys are relative '/'-separated paths of [A-Za-z0-9._-] segments. Lifecycle: a publisher `put`s
chunk objects (plain writes; retried freely), then `put(..., create_only=True)` the manifest:
that single create-only write is the commit. Readers `get`/`get_range` objects and `children`
to discover versions. Every method raises only StoreError subclasses.
"""

from __future__ import annotations

import re
from typing import Any, Protocol, runtime_checkable

from ..errors import UsageError

_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9._\-]+$")


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or any(not _KEY_SEGMENT.match(p) or p in (".", "..") for p in parts):
        raise UsageError(f"invalid store key {key!r}: use '/'-separated [A-Za-z0-9._-] segments")
    return key


@runtime_checkable
class Store(Protocol):
    """An object store holding versions. Implementations are safe to share between threads."""

    url: str

    def get(self, key: str) -> bytes:
        """The whole object. Raises ObjectNotFound."""
        ...

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the object (stop exclusive, clipped at its end)."""
        ...

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        """Write atomically: readers see the old object or the new one, never a part.

        create_only: fail with ObjectExists if the key is already there (the commit primitive).
        """
        ...

    def delete(self, key: str) -> None:
        """Remove the object if present (no error if absent)."""
        ...

    def children(self, prefix: str) -> list[str]:
        """Names directly under `prefix` ('' for the root): objects and sub-prefixes, sorted."""
        ...

    def size(self, key: str) -> int:
        """Byte size of the object. Raises ObjectNotFound."""
        ...


def open_store(url: str, **options: Any) -> Store:
    """A store from a URL: a directory path, file://PATH, s3://BUCKET/PREFIX, or memory://NAME.

    options go to the backend's constructor (for s3://: endpoint_url, timeouts, … see S3Store).
    s3:// imports botocore only when used, so the core does not depend on it.
    """
    from .local import LocalStore
    from .memory import MemoryStore

    if url.startswith("s3://"):
        try:
            from .s3 import S3Store
        except ImportError as exc:
            raise UsageError(f"store {url!r} needs the S3 client ({exc.name} is not installed): "
                             "pip install 'weighthub[s3]'") from exc
        return S3Store.from_url(url, **options)
    if options:
        raise UsageError(f"store {url!r}: options {sorted(options)} apply only to s3:// stores")
    if url.startswith("memory://"):
        return MemoryStore.named(url[len("memory://"):])
    if url.startswith("file://"):
        return LocalStore(url[len("file://"):])
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise UsageError(f"store {url!r}: scheme {scheme!r} is not supported; use a directory "
                         "path, file://PATH, s3://BUCKET/PREFIX or memory://NAME")
    return LocalStore(url)
