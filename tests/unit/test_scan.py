"""The host change scan against numpy: every changed element, its old and new word, in order.

`scan_blocks` compares 64 elements at a time (any word width, any alignment), `scan_tail` the
elements after the last whole block and short ranges element by element, and the outputs grow
when more than 1/32 of the elements changed; each of those paths is exercised here, bit for
bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from weighthub.codec.scan import changed_positions
from weighthub.codec.scan import scan_range as _scan


def _pair(dtype: type, n: int, rate: float, offset: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    base = rng.integers(0, int(info.max), n + offset, dtype=dtype, endpoint=True)
    new = base.copy()
    hit = rng.random(n + offset) < rate
    flips = rng.integers(1, int(info.max), int(hit.sum()), dtype=dtype, endpoint=True)
    new[hit] ^= flips  # a nonzero XOR: every hit is a change
    return base[offset:], new[offset:]  # an offset slice: heads not on a word boundary


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("rate", [0.0, 0.001, 0.03, 0.2, 1.0])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_the_scan_lists_exactly_the_changed_elements(dtype: type, rate: float, offset: int) -> None:
    n = 50_000 + 7  # a tail past the last whole word, more than one scan chunk
    old, new = _pair(dtype, n, rate, offset, seed=int(rate * 1000) + offset)
    want = np.flatnonzero(old != new)
    changes = _scan(old, new, n)
    assert changes is not None
    assert np.array_equal(changes.pos, want)
    assert np.array_equal(changes.old, old[want]) and np.array_equal(changes.new, new[want])
    assert np.array_equal(changed_positions(old, new), want)


def test_a_scan_over_its_limit_gives_up() -> None:
    old, new = _pair(np.uint16, 10_000, 0.5, 0, seed=1)
    assert _scan(old, new, 100) is None


@pytest.mark.parametrize("n", [1, 7, 576, 4096, 4097])
@pytest.mark.parametrize("rate", [0.0, 0.03, 1.0])
def test_short_ranges_list_exactly_the_changed_elements(n: int, rate: float) -> None:
    # up to _ELEMENTWISE_SCAN elements the scan goes element by element (norms, biases); the
    # first length past it takes the word-wide path: both must agree with numpy
    old, new = _pair(np.uint16, n, rate, 1, seed=n)
    want = np.flatnonzero(old != new)
    changes = _scan(old, new, n)
    assert changes is not None
    assert np.array_equal(changes.pos, want)
    assert np.array_equal(changes.old, old[want]) and np.array_equal(changes.new, new[want])
    if want.size:
        assert _scan(old, new, want.size - 1) is None  # one over the limit gives up
