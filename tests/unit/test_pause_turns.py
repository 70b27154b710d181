"""Pauses in turn (integrations.ray.pauses): one engine of a host pauses at a time; the next
waits (serving) until the lock is released, a dead holder releases it, and a stuck one costs
at most the timeout, after which the engine pauses without its turn and says so."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from weighthub.integrations.ray.pauses import pause_turn


def test_turns_are_exclusive_and_the_next_starts_right_after(tmp_path: Path) -> None:
    order: list[str] = []
    first_in = threading.Event()
    waited: list[float] = []

    def second() -> None:
        first_in.wait(5)
        with pause_turn(str(tmp_path)) as turn:
            order.append("second in")
            waited.append(turn.wait_s)
            assert turn.held

    t = threading.Thread(target=second)
    t.start()
    with pause_turn(str(tmp_path)) as turn:
        assert turn.held and turn.wait_s < 1.0
        first_in.set()
        time.sleep(0.3)  # the first engine's pause
        order.append("first out")
    released = time.perf_counter()
    t.join(5)
    assert order == ["first out", "second in"]
    assert 0.2 < waited[0] < 0.3 + (time.perf_counter() - released) + 0.05


def test_no_stage_dir_means_no_turns() -> None:
    with pause_turn(None) as turn:
        assert not turn.held and turn.wait_s == 0.0


def test_a_stuck_holder_costs_at_most_the_timeout(tmp_path: Path) -> None:
    with pause_turn(str(tmp_path)), pause_turn(str(tmp_path), timeout_s=0.2) as turn:
        assert not turn.held  # paused without its turn, and said so
        assert 0.2 <= turn.wait_s < 1.0


def test_a_holder_that_dies_releases_its_turn(tmp_path: Path) -> None:
    hold = ("import fcntl, os, sys, time\n"
            f"fd = os.open({str(tmp_path / 'pauses.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pause_turn(str(tmp_path), timeout_s=0.2) as turn:
            assert not turn.held  # another process holds it
        proc.kill()  # kill -9: the kernel drops its flock
        proc.wait(10)
        with pause_turn(str(tmp_path), timeout_s=5) as turn:
            assert turn.held and turn.wait_s < 1.0
    finally:
        proc.kill()
        proc.wait(10)
