"""The torch digest (digest.device) gives the numba host kernels' bytes, bit for bit.

Every comparison runs on CPU tensors here and, where CUDA is present, on CUDA tensors too (the
`dev` parameter): word widths 1/2/4/8 under every dtype weighthub carries, special bit patterns,
`first` from 0 to near 2^63 (and negative: it wraps), empty tensors, chunked runs (SLICE made
tiny), strided, transposed and reversed placements, changes, and whole 3-D tensors.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bit_patterns import random_bits, special_patterns
from weighthub.digest import ZERO_DIGEST, digest_add
from weighthub.digest import device as D
from weighthub.digest import linear as L
from weighthub.errors import UsageError
from weighthub.tensors import DTYPE_BY_NAME, DTYPES, DType

# `gpu` tests are deselected without CUDA (tests/conftest.py); the skipif keeps them safe if run
# without that hook
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
FIRSTS = [0, 5, 2**40 + 3, 2**63 - 3, -7]  # the host takes int64 `first`; negative ones wrap
_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
# one dtype per word width, and the width's plain integer view
BY_WIDTH = {1: DTYPE_BY_NAME["F8_E4M3"], 2: DTYPE_BY_NAME["BF16"], 4: DTYPE_BY_NAME["F32"],
            8: DTYPE_BY_NAME["F64"]}


def _tensor(b: np.ndarray, dtype: DType, dev: str) -> torch.Tensor:
    """A tensor of `dtype` on `dev` holding the unsigned bit patterns b (any shape)."""
    t = torch.from_numpy(np.ascontiguousarray(b).view(_SIGNED[dtype.width]))
    return t.view(dtype.torch_dtype).to(dev)


def _bits(rng: np.random.Generator, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
    return random_bits(rng, dtype, int(np.prod(shape)), special_frac=0.3).reshape(shape)


@pytest.mark.parametrize("dev", DEVICES)
def test_golden_and_empty(dev: str) -> None:
    t = torch.arange(8, dtype=torch.int16, device=dev)
    assert D.tensor_digest(t).hex() == "f94d729b321b82f08aa3f0aa6080111d"
    for d in DTYPES:
        for shape in [(0,), (0, 3), (4, 0, 2)]:
            e = torch.empty(shape, dtype=d.torch_dtype, device=dev)
            assert D.tensor_digest(e) == ZERO_DIGEST == L.tensor_digest(e.cpu())
        lanes = D.lanes_run(torch.empty(0, dtype=d.torch_dtype, device=dev), 9)
        assert lanes.device.type == dev and lanes.dtype == torch.int64 and lanes.tolist() == [0, 0]
    none = torch.empty(0, dtype=torch.int64, device=dev)
    assert D.digest_change(none, none.to(torch.int16), none.to(torch.int16)) == ZERO_DIGEST


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_every_dtype_and_first_match_the_host(dtype: DType, dev: str) -> None:
    rng = np.random.default_rng(DTYPES.index(dtype))
    b = np.concatenate([special_patterns(dtype), random_bits(rng, dtype, 777, special_frac=0.3)])
    t = _tensor(b, dtype, dev)
    for first in FIRSTS:
        want = L.digest_affine(b, first, (1,))
        assert D.digest_affine(t, first, (1,)) == want
        assert D.lanes_bytes(D.lanes_run(t, first)) == want
        assert D.lanes_bytes(D.lanes_run(D.as_words(t), first)) == want  # the plain integer view
    assert D.tensor_digest(t) == L.tensor_digest(t.cpu()) == L.digest_bits(b)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_runs_and_blocks_across_many_chunks(width: int, dev: str, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """Chunk boundaries anywhere: runs not a multiple of the chunk, rows longer than a chunk
    (a block one dim down), and rows grouped several to a chunk."""
    dtype = BY_WIDTH[width]
    rng = np.random.default_rng(width)
    b = _bits(rng, dtype, (4, 6, 7))
    t = _tensor(b, dtype, dev)
    for chunk in (1, 2, 5, 7, 8, 43):
        monkeypatch.setattr(D, "SLICE", chunk)
        for n in (1, 4, 5, 6, 11, 101, b.size):
            flat = b.reshape(-1)[:n]
            assert D.digest_affine(t.reshape(-1)[:n], 2**40 + 3, (1,)) == \
                L.digest_affine(flat, 2**40 + 3, (1,))
        assert D.tensor_digest(t) == L.digest_bits(b)
        # no two dims merge here: three levels of chunking
        view, host = t[:, 1:, ::2], b[:, 1:, ::2]
        strides = (42, 7, 2)
        assert D.digest_affine(view, 7, strides) == L.digest_affine(host, 7, strides)
        assert D.digest_affine(t.permute(2, 0, 1), 0, (1, 42, 7)) == L.digest_bits(b)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_strided_transposed_reversed_and_zero_strides(width: int, dev: str) -> None:
    dtype = BY_WIDTH[width]
    rng = np.random.default_rng(10 + width)
    rows, cols = 13, 17
    b = _bits(rng, dtype, (rows, cols))
    t = _tensor(b, dtype, dev)
    cases: list[tuple[Any, int, tuple[int, ...]]] = [
        (np.s_[:, 3:11], 3, (cols, 1)),  # a column block (a tensor-parallel shard)
        (np.s_[5:9], 5 * cols, (cols, 1)),  # a row block
        (np.s_[1::2, ::3], cols, (2 * cols, 3)),  # strided in both dims
        (np.s_[:], rows * cols - 1, (-cols, -1)),  # placed in reverse: wrapping strides
        (np.s_[:], 2**63 - 3, (0, 1)),  # every row at the same canonical indexes
        (np.s_[2:4], -100, (-(2**62), 2**62 + 1)),  # strides whose products wrap mod 2^64
    ]
    for idx, first, strides in cases:
        assert D.digest_affine(t[idx], first, strides) == L.digest_affine(b[idx], first, strides)
    whole = L.digest_bits(b)
    assert D.digest_affine(t.T, 0, (1, cols)) == whole  # a column-major placement
    assert D.tensor_digest(t.T) == L.tensor_digest(t.T.cpu())
    # memory strides of 0 (an expanded row): every element reads the same words
    row = t[2]
    assert D.digest_affine(row.expand(4, cols), 1, (cols, 1)) == \
        L.digest_affine(np.broadcast_to(b[2], (4, cols)), 1, (cols, 1))
    # a 0-D tensor is one element at `first`
    assert D.digest_affine(t[3, 4], 11, ()) == L.digest_affine(b[3, 4:5], 11, (1,))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_changes_match_the_host_and_compose(dtype: DType, dev: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(100 + DTYPES.index(dtype))
    old = random_bits(rng, dtype, 3000, special_frac=0.3)
    new = old.copy()
    pos = np.sort(rng.choice(old.size, 120, replace=False))
    new[pos] = random_bits(rng, dtype, pos.size, special_frac=0.3)
    t_old, t_new = _tensor(old, dtype, dev), _tensor(new, dtype, dev)
    t_pos = torch.from_numpy(pos).to(dev)
    # gathered through the integer view (indexing may lack kernels for fp8), then back as dtype
    was = D.as_words(t_old)[t_pos].view(dtype.torch_dtype)
    now = D.as_words(t_new)[t_pos].view(dtype.torch_dtype)
    for first in FIRSTS:
        want = L.digest_change(pos, old[pos], new[pos], first=first)
        assert D.digest_change(t_pos, was, now, first=first) == want
        assert D.lanes_bytes(D.lanes_at(now, t_pos, first)) == L.digest_at(new, pos, first)
    change = D.digest_change(t_pos, was, now)
    assert D.tensor_digest(t_new) == digest_add(D.tensor_digest(t_old), change)
    # any integer index dtype, and across chunks of the index
    monkeypatch.setattr(D, "SLICE", 7)
    assert D.digest_change(t_pos.to(torch.int32), was, now) == change


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_three_d_tensors_digest_as_their_cpu_copies(dtype: DType, dev: str) -> None:
    rng = np.random.default_rng(200 + DTYPES.index(dtype))
    t = _tensor(_bits(rng, dtype, (5, 6, 7)), dtype, dev)
    for view in (t, t.permute(2, 0, 1), t[:, ::2, 1:], t.transpose(0, 1)[1:, :, ::3]):
        assert D.tensor_digest(view) == L.tensor_digest(view.cpu())


@pytest.mark.parametrize("dev", DEVICES)
@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), width=st.sampled_from([1, 2, 4, 8]),
       first=st.one_of(st.sampled_from([0, 5, 2**40 + 3, 2**63 - 1000, -7]),
                       st.integers(-(2**62), 2**62)),
       chunk=st.sampled_from([1, 2, 3, 7, 1 << 22]), data=st.data())
def test_any_view_of_any_block_matches_the_host(dev: str, shape: list[int], width: int, first: int,
                                                chunk: int, data: st.DataObject) -> None:
    """A sliced, strided, permuted view of a tensor placed at `first`: the same bytes as the host
    on the same numpy view, whatever the chunk length."""
    dtype = BY_WIDTH[width]
    rng = np.random.default_rng(len(shape) * 1000 + sum(shape) + width)
    b = _bits(rng, dtype, tuple(shape))
    t = _tensor(b, dtype, dev)
    canon = [int(np.prod(shape[j + 1:])) for j in range(len(shape))]  # row-major placement
    index, strides, offset = [], [], first
    for n, c in zip(shape, canon, strict=True):
        start = data.draw(st.integers(0, n - 1))
        step = data.draw(st.integers(1, 3))
        index.append(slice(start, None, step))
        strides.append(step * c)
        offset += start * c
    perm = data.draw(st.permutations(range(len(shape))))
    view, host = t[tuple(index)].permute(*perm), b[tuple(index)].transpose(perm)
    placed = tuple(strides[p] for p in perm)
    saved = D.SLICE
    D.SLICE = chunk  # not monkeypatch: a function-scoped fixture is shared by all examples
    try:
        assert D.digest_affine(view, offset, placed) == L.digest_affine(host, offset, placed)
    finally:
        D.SLICE = saved


@pytest.mark.parametrize("dev", DEVICES)
def test_bad_arguments_are_refused(dev: str) -> None:
    w = torch.zeros(6, dtype=torch.int16, device=dev)
    idx = torch.arange(6, device=dev)
    with pytest.raises(UsageError, match="element width"):
        D.lanes_run(torch.zeros(3, dtype=torch.complex128, device=dev), 0)
    with pytest.raises(UsageError, match="2 strides for a 1-D block"):
        D.lanes_affine(w, 0, (1, 1))
    with pytest.raises(UsageError, match="must be 1-D"):
        D.lanes_run(w.view(2, 3), 0)
    with pytest.raises(UsageError, match="equal 1-D shapes"):
        D.lanes_change(idx, w, w[:5], 0)
    with pytest.raises(UsageError, match="equal 1-D shapes"):
        D.lanes_at(w.view(2, 3), idx.view(2, 3), 0)
    with pytest.raises(UsageError, match="integer tensor"):
        D.lanes_at(w, idx.to(torch.float32), 0)
    with pytest.raises(UsageError, match=r"int64\[2\]"):
        D.lanes_bytes(torch.zeros(3, dtype=torch.int64, device=dev))
    with pytest.raises(UsageError, match="not supported"):
        D.tensor_digest(torch.zeros(3, dtype=torch.complex64, device=dev))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lanes_stay_on_the_device_without_a_host_sync() -> None:
    """Only lanes_bytes copies to the host: the lanes functions queue work and return."""
    dtype = BY_WIDTH[2]
    b = _bits(np.random.default_rng(0), dtype, (64, 48))
    t = _tensor(b, dtype, "cuda")
    pos = torch.arange(0, 64 * 48, 5, device="cuda")
    flat = t.reshape(-1)
    old = D.as_words(flat)[pos]
    new = old ^ 0x5A5A
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lanes = [D.lanes_affine(t[:, 8:40], 8, (48, 1)), D.lanes_run(flat, 3),
                 D.lanes_change(pos, old, new, 0)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(x.device.type == "cuda" for x in lanes)
    assert D.lanes_bytes(lanes[0]) == L.digest_affine(b[:, 8:40], 8, (48, 1))


def test_importing_the_module_does_not_import_numba() -> None:
    code = "import sys, weighthub.digest.device; sys.exit('numba' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=120).returncode == 0
