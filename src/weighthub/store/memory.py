"""In-memory store for tests: same semantics as the local store, no durability.

The only thing a call can wait for is the store's lock (another thread in a call), so `timeout`
bounds that wait: a holder of the lock that never lets go ends in StoreTimeout, not a hang.
"""

from __future__ import annotations

import threading
from typing import ClassVar

from ..errors import ObjectExists, ObjectNotFound, StoreTimeout, UsageError
from .base import check_key, check_max_bytes, check_timeout, too_large

DEFAULT_TIMEOUT_S = 60.0


class MemoryStore:
    """A thread-safe store in a dict. `timeout`: default seconds a call waits for the lock."""

    _named: ClassVar[dict[str, MemoryStore]] = {}
    _named_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str = "", *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = f"memory://{name}"
        self.timeout = check_timeout(timeout, None, f"store {self.url}")
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @classmethod
    def named(cls, name: str) -> MemoryStore:
        """The process-wide store of that name (so URLs can refer to it)."""
        with cls._named_lock:
            if name not in cls._named:
                cls._named[name] = cls(name)
            return cls._named[name]

    def _locked(self, op: str, key: str, timeout: float | None) -> _Held:
        limit = check_timeout(timeout, self.timeout, f"{op} {key!r} in {self.url}")
        if not self._lock.acquire(timeout=-1 if limit is None else limit):
            raise StoreTimeout(f"{op} {key!r} in {self.url}: the store stayed busy for "
                               f"{limit:g}s (another thread holds it); retry or raise timeout")
        return _Held(self._lock)

    def get(self, key: str, *, timeout: float | None = None,
            max_bytes: int | None = None) -> bytes:
        check_key(key)
        check_max_bytes(max_bytes, f"get {key!r} in {self.url}")
        with self._locked("get", key, timeout):
            try:
                data = self._objects[key]
            except KeyError:
                raise ObjectNotFound(f"{key!r} is not in store {self.url}") from None
        if max_bytes is not None and len(data) > max_bytes:
            raise too_large(len(data), max_bytes, f"get {key!r} in {self.url}")
        return data

    def get_range(self, key: str, start: int, stop: int, *,
                  timeout: float | None = None) -> bytes:
        if start < 0 or stop < 0:
            raise UsageError(f"get_range({key!r}, {start}, {stop}): offsets must be >= 0")
        return self.get(key, timeout=timeout)[start:stop]

    def size(self, key: str, *, timeout: float | None = None) -> int:
        return len(self.get(key, timeout=timeout))

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False,
            timeout: float | None = None) -> None:
        check_key(key)
        blob = bytes(data)
        with self._locked("put", key, timeout):
            if create_only and key in self._objects:
                raise ObjectExists(f"{key!r} already exists in store {self.url}")
            self._objects[key] = blob

    def delete(self, key: str, *, timeout: float | None = None) -> None:
        check_key(key)
        with self._locked("delete", key, timeout):
            self._objects.pop(key, None)

    def children(self, prefix: str, *, timeout: float | None = None) -> list[str]:
        base = f"{check_key(prefix)}/" if prefix else ""
        with self._locked("children", prefix or "/", timeout):
            names = {k[len(base):].split("/", 1)[0] for k in self._objects if k.startswith(base)}
        return sorted(names)


class _Held:
    """Releases an already acquired lock at the end of a `with` block."""

    __slots__ = ("_lock",)

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
