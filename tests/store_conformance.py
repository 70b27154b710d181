"""The store conformance kit: `StoreTests`, the behaviour every Store backend must have.

A backend's test module subclasses it and provides a `store` fixture yielding an empty store
(tests/unit/test_store.py: memory and local; tests/integration/test_s3_store.py: S3).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from weighthub.errors import ObjectExists, ObjectNotFound, StoreError, UsageError
from weighthub.store import Store

BAD_KEYS = ["", "..", "a/../b", "/abs", "a//b", "./a", "a/.", "a b", "a\\b", "ä", "a/"]


class StoreTests:
    """Behaviour every Store must have. Subclasses provide the `store` fixture."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        raise NotImplementedError

    def test_is_a_store(self, store: Store) -> None:
        assert isinstance(store, Store)
        assert "://" in store.url

    def test_put_get(self, store: Store) -> None:
        store.put("v1/a.bin", b"hello")
        assert store.get("v1/a.bin") == b"hello"
        store.put("v1/a.bin", memoryview(b"again"))  # overwrite, from a memoryview
        assert store.get("v1/a.bin") == b"again"
        store.put("v1/empty", b"")
        assert store.get("v1/empty") == b""
        assert store.size("v1/empty") == 0

    def test_get_range(self, store: Store) -> None:
        store.put("x", bytes(range(10)))
        assert store.get_range("x", 2, 5) == bytes([2, 3, 4])  # stop exclusive
        assert store.get_range("x", 0, 10) == bytes(range(10))
        assert store.get_range("x", 8, 100) == bytes([8, 9])  # clipped at the end
        assert store.get_range("x", 12, 20) == b""
        assert store.get_range("x", 5, 5) == b""
        assert store.get_range("x", 6, 3) == b""

    def test_size(self, store: Store) -> None:
        store.put("a/b/c", b"x" * 1234)
        assert store.size("a/b/c") == 1234

    def test_children(self, store: Store) -> None:
        assert store.children("") == []
        for key in ("v2/manifest.json", "v1/manifest.json", "v1/full-abc/c0.whc", "v1/full-abc/c1.whc"):
            store.put(key, b"x")
        assert store.children("") == ["v1", "v2"]
        assert store.children("v1") == ["full-abc", "manifest.json"]
        assert store.children("v1/full-abc") == ["c0.whc", "c1.whc"]
        assert store.children("missing") == []
        assert store.children("v1/manifest.json") == []  # an object has no children

    def test_delete(self, store: Store) -> None:
        store.put("v1/a", b"1")
        store.put("v1/b", b"2")
        store.delete("v1/a")
        with pytest.raises(ObjectNotFound):
            store.get("v1/a")
        store.delete("v1/a")  # absent: no error
        store.delete("never/there")
        assert store.children("v1") == ["b"]
        store.delete("v1/b")
        assert store.children("") == []  # nothing left behind

    def test_create_only(self, store: Store) -> None:
        store.put("v1/manifest.json", b"first", create_only=True)
        with pytest.raises(ObjectExists, match=r"v1/manifest\.json"):
            store.put("v1/manifest.json", b"second", create_only=True)
        assert store.get("v1/manifest.json") == b"first"
        store.put("v1/plain", b"a")
        with pytest.raises(ObjectExists):
            store.put("v1/plain", b"b", create_only=True)
        assert store.get("v1/plain") == b"a"

    def test_missing(self, store: Store) -> None:
        for call in (lambda: store.get("nope"), lambda: store.get_range("nope", 0, 1),
                     lambda: store.size("nope"), lambda: store.get("a/b/c")):
            with pytest.raises(ObjectNotFound, match=r"nope|a/b/c"):
                call()

    def test_errors_are_store_errors(self, store: Store) -> None:
        with pytest.raises(StoreError):
            store.get("nope")

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_invalid_keys(self, store: Store, key: str) -> None:
        for call in (lambda: store.get(key), lambda: store.put(key, b"x"),
                     lambda: store.put(key, b"x", create_only=True), lambda: store.size(key),
                     lambda: store.get_range(key, 0, 1), lambda: store.delete(key)):
            with pytest.raises(UsageError, match="invalid store key"):
                call()
        if key:  # '' is the root for children()
            with pytest.raises(UsageError):
                store.children(key)

    def test_concurrent_create_only_threads(self, store: Store) -> None:
        barrier = threading.Barrier(8)
        outcomes: list[str] = []
        lock = threading.Lock()

        def race(i: int) -> None:
            barrier.wait()
            try:
                store.put("v7/manifest.json", f"writer {i}".encode(), create_only=True)
                result = f"won {i}"
            except ObjectExists:
                result = "lost"
            with lock:
                outcomes.append(result)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        winners = [o for o in outcomes if o.startswith("won")]
        assert len(outcomes) == 8 and len(winners) == 1
        assert store.get("v7/manifest.json") == f"writer {winners[0].split()[1]}".encode()
