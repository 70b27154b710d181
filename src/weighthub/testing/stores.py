"""`StoreTests`: the behaviour every Store backend must have.

Subclass it and implement `make_store` (a fresh, empty store per call); a store that can stall
(a server, a lock) subclasses `StoreTimeoutTests` and implements `stalled_store` too: a store
and key whose reads never complete, to check that a per-call timeout ends them. Run on
LocalStore and MemoryStore (tests/unit/test_store.py) and on S3Store against SeaweedFS
(tests/integration/test_s3_store.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import LimitError, ObjectExists, ObjectNotFound, StoreError, StoreTimeout, UsageError
from ..store.base import Deletable, Listable, RangeReadable, Readable, ReadableStore, Store, Writable
from ._check import raises

BAD_KEYS = ["", "..", "a/../b", "/abs", "a//b", "./a", "a/.", "a b", "a\\b", "ä", "a/"]
BAD_TIMEOUTS: list[Any] = [0, -1, math.nan, math.inf, "1", True]


class StoreTests:
    """Behaviour every Store must have. Subclasses implement `make_store`."""

    timeout_slack_s = 5.0  # allowance past a timeout for a loaded machine, not a speed target

    def make_store(self) -> Store:
        """A fresh, empty store (called once per check)."""
        raise NotImplementedError("a StoreTests subclass implements make_store()")


    # -- shape -----------------------------------------------------------------------------------
    def test_is_a_store(self) -> None:
        store = self.make_store()
        assert isinstance(store, Store)
        for ability in (Readable, RangeReadable, Writable, Listable, Deletable, ReadableStore):
            assert isinstance(store, ability), ability.__name__
        assert "://" in store.url

    # -- objects ---------------------------------------------------------------------------------
    def test_put_get(self) -> None:
        store = self.make_store()
        store.put("v1/a.bin", b"hello")
        assert store.get("v1/a.bin") == b"hello"
        store.put("v1/a.bin", memoryview(b"again"))  # overwrite, from a memoryview
        assert store.get("v1/a.bin") == b"again"
        store.put("v1/empty", b"")
        assert store.get("v1/empty") == b""
        assert store.size("v1/empty") == 0

    def test_get_range(self) -> None:
        store = self.make_store()
        store.put("x", bytes(range(10)))
        assert store.get_range("x", 2, 5) == bytes([2, 3, 4])  # stop exclusive
        assert store.get_range("x", 0, 10) == bytes(range(10))
        assert store.get_range("x", 8, 100) == bytes([8, 9])  # clipped at the end
        assert store.get_range("x", 12, 20) == b""
        assert store.get_range("x", 5, 5) == b""
        assert store.get_range("x", 6, 3) == b""
        for start, stop in ((-1, 3), (0, -1)):
            with raises(UsageError, match=">= 0"):
                store.get_range("x", start, stop)

    def test_get_max_bytes(self) -> None:
        """`get(max_bytes=)`: what the caller expects at most; a larger object is refused."""
        store = self.make_store()
        store.put("v1/c0.whc", b"x" * 1000)
        assert store.get("v1/c0.whc", max_bytes=1000) == b"x" * 1000
        assert store.get("v1/c0.whc", max_bytes=5000) == b"x" * 1000
        with raises(LimitError, match=r"c0\.whc.*1000 bytes.*999"):
            store.get("v1/c0.whc", max_bytes=999)
        with raises(LimitError):
            store.get("v1/c0.whc", max_bytes=0)
        store.put("v1/empty", b"")
        assert store.get("v1/empty", max_bytes=0) == b""
        with raises(ObjectNotFound):
            store.get("v1/nope", max_bytes=10)
        bad: list[Any] = [-1, 1.5, True, "9"]
        for b in bad:
            with raises(UsageError, match="max_bytes"):
                store.get("v1/c0.whc", max_bytes=b)

    def test_size(self) -> None:
        store = self.make_store()
        store.put("a/b/c", b"x" * 1234)
        assert store.size("a/b/c") == 1234

    def test_children(self) -> None:
        store = self.make_store()
        assert store.children("") == []
        for key in ("v2/manifest.json", "v1/manifest.json", "v1/full-abc/c0.whc",
                    "v1/full-abc/c1.whc"):
            store.put(key, b"x")
        assert store.children("") == ["v1", "v2"]
        assert store.children("v1") == ["full-abc", "manifest.json"]
        assert store.children("v1/full-abc") == ["c0.whc", "c1.whc"]
        assert store.children("missing") == []
        assert store.children("v1/manifest.json") == []  # an object has no children

    def test_delete(self) -> None:
        store = self.make_store()
        store.put("v1/a", b"1")
        store.put("v1/b", b"2")
        store.delete("v1/a")
        with raises(ObjectNotFound):
            store.get("v1/a")
        store.delete("v1/a")  # absent: no error
        store.delete("never/there")
        assert store.children("v1") == ["b"]
        store.delete("v1/b")
        assert store.children("") == []  # nothing left behind

    def test_create_only(self) -> None:
        store = self.make_store()
        store.put("v1/manifest.json", b"first", create_only=True)
        with raises(ObjectExists, match=r"v1/manifest\.json"):
            store.put("v1/manifest.json", b"second", create_only=True)
        assert store.get("v1/manifest.json") == b"first"
        store.put("v1/plain", b"a")
        with raises(ObjectExists):
            store.put("v1/plain", b"b", create_only=True)
        assert store.get("v1/plain") == b"a"

    def test_missing(self) -> None:
        store = self.make_store()
        calls: list[Callable[[], object]] = [
            lambda: store.get("nope"), lambda: store.get_range("nope", 0, 1),
            lambda: store.size("nope"), lambda: store.get("a/b/c")]
        for call in calls:
            with raises(ObjectNotFound, match=r"nope|a/b/c"):
                call()

    def test_a_prefix_is_not_an_object(self) -> None:
        store = self.make_store()
        store.put("v1/c/x", b"1")
        for call in (lambda: store.get("v1/c"), lambda: store.get("v1/c/x/y"),
                     lambda: store.get_range("v1", 0, 1)):
            with raises(ObjectNotFound):
                call()

    def test_errors_are_store_errors(self) -> None:
        store = self.make_store()
        with raises(StoreError):
            store.get("nope")

    def test_invalid_keys(self) -> None:
        store = self.make_store()
        for key in BAD_KEYS:
            for call in _object_calls(store, key):
                with raises(UsageError, match="invalid store key"):
                    call()
            if key:  # '' is the root for children()
                with raises(UsageError):
                    store.children(key)
        assert store.children("") == []  # and nothing was written

    # -- concurrency -----------------------------------------------------------------------------
    def test_concurrent_create_only_threads(self) -> None:
        store = self.make_store()
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
        assert len(outcomes) == 8 and len(winners) == 1, outcomes
        assert store.get("v7/manifest.json") == f"writer {winners[0].split()[1]}".encode()

    def test_atomic_put(self) -> None:
        """Readers racing a writer see the old object or the new one, never a part or a mix."""
        store = self.make_store()
        size = 256 << 10
        versions = [bytes([i]) * size for i in range(4)]
        store.put("v1/obj", versions[0])
        seen: set[bytes] = set()
        bad: list[str] = []
        done = threading.Event()

        def read() -> None:
            while not done.is_set():
                data = store.get("v1/obj")
                if data not in versions:
                    bad.append(f"{len(data)} bytes, first {data[:1]!r} last {data[-1:]!r}")
                seen.add(data[:1])

        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            for i in range(1, 13):
                store.put("v1/obj", versions[i % len(versions)])
        finally:
            done.set()
            for t in readers:
                t.join(timeout=60)
        assert not bad, bad[:3]
        assert seen  # the readers did read

    # -- timeouts and errors ---------------------------------------------------------------------
    def test_timeout_keyword(self) -> None:
        """Every ability takes `timeout=` (seconds for this call) and works within it."""
        store = self.make_store()
        store.put("v1/a", b"abc", timeout=30.0)
        store.put("v1/m", b"m", create_only=True, timeout=30)
        assert store.get("v1/a", timeout=30.0) == b"abc"
        assert store.get_range("v1/a", 1, 3, timeout=30.0) == b"bc"
        assert store.size("v1/a", timeout=30.0) == 3
        assert store.children("v1", timeout=30.0) == ["a", "m"]
        store.delete("v1/a", timeout=30.0)
        store.delete("v1/m", timeout=None)  # None: the store's own default
        assert store.children("", timeout=None) == []

    def test_invalid_timeouts(self) -> None:
        store = self.make_store()
        store.put("k", b"x")
        for bad in BAD_TIMEOUTS:
            for call in _object_calls(store, "k", timeout=bad, children=True):
                with raises(UsageError, match="timeout"):
                    call()
        assert store.get("k") == b"x"  # nothing was written or deleted

    def test_errors_only_from_the_tree(self) -> None:
        """Whatever goes wrong, a store raises StoreError or UsageError: nothing else escapes."""
        store = self.make_store()
        store.put("v1/obj", b"x")
        attempts: list[Callable[[], object]] = [
            lambda: store.get("v1"), lambda: store.get("v1/obj/deeper"),
            lambda: store.size("v1/missing"), lambda: store.get_range("v1/obj", -5, 2),
            lambda: store.put("v1/obj", b"y", create_only=True),
            lambda: store.put("v1/obj/under-an-object", b"y"),
            lambda: store.get("v1/obj", timeout=-1.0), lambda: store.children("..")]
        for i, call in enumerate(attempts):
            try:
                call()
            except (StoreError, UsageError):
                pass
            except Exception as exc:
                raise AssertionError(f"attempt {i}: {type(exc).__name__} escaped the error tree: "
                                     f"{exc}") from exc


def _object_calls(store: Store, key: str, *, timeout: Any = None,
                  children: bool = False) -> list[Callable[[], object]]:
    """Every ability called on `key` (children: on the root too)."""
    calls: list[Callable[[], object]] = [
        lambda: store.get(key, timeout=timeout), lambda: store.size(key, timeout=timeout),
        lambda: store.get_range(key, 0, 1, timeout=timeout),
        lambda: store.put(key, b"x", timeout=timeout),
        lambda: store.put(key, b"x", create_only=True, timeout=timeout),
        lambda: store.delete(key, timeout=timeout)]
    if children:
        calls.append(lambda: store.children("", timeout=timeout))
    return calls


class StoreTimeoutTests(StoreTests):
    """StoreTests plus: a call that cannot complete ends in StoreTimeout within its timeout. For
    stores that wait on something (a server, a lock); implement `stalled_store()` too."""

    def stalled_store(self) -> tuple[Store, str]:
        """A store and a key whose `get` would never complete (called once per try)."""
        raise NotImplementedError("a StoreTimeoutTests subclass implements stalled_store()")

    def test_stalled_call_times_out(self) -> None:
        """A call that cannot complete ends in StoreTimeout about its timeout after it began."""
        for timeout in (0.5, 1.5):
            store, key = self.stalled_store()
            t0 = time.monotonic()
            with raises(StoreTimeout):
                store.get(key, timeout=timeout)
            took = time.monotonic() - t0
            assert took < timeout + self.timeout_slack_s, f"timeout={timeout}: took {took:.2f}s"
