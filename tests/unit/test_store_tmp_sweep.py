"""Temporary files a killed writer leaves in a LocalStore are swept; a live writer's never are
(issue #17, item 6: `.tmp-*` left by a publisher killed mid-write)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weighthub.errors import UsageError
from weighthub.sources.staging import StagingSource
from weighthub.store import LocalStore
from weighthub.store.local import STALE_TMP_S, open_temporary

# A publisher's chunk write that stalls after its first MiB (os.write slowed in the child only),
# so the parent can look at it alive, then kill -9 it mid-write.
_WRITER = """
import os, sys, time
from weighthub.store import LocalStore
real = os.write
def stalled(fd, data):
    n = real(fd, data[:1 << 20])
    print("writing", flush=True)
    time.sleep(600)
    return n
os.write = stalled
LocalStore(sys.argv[1]).put("v000000000001/full-abc/c000000.whc", b"x" * (4 << 20))
"""


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "store")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def temporaries(root: Path) -> list[Path]:
    return sorted(root.rglob(".tmp-*"))


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_killed_writers_temporary_is_swept_live_ones_are_not(
        tmp_path: Path, writer: subprocess.Popen[str]) -> None:
    root = tmp_path / "store"
    store = LocalStore(root)
    [tmp] = temporaries(root)
    assert tmp.stat().st_size == 1 << 20
    age(tmp, 3600)
    assert store.sweep_temporaries() == 0 and tmp.exists()  # alive: its lock is held
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    assert temporaries(root) == [tmp]  # what kill -9 leaves behind
    store.put("v000000000002/manifest.json", b"{}")  # the next publish's first write sweeps
    assert temporaries(root) == []
    assert store.children("v000000000001/full-abc") == []
    assert store.get("v000000000002/manifest.json") == b"{}"


def test_fresh_unlocked_temporary_is_left(tmp_path: Path) -> None:
    """A file a writer created an instant ago and has not locked yet looks like a dead one but
    for its age: only files untouched for STALE_TMP_S are swept."""
    store = LocalStore(tmp_path / "store")
    fresh = store.root / ".tmp-fresh"
    fresh.write_bytes(b"partial")
    assert store.sweep_temporaries() == 0 and fresh.exists()
    age(fresh, STALE_TMP_S + 1)
    assert store.sweep_temporaries() == 1 and not fresh.exists()


def test_sweep_leaves_what_is_not_a_writers_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    with pytest.raises(UsageError, match="reserved"):  # no object can be taken for one
        store.put("v/.tmp-looks-like-one", b"data")
    fifo = store.root / ".tmp-fifo"
    os.mkfifo(fifo)
    link = store.root / ".tmp-link"
    link.symlink_to("/dev/zero")
    fd, held = open_temporary(store.root)  # a live writer in this process
    try:
        for p in (fifo, held):
            age(p, 3600)
        store.sweep_temporaries()
        assert fifo.exists() and link.is_symlink() and held.exists()
    finally:
        os.close(fd)
        held.unlink()


def test_staging_sweeps_killed_receivers_temporaries(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    (stage / "3").mkdir(parents=True)
    dead = stage / "3" / ".tmp-dead"
    dead.write_bytes(b"half a chunk")
    age(dead, 3600)
    StagingSource(stage)
    assert not dead.exists()
