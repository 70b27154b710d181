"""Suite-wide set-up: compile the numba kernels once, before the first test's clock starts.

The kernels are `@njit(cache=True)`: the first process to call one compiles it and writes the
machine code next to the module (`__pycache__`); every later process, the CLI and peer
subprocesses that tests start included, loads it in milliseconds. In a fresh clone nothing is
cached, and on a loaded 2-core machine that first compilation took longer than the per-test
timeout of whichever test happened to run first. Compiling here, in `pytest_sessionstart`, puts
it outside every test's timeout and makes each test's run time independent of test order.

The device backend's host decoders (receive/device.py) are warmed the same way.

The session has a temp directory of its own (`TMPDIR`, and Python's `tempfile` here), inherited
by every process a test starts, and removed at the end: what the parts we start write into the
system temp dir and never remove stays out of /tmp. A full suite used to leave there ~60 ZeroMQ
IPC sockets of vLLM engines (`VLLM_RPC_BASE_PATH`, default the temp dir), vLLM's
`vllm_dist_*` rendezvous files, three Ray sessions (/tmp/ray/session_*: Ray's default is
`$TMPDIR/ray`) and the caches of node daemons killed with SIGKILL (which cannot clean up). Our
own code must still remove what it makes (the tests of the demos and of SeaweedFS check theirs);
pytest's `tmp_path` directories stay where pytest keeps them (`PYTEST_DEBUG_TEMPROOT`).

The codec and digest wrappers hand every kernel one argument form per word width (issue 12:
the suite used to compile 87 variants for the codec tests alone, now 60), so exercising each
kernel once per width (`_warm_codec`, the context coder's in `_warm_ctx`) compiles everything any
test, CLI run, peer or fuzz target reaches (a fuzz target compiling inside its measured call
would breach its memory bound and deadline).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from typing import Any

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the `gpu` tests on a machine without CUDA (reported, never counted as run)."""
    import torch

    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config.hook.pytest_deselected(items=gpu)
        config.stash[_GPU_DESELECTED] = len(gpu)


_GPU_DESELECTED = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    n = config.stash.get(_GPU_DESELECTED, 0)
    if n:
        terminalreporter.write_line(f"{n} gpu test(s) deselected: no CUDA device on this machine "
                                    "(they run unchanged where torch.cuda.is_available())")


def _warm_kernels() -> float:
    """Publish a full version and deltas of every op and dtype family, sync a receiver through
    them: each kernel signature the suite reaches is compiled (or loaded from the cache)."""
    import torch

    from weighthub.publish import ENCODE_PROFILES, Publisher
    from weighthub.receive import Receiver
    from weighthub.store.memory import MemoryStore
    from weighthub.targets import StateDictTarget

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    base = {dtype: torch.randn(4096, generator=gen).to(dtype)
            for dtype in (torch.bfloat16, torch.float16, torch.float32)}
    for profile in ENCODE_PROFILES.values():
        store = MemoryStore()
        publisher = Publisher(store, policy=profile)
        receiver = Receiver(store, StateDictTarget({}))
        state = {f"w_{str(d).split('.')[-1]}": t.clone() for d, t in base.items()}
        state["ints"] = torch.arange(4096, dtype=torch.int64)
        for step in range(3):
            publisher.publish(state)
            receiver.sync()
            # small steps (xor/add), then a large rewrite of part of each tensor (overwrite/dense)
            state = {k: (v + 1 if k == "ints" else
                         (v.float() * (1 + 1e-3 * torch.randn(v.shape, generator=gen))).to(v.dtype))
                     for k, v in state.items()}
            if step == 1:
                state = {k: torch.where(torch.arange(v.numel()) < 1024, v * 3, v)
                         for k, v in state.items()}
    return time.perf_counter() - t0


# the numpy type of a torch word view of each width (the device decoder takes torch words)
_SIGNED = {1: "u1", 2: "i2", 4: "i4", 8: "i8"}


