"""BaseGuard: a stat against the node's last commit every time, all digests on a schedule.

A touch that changes no bit is re-recorded (no finding); a flipped byte whose size and mtime
were restored shows by its ctime and is confirmed by the digests; a change no stat sees is
found when the full check is due, not before.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch

from weighthub.cluster.baseguard import BaseGuard, rematerializing
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore
from weighthub.targets import SafetensorsTarget, StateDictTarget
from weighthub.tensors import bits


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(4096, generator=g).to(torch.bfloat16), "b": torch.randn(300, generator=g)}


def synced_file(tmp_path: Path) -> tuple[SafetensorsTarget, BaseGuard, Path]:
    store = MemoryStore()
    Publisher(store).publish(state())
    target = SafetensorsTarget(tmp_path / "m.safetensors")
    Receiver(store, target).sync()
    guard = BaseGuard(target, every_versions=0, every_s=0)
    held = target.held()
    assert held is not None
    guard.committed(held)
    return target, guard, target.path


def flip(path: Path) -> None:
    st = path.stat()
    with path.open("r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n + 100)
        b = f.read(1)
        f.seek(8 + n + 100)
        f.write(bytes([b[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime


def test_a_touch_that_changes_no_bit_is_re_recorded(tmp_path: Path) -> None:
    _, guard, path = synced_file(tmp_path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # ctime moves, bits do not
    assert guard.check() is None and guard.full_checks == 1
    assert guard.check() is None and guard.full_checks == 1  # recorded: no second full pass


def test_a_flip_with_size_and_mtime_restored_is_found_by_its_stat(tmp_path: Path) -> None:
    _, guard, path = synced_file(tmp_path)
    flip(path)
    found = guard.check()
    assert found is not None and found.check == "stat" and found.version == 0, found
    assert "modified outside weighthub" in found.detail


def test_a_change_no_stat_sees_is_found_when_the_full_check_is_due() -> None:
    store = MemoryStore()
    Publisher(store).publish(state())
    target = StateDictTarget({})
    Receiver(store, target).sync()
    guard = BaseGuard(target, every_versions=2, every_s=0)
    held = target.held()
    assert held is not None
    guard.committed(held)
    bits(target.state["a"])[7] ^= 1
    assert guard.check() is None  # one commit since the last full check: not due
    guard.committed(held)
    found = guard.check()
    assert found is not None and found.check == "full", found


def test_rematerializing_makes_the_file_refused_until_rewritten(tmp_path: Path) -> None:
    target, _, path = synced_file(tmp_path)
    flip(path)
    via = rematerializing(target)
    assert isinstance(via, SafetensorsTarget) and via.held() is None  # rewritten afresh
    assert rematerializing(StateDictTarget({})) is None
