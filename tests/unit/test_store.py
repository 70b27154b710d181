"""Store conformance: one suite (`StoreTests`) that every backend subclasses, plus local-only checks."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path

import pytest

from weighthub.errors import ObjectExists, ObjectNotFound, StoreError, UsageError
from weighthub.store import LocalStore, MemoryStore, Store, open_store

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


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return MemoryStore("conformance")

    def test_named_stores_are_shared(self) -> None:
        a = open_store("memory://shared-test")
        a.put("k", b"v")
        assert open_store("memory://shared-test").get("k") == b"v"
        assert MemoryStore("fresh").children("") == []


def _race_in_process(root: str, i: int, barrier) -> str:  # top level: picklable for spawn
    barrier.wait(timeout=60)
    try:
        LocalStore(root).put("v1/manifest.json", f"process {i}".encode(), create_only=True)
        return f"won {i}"
    except ObjectExists:
        return "lost"


def _worker(root: str, i: int, barrier, results) -> None:
    results.put(_race_in_process(root, i, barrier))


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return LocalStore(tmp_path / "store")

    def test_no_temp_files_left(self, store: LocalStore) -> None:
        store.put("v1/a", b"x" * 10000)
        store.put("v1/a", b"y")
        store.put("v1/m", b"z", create_only=True)
        with pytest.raises(ObjectExists):
            store.put("v1/m", b"w", create_only=True)
        leftovers = [p for p in store.root.rglob("*") if p.name.startswith(".tmp")]
        assert leftovers == []
        assert sorted(os.listdir(store.root / "v1")) == ["a", "m"]

    def test_objects_are_files(self, store: LocalStore) -> None:
        store.put("v1/a/b.whc", b"data")
        assert (store.root / "v1" / "a" / "b.whc").read_bytes() == b"data"
        assert store.url == f"file://{store.root}"

    def test_open_store_urls(self, tmp_path: Path) -> None:
        assert isinstance(open_store(str(tmp_path / "s1")), LocalStore)
        assert isinstance(open_store(f"file://{tmp_path / 's2'}"), LocalStore)
        with pytest.raises(UsageError, match="scheme 'ftp'"):
            open_store("ftp://host/x")

    def test_store_path_that_is_a_file(self, tmp_path: Path) -> None:
        path = tmp_path / "plain-file"
        path.write_bytes(b"not a store")
        with pytest.raises(UsageError, match="not a directory"):
            LocalStore(path)

    def test_concurrent_create_only_processes(self, tmp_path: Path) -> None:
        root = str(tmp_path / "store")
        LocalStore(root)
        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(2)
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(root, i, barrier, results)) for i in range(2)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        winners = [o for o in outcomes if o.startswith("won")]
        assert len(winners) == 1, outcomes
        got = LocalStore(root).get("v1/manifest.json")
        assert got == f"process {winners[0].split()[1]}".encode()
        assert not [p for p in Path(root).rglob(".tmp*")]
