"""Store conformance (the shipped `weighthub.testing.StoreTests` kit) for the memory and local
stores, plus local-only checks (processes racing, files on disk, FIFOs, deadlines)."""

from __future__ import annotations

import errno
import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weighthub.errors import ObjectExists, StoreRefused, StoreTimeout, UsageError
from weighthub.store import LocalStore, MemoryStore, Store, open_store
from weighthub.store import base as store_base
from weighthub.store import open as store_open
from weighthub.testing import StoreTests, StoreTimeoutTests


class TestMemoryStore(StoreTimeoutTests):
    def make_store(self) -> Store:
        return MemoryStore("conformance")

    def stalled_store(self) -> tuple[Store, str]:
        store = MemoryStore("stalled")
        store.put("k", b"x")
        store._lock.acquire()  # another call that never returns holds the store
        return store, "k"

    @pytest.fixture
    def store(self) -> Store:
        return self.make_store()

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
    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path: Path) -> Iterator[None]:
        self.tmp = tmp_path
        yield

    def make_store(self) -> Store:
        return LocalStore(tempfile.mkdtemp(dir=self.tmp, prefix="store-"))

    @pytest.fixture
    def store(self) -> Store:
        return self.make_store()

    def test_fifo_under_a_key_is_refused_not_waited_on(self, store: LocalStore) -> None:
        store.put("v1/a", b"x")
        os.mkfifo(store.root / "v1" / "fifo")
        t0 = time.monotonic()
        for call in (lambda: store.get("v1/fifo"), lambda: store.get_range("v1/fifo", 0, 1)):
            with pytest.raises(StoreRefused, match="not a regular file"):
                call()
        assert time.monotonic() - t0 < 5

    def test_deadline_is_checked_while_data_moves(self, store: LocalStore,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
        from weighthub.store import local

        monkeypatch.setattr(local, "PIECE", 1024)
        store.put("v1/a", b"old")
        with pytest.raises(StoreTimeout, match=r"put 'v1/a'.*not done within"):
            store.put("v1/a", b"n" * 100_000, timeout=1e-9)
        assert store.get("v1/a") == b"old"  # a late write never lands
        assert not [p for p in store.root.rglob(".tmp*")]
        store.put("v1/a", b"n" * 100_000)
        with pytest.raises(StoreTimeout, match=r"get 'v1/a'.*not done within"):
            store.get("v1/a", timeout=1e-9)
        assert store.get("v1/a", timeout=30) == b"n" * 100_000
        slow = LocalStore(store.root, timeout=1e-9)  # the store's own default applies too
        with pytest.raises(StoreTimeout):
            slow.get("v1/a")

    def test_unreadable_object_is_refused(self, store: LocalStore,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
        # the OS says "permission denied" (chmod cannot make it say so to root, which CI runs
        # as): the store refuses, a StoreRefused, not a timeout and not a foreign OSError
        store.put("v1/a", b"x")
        real_open = os.open

        def denied(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            if str(path).endswith("v1/a"):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", denied)
        with pytest.raises(StoreRefused, match="cannot read"):
            store.get("v1/a")
        with pytest.raises(StoreRefused, match="cannot read"):
            store.get_range("v1/a", 0, 1)

    def test_open_store_lives_outside_base(self) -> None:
        assert not hasattr(store_base, "open_store")
        assert store_open.open_store is open_store

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
