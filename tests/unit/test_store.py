"""Store conformance (the shared `StoreTests` kit) for the memory and local stores, plus local-only checks."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import pytest

from weighthub.errors import ObjectExists, UsageError
from weighthub.store import LocalStore, MemoryStore, Store, open_store

# tests/ holds the conformance kit shared with the S3 suite (tests/integration/test_s3_store.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from store_conformance import StoreTests


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
