"""Exponent-group ranks on a device, and their inverse (the context of `groups` and `ctx`
positions, format/spec.md §2), in plain torch ops: exactly kernels.group_ranks and the placement
pass of place.ctx_place (both codings'), for words wherever they live.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import UsageError
from . import device_words as W


def _sorted_slice(words: torch.Tensor, shift: int, mask: int, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, start) of a slice: a stable sort of its keys; start[k] = first sorted index of
    key k (size mask + 2, the last = the slice's length), so key k's elements in position
    order are order[start[k]:start[k + 1]]."""
    keys = W.keys_of(words, shift, mask, dtype)
    sorted_keys, order = torch.sort(keys, stable=True)
    # arange(mask + 1) fits the key dtype (chosen from mask); searching the sorted keys is
    # O(mask log n) and gives the counts too, with no histogram pass
    bounds = torch.arange(mask + 1, device=words.device).to(dtype)
    start = torch.searchsorted(sorted_keys, bounds)
    return order, torch.cat([start, start.new_full((1,), words.shape[0])])


def group_ranks(old: torch.Tensor, pos: torch.Tensor | np.ndarray, shift: int, mask: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group key and rank of each changed position, as kernels.group_ranks.

    key = (old[p] >> shift) & mask on the zero-extended word; rank = #{i < p : key_i = key}.

    Algorithm, per slice of SLICE elements up to the last change, carrying per-key counts
    across slices: a stable sort of the slice's keys (in the narrowest integer type: on a GPU
    a radix sort does one pass per key byte, so one for every 8-bit exponent) lists each key's
    elements in position order, so an element's rank within the slice is its sorted index
    minus its key's first sorted index (a binary search of the sorted keys, which also gives
    the slice's per-key counts); the inverse permutation (one int64 scatter) finds the sorted
    index of each changed position. Counting by the sort rather than by a histogram keeps the
    loop free of host syncs (see the module docstring).

    Cost per slice: a key pass, the sort of (key, int64 index) pairs, one scatter, O(changed)
    gathers; slices past the last change are not read. Temporaries ~28 bytes per slice element
    plus O(changed), and O(mask) for the counts. One host sync per call (validating `pos` and
    locating its slice boundaries), none in the loop.

    Args:
        old: 1-D word tensor (the old bits of the range).
        pos: strictly increasing int64 positions < len(old) (tensor or numpy), any device.
        shift, mask: the key field (tensors.DType.exponent_shift / exponent_mask).

    Returns:
        (keys, ranks): int64 tensors on old's device, one per position.

    Raises:
        UsageError: a bad word tensor, key field, or positions not strictly increasing within
            the range.
    """
    where = "device.group_ranks"
    W.check_words(old, "old", where)
    size = W.check_field(shift, mask, where)
    dev = old.device
    pos = W.index_tensor(pos, dev, "pos", where)
    n, count, step = old.shape[0], pos.shape[0], W.sort_slice(dev)
    kdtype = W.key_dtype(mask)
    if count == 0:
        return pos.new_zeros(0), pos.new_zeros(0)
    nslices = -(-n // step)
    edges = torch.arange(nslices + 1, device=dev).mul_(step).clamp_(max=n)
    bad = (pos[0] < 0) | (pos[-1] >= n) | (pos[1:] <= pos[:-1]).any()
    info = torch.cat([bad.view(1).to(torch.int64), torch.searchsorted(pos, edges)]).tolist()
    if info[0]:
        raise UsageError(f"{where}: positions not strictly increasing within 0..{n - 1}")
    bounds = info[1:]
    keys = W.keys_of(old[pos], shift, mask, torch.int64)
    ranks = torch.empty(count, dtype=torch.int64, device=dev)
    carry = torch.zeros(size, dtype=torch.int64, device=dev)  # per key: elements before the slice
    ramp = None
    for s in range(nslices):
        a, b = bounds[s], bounds[s + 1]
        if a == count:  # past the last change
            break
        lo, hi = s * step, min(n, (s + 1) * step)
        order, start = _sorted_slice(old[lo:hi], shift, mask, kdtype)
        if b > a:
            if ramp is None:
                ramp = torch.arange(min(n, step), device=dev)
            inverse = torch.empty_like(order).index_copy_(0, order, ramp[:hi - lo])
            kc = keys[a:b]
            ranks[a:b] = carry[kc] + inverse[pos[a:b] - lo] - start[kc]
        if b < count:
            carry += start[1:] - start[:-1]
    return keys, ranks


def place_ranks(base: torch.Tensor, shift: int, mask: int, gkey: torch.Tensor | np.ndarray,
                gstart: torch.Tensor | np.ndarray, ranks: torch.Tensor | np.ndarray
                ) -> torch.Tensor | None:
    """Positions of group-major (key, rank) entries in `base`: the inverse of group_ranks.

    Group g holds entries gstart[g] .. gstart[g+1]-1, each a rank among the elements of base
    whose key ((word >> shift) & mask) is gkey[g]; entry t's position is that element's index.
    Positions are distinct when the (key, rank) pairs are (ctx and groups streams code ranks
    strictly increasing within a group); groups may come in any key order.

    Algorithm: a slice's stable key sort (as group_ranks) lists each key's elements in
    position order, so the r-th element of key k in a slice is order[start[k] + r]. One slice
    (the common case): one check and one gather. Longer tensors: the entries are sorted once by
    (key, rank); slice by slice, with c[k] the elements of key k before the slice, the entries
    landing in the slice are, for each key, the contiguous run of sorted entries with rank in
    [c[k], c[k] + count in the slice), found by binary search; they are gathered (their number
    is the one host sync per slice) and placed. An entry no slice takes (a rank past its key's
    elements) makes the result None. Slices past the last entry are not read.

    Cost: one sort per slice up to the last entry, O(entries log entries) once, O(mask) per
    slice. Temporaries ~18 bytes per slice element plus O(entries).

    Args:
        base: 1-D word tensor (the bits the entries rank against; read only).
        shift, mask: the key field.
        gkey: int64 key of each group; gstart: int64 group starts, len(gkey) + 1 of them, from 0
            to len(ranks), nondecreasing; ranks: int64 entries. Tensors (any device) or numpy.

    Returns:
        int64 positions on base's device in the entries' order, or None if some rank is
        negative or not below its key's element count in base (a hostile stream).

    Raises:
        UsageError: a bad word tensor or key field, or a malformed group table (gstart).
    """
    where = "device.place_ranks"
    W.check_words(base, "base", where)
    size = W.check_field(shift, mask, where)
    dev = base.device
    keys_h = W.index_tensor(gkey, torch.device("cpu"), "gkey", where)  # tiny: checked on the host
    starts_h = W.index_tensor(gstart, torch.device("cpu"), "gstart", where)
    r = W.index_tensor(ranks, dev, "ranks", where)
    count, n, step = r.shape[0], base.shape[0], W.sort_slice(dev)
    sizes = starts_h[1:] - starts_h[:-1]
    if starts_h.shape[0] != keys_h.shape[0] + 1 or int(starts_h[0]) != 0 \
            or int(starts_h[-1]) != count or bool((sizes < 0).any()):
        raise UsageError(f"{where}: group starts must run from 0 to {count} (the entries), "
                         f"nondecreasing, one more than the {keys_h.shape[0]} keys")
    if count == 0:
        return r.new_zeros(0)
    if bool(((keys_h < 0) | (keys_h >= size))[sizes > 0].any()):
        return None  # a key no element of base can have
    kdtype = W.key_dtype(mask)
    # the group table goes up without a sync (from pageable memory the copy is staged before
    # the call returns); output_size spares repeat_interleave its own sync
    ek = torch.repeat_interleave(keys_h.to(dev, non_blocking=True),
                                 sizes.to(dev, non_blocking=True), output_size=count)
    if n <= step:
        order, start = _sorted_slice(base, shift, mask, kdtype)
        have = start[1:] - start[:-1]
        if bool(((r < 0) | (r >= have[ek])).any()):
            return None
        return order[start[ek] + r]
    # (key, rank) as one sortable int64, key·(n+1) + rank; a rank outside 0..n-1 could pass for
    # another key's, so those get -1, which no slice's runs (all ≥ 0) take
    v = torch.where((r >= 0) & (r < n), ek * (n + 1) + r, -1)
    v_sorted, by_v = torch.sort(v)
    key_ids = torch.arange(size, device=dev)
    key_base = key_ids * (n + 1)
    before = torch.zeros(size, dtype=torch.int64, device=dev)  # per key: elements before the slice
    first = torch.searchsorted(v_sorted, key_base)  # per key: its first sorted entry not placed yet
    out = torch.empty(count, dtype=torch.int64, device=dev)
    placed = 0
    for lo in range(0, n, step):
        order, start = _sorted_slice(base[lo:lo + step], shift, mask, kdtype)
        upto = before + (start[1:] - start[:-1])
        stop = torch.searchsorted(v_sorted, key_base + upto)
        runs = stop - first
        m = int(runs.sum())  # the one sync per slice: how many entries land here
        if m:
            kk = torch.repeat_interleave(key_ids, runs, output_size=m)
            at = torch.arange(m, device=dev) - (torch.cumsum(runs, 0) - runs)[kk] + first[kk]
            e = by_v[at]
            out.index_copy_(0, e, order[start[kk] + r[e] - before[kk]] + lo)
            placed += m
            if placed == count:
                return out
        before, first = upto, stop
    return None  # some entry is past its key's elements
