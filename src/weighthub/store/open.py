"""`open_store(url)`: a store from a URL.

Kept apart from `base.py` (the protocols), which every backend imports: the opener imports every
backend, so having it in `base.py` needed function-local imports to dodge an import circle.
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from .base import Store
from .local import LocalStore
from .memory import MemoryStore


def open_store(url: str, **options: Any) -> Store:
    """A store from a URL: a directory path, file://PATH, s3://BUCKET/PREFIX, or memory://NAME.

    Args:
        url: where the store is.
        options: go to the backend's constructor (s3:// only: endpoint_url, timeouts, … see
            S3Store).

    Raises:
        UsageError: an unsupported scheme, options the backend does not take, or s3:// without
            the S3 client installed (s3:// imports botocore only when used: the core does not
            depend on it).
    """
    if url.startswith("s3://"):
        try:
            from .s3 import S3Store
        except ImportError as exc:
            raise UsageError(f"store {url!r} needs the S3 client ({exc.name} is not installed): "
                             "pip install 'weighthub[s3]'") from exc
        return S3Store.from_url(url, **options)
    if url.startswith("memory://"):
        _no_options(url, options)
        return MemoryStore.named(url[len("memory://"):])
    if "://" in url and not url.startswith("file://"):
        scheme = url.split("://", 1)[0]
        raise UsageError(f"store {url!r}: scheme {scheme!r} is not supported; use a directory "
                         "path, file://PATH, s3://BUCKET/PREFIX or memory://NAME")
    _no_options(url, options)
    return LocalStore(url[len("file://"):] if url.startswith("file://") else url)


def _no_options(url: str, options: dict[str, Any]) -> None:
    if options:
        raise UsageError(f"store {url!r}: options {sorted(options)} apply only to s3:// stores")