def _warm_codec() -> float:
    """Every codec and digest kernel once per word width (1, 2, 4, 8 bytes): each coding
    applied forwards (with and without digest sums), inversely and rolled back."""
    import numpy as np
    import torch

    from reference_codec import make_pair, ref_segment
    from weighthub.codec import (
        Positions,
        UndoLog,
        Values,
        apply_segment,
        changed_positions,
        encode_segment_tracked,
        regap_segment,
    )
    from weighthub.codec.digest import staged_old_digest
    from weighthub.digest import digest_affine, digest_bits
    from weighthub.receive.device import decode_segment
    from weighthub.tensors import DTYPE_BY_NAME

    t0 = time.perf_counter()
    for name in ("F8_E4M3", "BF16", "F32", "F64"):  # one float dtype per word width
        dtype = DTYPE_BY_NAME[name]
        old, new = make_pair(dtype, 0, 4096, 0.1)  # enough changes to try grouped positions
        changed_positions(old, new)
        encode_segment_tracked(old, new, dtype, tensor=0, start=0)
        ulps = old.copy()
        ulps[::7] += 1  # ±1 ulp steps: coded as add/zigzag varints
        encode_segment_tracked(old, ulps, dtype, tensor=0, start=0)
        digest_bits(old)
        digest_affine(old.reshape(64, 64)[:, 8:40], 8, (64, 1))  # a column block
        codings = [(p, v) for p in (Positions.GAPS, Positions.GROUPS, Positions.BITMAP)
                   for v in (Values.VARINT, Values.ZIGZAG, Values.RAW)]
        for positions, values in codings:
            seg = ref_segment(old, new, dtype, positions, values, 16)
            staged_old_digest(seg, old, dtype, "warm-up")
            regap_segment(seg, old, dtype, "warm-up")
            decode_segment(seg, torch.from_numpy(old.view(_SIGNED[dtype.width])), dtype, "warm-up")
            for sums in (False, True):
                dst, undo = old.copy(), UndoLog()
                kw = {"dnew": np.zeros(2, np.uint64), "dold": np.zeros(2, np.uint64)} if sums else {}
                apply_segment(seg, dst, dtype, undo, "warm-up", **kw)
                if seg.invertible:
                    apply_segment(seg, dst, dtype, UndoLog(), "warm-up", inverse=True, **kw)
                undo.rollback()
        _warm_ctx(old, ulps, dtype)
        dense, _ = encode_segment_tracked(None, new, dtype, tensor=0, start=0)
        assert dense is not None
        apply_segment(dense, old.copy(), dtype, UndoLog(), "warm-up",
                      dnew=np.zeros(2, np.uint64), dold=np.zeros(2, np.uint64))
    return time.perf_counter() - t0


def _warm_ctx(old: Any, new: Any, dtype: Any) -> None:
    """The context coders' kernels (ctx and ans) for this word width: encode, decode while
    staging, apply with and without digest sums, for both ops (on the first 256 elements: few enough exponent
    groups for any dtype, spec §2)."""
    import numpy as np
    import torch

    from weighthub.codec import Op, Positions, Segment, UndoLog, Values, apply_segment, regap_segment
    from weighthub.codec.ctx import ctx_streams
    from weighthub.codec.digest import staged_old_digest
    from weighthub.receive.device import decode_segment

    old, new = old[:256], new[:256]
    pos = np.flatnonzero(old != new)
    for op, coding in itertools.product((Op.XOR, Op.ADD), (Positions.CTX, Positions.ANS)):
        streams = ctx_streams(old, pos, old[pos], new[pos], dtype, op, coding)
        assert streams is not None
        seg = Segment(0, 0, old.size, op, coding, Values[coding.name], int(pos.size), *streams)
        staged_old_digest(seg, old, dtype, "warm-up")
        regap_segment(seg, old, dtype, "warm-up")
        decode_segment(seg, torch.from_numpy(old.view(_SIGNED[dtype.width])), dtype, "warm-up")
        for kw in ({}, {"dnew": np.zeros(2, np.uint64), "dold": np.zeros(2, np.uint64)}):
            undo = UndoLog()
            apply_segment(seg, old.copy(), dtype, undo, "warm-up", **kw)


_SESSION_TEMP = pytest.StashKey[tuple[str, dict[str, str | None], str | None]]()
_TEMP_VARS = ("TMPDIR", "PYTEST_DEBUG_TEMPROOT")


def _own_temp_dir(config: pytest.Config) -> None:
    """Point TMPDIR (and `tempfile`) at a new directory for the session; pytest's own stays."""
    system = tempfile.gettempdir()
    # short: unix socket paths under it (Ray's, 66 more characters; vLLM's, 37) fit in 107
    temp = tempfile.mkdtemp(prefix="wht-", dir=system)
    saved = {k: os.environ.get(k) for k in _TEMP_VARS}
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", system)
    os.environ["TMPDIR"] = temp
    config.stash[_SESSION_TEMP] = (temp, saved, tempfile.tempdir)
    tempfile.tempdir = temp


def pytest_sessionstart(session: pytest.Session) -> None:
    _own_temp_dir(session.config)
    if not session.config.option.collectonly:
        _warm_codec()
        _warm_kernels()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    got = session.config.stash.get(_SESSION_TEMP, None)
    if got is None:
        return
    temp, saved, tempdir = got
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    tempfile.tempdir = tempdir
    shutil.rmtree(temp, ignore_errors=True)
