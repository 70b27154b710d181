"""The encoder's device backend: scan where the words live, code on the host.

For a range whose words are torch tensors (on a CUDA device; CPU tensors take this path only
when asked, in tests), the scan touching every word runs on the device (`codec.device`): change
detection, extraction of the changed positions and words, and the exponent-group ranks that
`groups` and `ctx` code positions with. Only those compact arrays cross to the host, where
`encode.encode_range` chooses and codes the segment exactly as it does for a host scan, so both
backends write byte-identical segments (format/spec.md §2) and digest changes (§4). The host
sees the range's words only when a dense segment is written (a full version, or a range where
nearly every word changed).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..digest import ZERO_DIGEST, digest_sub
from ..digest import device as digest_device
from ..digest.linear import digest_affine, digest_change
from ..errors import UsageError
from ..tensors import DType
from . import device as D
from .coding import EncodePolicy
from .encode import (
    DEFAULT_POLICY,
    RangeChanges,
    RankFn,
    _dense_segment,
    _scan_limit,
    encode_range,
)
from .scan import Changes
from .segment import Segment


def host_words(words: torch.Tensor, dtype: DType) -> np.ndarray:
    """The range's words as the host's unsigned numpy words (a copy from a device; a view of a
    CPU tensor)."""
    return words.detach().cpu().numpy().view(dtype.uint)


def device_ranks(old: torch.Tensor, dtype: DType,
                 changes: D.DeviceChanges | None = None) -> RankFn:
    """A RankFn (codec.encode) computing group keys and ranks on the device holding `old`: only
    the changed positions go up and their (key, rank) pairs come back. `changes`: the scan's
    result, whose positions are on the device already (used for the whole range)."""

    def ranks(lo: int, hi: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if changes is not None and lo == 0 and hi == old.shape[0] and pos.size == changes.pos.numel():
            dpos = changes.pos
        else:
            dpos = torch.from_numpy(np.ascontiguousarray(pos, np.int64)).to(old.device)
        with _device_passes:
            keys, rk = D.group_ranks(old[lo:hi], dpos, dtype.exponent_shift, dtype.exponent_mask)
            return keys.cpu().numpy().astype(np.uint64), rk.cpu().numpy()

    return ranks


# Device passes (scan, ranks) in flight at once, whatever the number of encoder threads: one
# device runs them one after another anyway, while each holds up to ~28 bytes of temporaries
# per slice element (codec/device_words.py: SLICE); more threads only add host coding, which
# is where they help. Bounds the publisher's device memory beyond its baseline to
# DEVICE_PASSES × that (~470 MB).
DEVICE_PASSES = 2
_device_passes = threading.BoundedSemaphore(DEVICE_PASSES)


def scan_range(old: torch.Tensor, new: torch.Tensor, dtype: DType, limit: int
               ) -> tuple[RangeChanges, D.DeviceChanges | None]:
    """The RangeChanges of one range scanned on its device (changes None past `limit`)."""
    with _device_passes:
        found = D.scan(old, new, limit)
        changes = None if found is None else Changes(*found.to_host())
    return RangeChanges(new.shape[0], changes, device_ranks(old, dtype, found),
                        lambda: host_words(new, dtype)), found


def encode_segment_tracked(old: torch.Tensor | None, new: torch.Tensor, dtype: DType, *,
                           tensor: int, start: int, policy: EncodePolicy = DEFAULT_POLICY
                           ) -> tuple[Segment | None, bytes]:
    """`codec.encode.encode_segment_tracked` for words on a device: the same segment and the
    same digest change, from a device scan."""
    if old is None:
        host = host_words(new, dtype)
        return _dense_segment(tensor, start, host), digest_affine(host, start, (1,), threads=1)
    rc, _found = scan_range(old, new, dtype, _scan_limit(new.shape[0]))
    if rc.changes is None:  # nearly every word changed: the difference of the ranges' digests
        change = digest_sub(digest_device.digest_affine(new, start, (1,)),
                            digest_device.digest_affine(old, start, (1,)))
    else:
        ch = rc.changes
        change = digest_change(ch.pos, ch.old, ch.new, first=start)
    return encode_range(rc, dtype, tensor=tensor, start=start, policy=policy), change


def encode_run(old: torch.Tensor | None, new: torch.Tensor, dtype: DType, *, tensor: int,
               start: int, policy: EncodePolicy = DEFAULT_POLICY, track: bool = True
               ) -> tuple[Segment | None, bytes]:
    """`encode_segment_tracked`, or without `track` the segment alone (and ZERO_DIGEST): an
    extra representation of a committed version knows its digests."""
    if track:
        return encode_segment_tracked(old, new, dtype, tensor=tensor, start=start, policy=policy)
    if old is None:
        return _dense_segment(tensor, start, host_words(new, dtype)), ZERO_DIGEST
    rc, _found = scan_range(old, new, dtype, _scan_limit(new.shape[0]))
    return encode_range(rc, dtype, tensor=tensor, start=start, policy=policy), ZERO_DIGEST


def changes_of(old: torch.Tensor, new: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, old words, new words) of every changed element, on the host."""
    with _device_passes:
        found = D.scan(old, new, old.shape[0])
        if found is None:  # cannot happen: the limit is every element
            raise UsageError("changes_of: the device scan gave up below its own length")
        return found.to_host()
