"""A store wrapper that records what a receiver asks of it: a store behind a slow link, where
every listing and manifest read is a round trip the refit waits for."""

from __future__ import annotations

from typing import Any

from weighthub.store.memory import MemoryStore


class CountingStore:
    """`inner` with its listings (`listed`, by prefix) and manifest reads (`manifests_read`,
    by key) recorded; every other call goes to `inner` unchanged."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.listed: list[str] = []
        self.manifests_read: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def children(self, prefix: str, **kw: Any) -> list[str]:
        self.listed.append(prefix)
        return self.inner.children(prefix, **kw)

    def get(self, key: str, **kw: Any) -> bytes:
        if key.endswith(".json"):
            self.manifests_read.append(key)
        return self.inner.get(key, **kw)
