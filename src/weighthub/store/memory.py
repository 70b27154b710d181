"""In-memory store for tests: same semantics as the local store, no durability."""

from __future__ import annotations

import threading
from typing import ClassVar

from ..errors import ObjectExists, ObjectNotFound
from .base import check_key


class MemoryStore:
    _named: ClassVar[dict[str, MemoryStore]] = {}
    _named_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @classmethod
    def named(cls, name: str) -> MemoryStore:
        """The process-wide store of that name (so URLs can refer to it)."""
        with cls._named_lock:
            if name not in cls._named:
                cls._named[name] = cls(name)
            return cls._named[name]

    def get(self, key: str) -> bytes:
        with self._lock:
            try:
                return self._objects[check_key(key)]
            except KeyError:
                raise ObjectNotFound(f"{key!r} is not in store {self.url}") from None

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        return self.get(key)[start:stop]

    def size(self, key: str) -> int:
        return len(self.get(key))

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        blob = bytes(data)
        with self._lock:
            if create_only and check_key(key) in self._objects:
                raise ObjectExists(f"{key!r} already exists in store {self.url}")
            self._objects[check_key(key)] = blob

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(check_key(key), None)

    def children(self, prefix: str) -> list[str]:
        base = f"{check_key(prefix)}/" if prefix else ""
        with self._lock:
            names = {k[len(base):].split("/", 1)[0] for k in self._objects if k.startswith(base)}
        return sorted(names)
