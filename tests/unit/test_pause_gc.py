"""nogc: no cyclic garbage collection inside a transaction (the pause), a staging or a publish,
and the collector's own switch restored after them, whatever their end."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator

import pytest
import torch

from weighthub.errors import IntegrityError, ObjectExists
from weighthub.nogc import collections_deferred
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import StateDictTarget


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


class _Watching(StateDictTarget):
    """Records whether the collector was on at each point the engine calls the target."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.seen: list[tuple[str, bool]] = []
        self.fail_commit = False
        super().__init__(state)

    def peek(self):  # type: ignore[no-untyped-def]
        self.seen.append(("peek", gc.isenabled()))
        return super().peek()

    def open(self, specs):  # type: ignore[no-untyped-def]
        self.seen.append(("open", gc.isenabled()))
        return super().open(specs)

    def commit(self, held):  # type: ignore[no-untyped-def]
        self.seen.append(("commit", gc.isenabled()))
        if self.fail_commit:
            raise IntegrityError("injected: the commit fails")
        super().commit(held)

    def abort(self) -> None:
        self.seen.append(("abort", gc.isenabled()))
        super().abort()


def _published(versions: int) -> MemoryStore:
    store = MemoryStore()
    pub = Publisher(store)
    state = {"w": torch.arange(4096, dtype=torch.int16).view(torch.bfloat16).clone()}
    for v in range(versions):
        state["w"].view(torch.int16)[v::97] += 1
        pub.publish(state)
    return store


def test_the_collector_is_off_inside_a_staging_and_a_transaction_and_on_after_them() -> None:
    store = _published(2)
    target = _Watching({})
    target.seen.clear()  # the constructor's own peek
    Receiver(store, target).sync(0)
    assert [p for p, _on in target.seen] == ["open", "peek", "commit"]  # open peeks itself
    assert not any(on for _p, on in target.seen)
    target.seen.clear()
    rx = Receiver(store, target)
    staged = rx.stage(1)
    assert target.seen == [("peek", False)]  # staging reads the held bits through peek
    assert gc.isenabled()
    target.seen.clear()
    rx.apply(staged)
    assert [p for p, _on in target.seen] == ["open", "peek", "commit"]
    assert not any(on for _p, on in target.seen)
    assert gc.isenabled()


def test_a_failed_transaction_turns_the_collector_back_on() -> None:
    store = _published(2)
    target = _Watching({})
    target.seen.clear()  # the constructor's own peek
    Receiver(store, target).sync(0)
    target.fail_commit = True
    with pytest.raises(IntegrityError, match="injected"):
        Receiver(store, target).sync(1)
    assert target.seen[-2:] == [("commit", False), ("abort", False)]
    assert not any(on for _p, on in target.seen)
    assert gc.isenabled()
    assert target.held() is not None and target.held().version == 0  # rolled back


class _WatchingStore(MemoryStore):
    """Records whether the collector was on at each write."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []
        self.fail = False

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False,
            timeout: float | None = None) -> None:
        self.seen.append(gc.isenabled())
        if self.fail:
            raise ObjectExists(f"injected: {key} exists")
        super().put(key, data, create_only=create_only, timeout=timeout)


def test_the_collector_is_off_inside_a_publish_and_on_after_it_whatever_its_end() -> None:
    store = _WatchingStore()
    pub = Publisher(store)
    state = {"w": torch.zeros(4096, dtype=torch.bfloat16)}
    pub.publish(state)
    assert store.seen and not any(store.seen)
    assert gc.isenabled()
    store.fail = True
    state["w"][::7] = 1.0
    with pytest.raises(ObjectExists, match="injected"):
        pub.publish(state)
    assert gc.isenabled()


def test_a_collector_switched_off_by_the_caller_stays_off() -> None:
    store = _published(1)
    gc.disable()
    Receiver(store, _Watching({})).sync(0)
    assert not gc.isenabled()


def test_overlapping_pauses_turn_it_back_on_when_the_last_one_ends() -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with collections_deferred():
            first_in.set()
            assert second_in.wait(10)
        first_out.set()

    def second() -> None:
        assert first_in.wait(10)
        with collections_deferred():
            second_in.set()
            assert first_out.wait(10)
            seen["after the first ended"] = gc.isenabled()
        seen["after both"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"after the first ended": False, "after both": True}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_process_forked_inside_a_section_has_its_collector_on() -> None:
    with collections_deferred():
        pid = os.fork()
        if pid == 0:  # the child: its parent's section is not its own
            os._exit(0 if gc.isenabled() else 1)
        assert not gc.isenabled()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
