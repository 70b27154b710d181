"""Incremental verification adds each step's digest changes to the held digests in one numpy
pass (`receive.verify._add_changes`): it must give exactly what `digest_add` gives change by
change, wrap mod 2^64 in each lane, and refuse a digest of the wrong size as `digest_add` does."""

from __future__ import annotations

import numpy as np
import pytest

from weighthub.digest import digest_add
from weighthub.errors import UsageError
from weighthub.receive.verify import _add_changes
from weighthub.tensors import TensorSpec, dtype_named


def _specs(n: int) -> list[TensorSpec]:
    return [TensorSpec(f"t{i}", dtype_named("BF16"), (4,)) for i in range(n)]


def test_vectorized_sums_equal_digest_add_one_by_one() -> None:
    rng = np.random.default_rng(0)
    specs = _specs(50)
    held = {s.name: rng.integers(0, 1 << 64, 2, dtype=np.uint64).tobytes() for s in specs}
    held["t3"] = np.full(2, (1 << 64) - 1, np.uint64).tobytes()  # wraps on any addition
    changes = [(int(ti), rng.integers(0, 1 << 64, 2, dtype=np.uint64).tobytes())
               for ti in rng.integers(0, 50, 400)]  # several changes per tensor, unordered
    changes.append((3, np.full(2, 5, np.uint64).tobytes()))
    expect = dict(held)
    for ti, c in changes:
        expect[specs[ti].name] = digest_add(expect[specs[ti].name], c)
    got = dict(held)
    _add_changes(got, specs, changes)
    assert got == expect
    assert got["t3"] != held["t3"]


def test_no_changes_leave_the_digests_alone() -> None:
    specs = _specs(2)
    held = {"t0": bytes(16), "t1": bytes(range(16))}
    got = dict(held)
    _add_changes(got, specs, [])
    assert got == held


@pytest.mark.parametrize("bad", ["change", "held"])
def test_a_digest_of_the_wrong_size_is_refused(bad: str) -> None:
    specs = _specs(3)
    held = {s.name: bytes(16) for s in specs}
    changes = [(0, bytes(16)), (1, bytes(16))]
    if bad == "change":
        changes[1] = (1, bytes(15))
    else:
        held["t0"] = bytes(17)
    with pytest.raises(UsageError, match="a digest is 16 bytes"):
        _add_changes(held, specs, changes)
