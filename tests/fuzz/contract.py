"""The contract every fuzz target is held to, whatever bytes it is given.

1. The parser returns a valid result or raises a `WeighthubError` (errors.py's tree); any other
   exception (RecursionError, OverflowError, ValueError, UnicodeError, …) is a violation.
2. No hang: each call runs under a deadline (SIGALRM, generous: a hang is unbounded, a parse of
   a few kilobytes takes milliseconds even on a loaded machine).
3. Bounded memory: the Python-side peak (tracemalloc; numpy and zstandard buffers are traced
   too) stays under the target's stated bound, a function of the input's size.

A violation raises `ContractViolation` (an AssertionError, so pytest and hypothesis report and
shrink it) naming the target, the original exception and where it was raised.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import traceback
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

from weighthub.errors import WeighthubError

DEADLINE_S = 20.0  # per call; the pytest-timeout of the whole test stays the backstop


class ContractViolation(AssertionError):
    """A target broke the contract (see the module docstring).

    `signature` tells distinct bugs apart (the nightly script keeps one input per signature):
    the foreign exception's type and where it was raised, or which check failed.
    """

    def __init__(self, message: str, signature: str = "") -> None:
        super().__init__(message)
        self.signature = signature or message.split(":")[0]


class _Hang(BaseException):
    """Raised by the deadline's alarm; a BaseException so no `except Exception` swallows it."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise _Hang in the block after `seconds` (main thread only; elsewhere, and for C loops
    the alarm cannot interrupt, only checked after).

    Saves and restores any alarm already armed (pytest-timeout's), minus the time spent here.
    """
    start = time.monotonic()
    main = threading.current_thread() is threading.main_thread()
    if main:
        def on_alarm(signum: int, frame: Any) -> None:
            raise _Hang

        old_handler = signal.signal(signal.SIGALRM, on_alarm)
        old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay:
                left = max(old_delay - (time.monotonic() - start), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left, old_interval)
    if time.monotonic() - start > seconds:  # a C loop the alarm could not interrupt
        raise _Hang


def raised_at(exc: BaseException) -> str:
    """'file:line' of the innermost frame of `exc`'s traceback (where it was raised)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename}:{f.lineno}"


def run_target(name: str, fn: Callable[[bytes], object], data: bytes, *,
               memory_bound: int) -> object:
    """Call `fn(data)` under the contract; its result, or None when it refused the input.

    An input over its memory bound or deadline is run once more: a target's first call may
    load or compile code (numba kernels: tens of MB, seconds), which a second call does not
    repeat; what the input itself costs, it costs again.
    """
    try:
        return _run_once(name, fn, data, memory_bound)
    except _Costly:
        pass
    try:
        return _run_once(name, fn, data, memory_bound)
    except _Costly as again:
        raise ContractViolation(str(again), again.signature) from None


class _Costly(ContractViolation):
    """Over the memory bound or the deadline (confirmed by a second run before it counts)."""


def _run_once(name: str, fn: Callable[[bytes], object], data: bytes, memory_bound: int) -> object:
    what = f"target {name} on {len(data)} bytes"
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    try:
        with deadline(DEADLINE_S):
            result = fn(data)
    except WeighthubError:
        result = None
    except _Hang:
        raise _Costly(f"{what}: no result after {DEADLINE_S:g} s (a hang)",
                      f"{name}: hang") from None
    except ContractViolation:
        raise
    except Exception as exc:
        at = raised_at(exc)
        raise ContractViolation(f"{what} raised {type(exc).__name__} at {at}: {exc!s:.300}",
                                f"{name}: {type(exc).__name__} at {at}") from exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        if not tracing:
            tracemalloc.stop()
    if peak - base > memory_bound:
        raise _Costly(f"{what} allocated {peak - base} bytes, over its bound {memory_bound}",
                      f"{name}: memory")
    return result
