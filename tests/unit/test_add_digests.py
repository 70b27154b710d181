"""Digest changes summed in one numpy pass (`digest.add_digests`, used by incremental
verification and by the publisher for thousands of small tensors): exactly what `digest_add`
gives change by change, wrapping mod 2^64 in each lane, and a digest of the wrong size refused
with nothing changed."""

from __future__ import annotations

import numpy as np
import pytest

from weighthub.digest import add_digests, digest_add
from weighthub.errors import UsageError


def _summed_both_ways(held: dict[str, bytes], changes: list[tuple[str, bytes]]
                      ) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """(add_digests of `changes` into a copy of `held`, digest_add of them one by one)."""
    expect = dict(held)
    for n, c in changes:
        expect[n] = digest_add(expect[n], c)
    got = dict(held)
    add_digests(got, changes)
    return got, expect


def test_vectorized_sums_equal_digest_add_one_by_one() -> None:
    rng = np.random.default_rng(0)
    names = [f"t{i}" for i in range(50)]
    held = {n: rng.integers(0, 1 << 64, 2, dtype=np.uint64).tobytes() for n in names}
    held["t3"] = np.full(2, (1 << 64) - 1, np.uint64).tobytes()  # wraps on any addition
    changes = [(names[int(ti)], rng.integers(0, 1 << 64, 2, dtype=np.uint64).tobytes())
               for ti in rng.integers(0, 50, 400)]  # several changes per tensor, unordered
    changes.append(("t3", np.full(2, 5, np.uint64).tobytes()))
    got, expect = _summed_both_ways(held, changes)
    assert got == expect
    assert got != held
    only = {"t": np.full(2, (1 << 64) - 1, np.uint64).tobytes()}
    add_digests(only, [("t", np.full(2, 5, np.uint64).tobytes())])
    assert only["t"] == np.full(2, 4, np.uint64).tobytes()  # each lane wrapped


def test_one_change_a_tensor_in_any_order_sums_as_digest_add() -> None:
    rng = np.random.default_rng(1)
    names = [f"t{i}" for i in range(40)]
    held = {n: rng.integers(0, 1 << 64, 2, dtype=np.uint64).tobytes() for n in names}
    changes = [(names[int(ti)], rng.integers(0, 1 << 64, 2, dtype=np.uint64).tobytes())
               for ti in rng.permutation(40)[:30]]  # distinct names, shuffled, some untouched
    got, expect = _summed_both_ways(held, changes)
    assert got == expect and got != held


def test_no_changes_leave_the_digests_alone() -> None:
    held = {"t0": bytes(16), "t1": bytes(range(16))}
    got = dict(held)
    add_digests(got, [])
    assert got == held


@pytest.mark.parametrize("bad", ["change", "held"])
def test_a_digest_of_the_wrong_size_is_refused_and_nothing_changes(bad: str) -> None:
    held = {n: bytes(16) for n in ("t0", "t1", "t2")}
    changes = [("t0", bytes(range(16))), ("t1", bytes(16))]
    if bad == "change":
        changes[1] = ("t1", bytes(15))
    else:
        held["t1"] = bytes(17)
    before = dict(held)
    with pytest.raises(UsageError, match="a digest is 16 bytes"):
        add_digests(held, changes)
    assert held == before
