"""The receiver's device backend: segments decoded on the host, applied where the words live.

For a tensor whose view is a torch word view (a CUDA tensor; a CPU one with backend "torch"):

    stage (off the pause)  the segment's streams are checked and decoded on the host into
                           compact arrays: positions in the range (int64) and values as coded
                           (uint64) — the same refusals as the host kernels, in the same order.
                           Exponent-grouped and context-coded positions are ranks within the old
                           words' exponent groups: the host decodes the ranks, the device places
                           them against the base words it holds (`codec.device.place_ranks`)
    pause                  positions and values go to the device; the old words are gathered,
                           combined and scattered back, and the digest change Σ mix(new) −
                           mix(old) folded on the device from the words in hand (not read back,
                           as on the host); dense ranges are copied. The undo log keeps the old
                           words in pinned host memory (copied down asynchronously, next to the
                           staged positions it shares), so the device holds one segment's
                           temporaries at a time, not O(changed) for the whole transaction

Nothing of the tensor comes to the host: only the compact arrays go up, and one digest pair
per chunk comes back. The bits that result are the host kernels' (tests compare them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..codec import device as D
from ..codec import kernels as K
from ..codec.apply import group_table
from ..codec.coding import CONTEXT_CODINGS, Op, Positions, check_coding
from ..codec.ctx import check_ctx_count, decode_ranks
from ..codec.segment import Segment, UndoLog, bitmap_positions, check_status
from ..digest import device as digest_device
from ..errors import FormatError, UsageError
from ..tensors import DType, readonly


@dataclass(frozen=True, slots=True)
class DeviceSegment:
    """A segment decoded for the device: what to write where, already checked.

    pos: changed positions in [0, numel) (increasing; int32 where numel ≤ 2^31, as for every
        segment of the default chunk spans), None for dense.
    z: the values as coded (XOR, zigzag difference or raw word; int32 holding their low
        B + 1 bits for words of B ≤ 16 bits, which is all `codec.device.combine` reads of them,
        int64 holding the uint64 otherwise), or for dense the new words (the dtype's torch
        word view).
    Both are host tensors, in pinned memory when decoded for a CUDA target (the pause's copies
    to the device then run asynchronously): 8 bytes a change for bf16, where int64 positions
    and values would be 16, and the copy up is the pause's largest cost after the scatter.
    old_lanes: Σ mix(i, held word) over what the segment rewrites (int64[2] on the device),
        when it was decoded against the held words while staging; the pause then folds only
        the new words' half of the digest change.
    """

    tensor: int
    start: int
    stop: int
    op: Op
    pos: torch.Tensor | None
    z: torch.Tensor
    old_lanes: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(slots=True)
class DeviceUndo:
    """The old words one device apply replaced, on the host: at `pos` (host int64 positions in
    dst; None: all of dst). Copied down without blocking; a restore is queued behind that copy
    on the same stream, so it reads them complete."""

    dst: torch.Tensor
    pos: torch.Tensor | None
    old: torch.Tensor

    def restore(self) -> None:
        old = self.old.to(self.dst.device, non_blocking=True)
        if self.pos is None:
            self.dst.copy_(old)
        else:
            D.restore(self.dst, self.pos.to(self.dst.device, torch.int64, non_blocking=True), old)

    @property
    def nbytes(self) -> int:
        n = self.old.numel() * self.old.element_size()
        return n + (0 if self.pos is None else self.pos.numel() * self.pos.element_size())


def _saved(words: torch.Tensor) -> torch.Tensor:
    """A host copy of device words for the undo log (pinned, asynchronous, from CUDA)."""
    if not words.is_cuda:
        return words.clone()
    out = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
    return out.copy_(words, non_blocking=True)


def decode_segment(seg: Segment, base: torch.Tensor | None, dtype: DType, where: str, *,
                   pinned: bool = False, held: bool = False) -> DeviceSegment:
    """Check and decode `seg` into arrays for the device (see the module doc).

    Args:
        base: the range's current words on the device (read only), needed by exponent-grouped
            and context-coded positions; None where the caller has none (then such a segment is
            refused).
        pinned: decode into pinned host memory (for a CUDA target).
        held: `base` holds the words the segment will rewrite (the route's first step, staged):
            sum their digest lanes now (`old_lanes`), off the pause.

    Raises:
        FormatError: a coding the format forbids, a count outside the range, or corrupt streams.
        UsageError: grouped or ctx positions without base words, or base words of the wrong size.
    """
    check_coding(seg.op, seg.positions, seg.values, where, is_float=dtype.is_float)
    n = seg.numel
    if seg.op == Op.DENSE:
        if seg.count != n or seg.pos_bytes.size:
            raise FormatError(f"{where}: a dense segment of {n} elements with count "
                              f"{seg.count} and {seg.pos_bytes.size} position bytes (must be "
                              f"{n} and 0)")
        if seg.val_bytes.size != n * dtype.width:
            raise FormatError(f"{where}: dense segment has {seg.val_bytes.size} bytes, "
                              f"expected {n * dtype.width}")
        words = _host(n, dtype.torch_words, pinned)
        words.numpy().view(dtype.uint)[:] = seg.val_bytes.view(dtype.uint)
        return DeviceSegment(seg.tensor, seg.start, seg.stop, seg.op, None, words)
    if not 0 <= seg.count <= n:
        raise FormatError(f"{where}: {seg.count} changes in a range of {n} elements")
    if seg.positions in CONTEXT_CODINGS:
        check_ctx_count(seg, where)  # before anything the count sizes is allocated
    count, width = seg.count, dtype.width
    z = np.empty(count, np.uint64)
    if seg.positions in (Positions.GAPS, Positions.BITMAP):
        if seg.positions == Positions.GAPS:
            pos = np.empty(count, np.int64)
            check_status(int(K.decode_gap_stream(readonly(seg.pos_bytes), int(seg.values),
                                                 readonly(seg.val_bytes), count, n, width, pos,
                                                 z)), where)
        else:
            pos = bitmap_positions(seg, where)
            check_status(int(K.decode_value_stream(int(seg.values), readonly(seg.val_bytes),
                                                   count, width, z)), where)
        pt = _compact_positions(pos, n, pinned)
        old_lanes = _held_lanes(base, pt, seg.start) if held else None
        return DeviceSegment(seg.tensor, seg.start, seg.stop, seg.op, pt,
                             _compact_values(z, dtype, pinned), old_lanes)
    if base is None or base.numel() != n:
        raise UsageError(f"{where}: {seg.positions.name.lower()} positions need the range's "
                         f"{n} base words on the device"
                         + ("" if base is None else f", got {base.numel()}"))
    if seg.positions == Positions.GROUPS:
        gkey, counts, offset = group_table(seg, dtype, where)
        ranks = np.empty(count, np.int64)
        check_status(int(K.decode_group_ranks(counts, readonly(seg.pos_bytes[offset:]), count,
                                              n, ranks)), where)
        check_status(int(K.decode_value_stream(int(seg.values), readonly(seg.val_bytes), count,
                                               width, z)), where)
        gstart = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        group_major_values = False  # a grouped segment's values run in position order
    else:  # context-coded (check_coding allows no other)
        gkey, gstart, ranks, z = decode_ranks(seg, dtype, where)
        group_major_values = True
    placed = D.place_ranks(base, dtype.exponent_shift, dtype.exponent_mask, gkey, gstart, ranks)
    if placed is None:
        raise FormatError(f"{where}: corrupt segment: a group rank is past its exponent group's "
                          "elements in the base words")
    # back to position order (the undo log and the digest fold do not need it; the values of a
    # grouped segment are in it): the sorted positions come back to the host, so that staged
    # versions hold no device memory until the pause
    placed, order = torch.sort(placed)
    old_lanes = _held_lanes(base, placed, seg.start) if held else None
    pt = _host(count, _position_type(n), pinned)
    pt.copy_(placed)
    if group_major_values:
        z = z[order.cpu().numpy()]
    return DeviceSegment(seg.tensor, seg.start, seg.stop, seg.op, pt,
                         _compact_values(z, dtype, pinned), old_lanes)


def _position_type(n: int) -> torch.dtype:
    """int32 for the positions of a segment of n elements where they fit (every segment of the
    default chunk spans, 16-32 MiB: half the bytes to copy up), else int64."""
    return torch.int32 if n <= 1 << 31 else torch.int64


def _compact_positions(pos: np.ndarray, n: int, pinned: bool) -> torch.Tensor:
    """int64 positions in a segment of n elements as host memory of `_position_type(n)`."""
    out = _host(pos.size, _position_type(n), pinned)
    out.numpy()[:] = pos
    return out


def _compact_values(z: np.ndarray, dtype: DType, pinned: bool) -> torch.Tensor:
    """Decoded values as the pause uploads them: for words of B ≤ 16 bits, their low B + 1 bits
    in int32 (xor and overwrite keep the low B bits of z, add and sub the low B + 1 of a zigzag
    value: `codec.device.combine`), else the uint64 values as int64."""
    bits = 8 * dtype.width
    if bits > 16:
        out = _host(z.size, torch.int64, pinned)
        out.numpy().view(np.uint64)[:] = z
        return out
    out = _host(z.size, torch.int32, pinned)
    out.numpy()[:] = z & np.uint64((1 << (bits + 1)) - 1)
    return out


def _held_lanes(base: torch.Tensor | None, pos: torch.Tensor, start: int) -> torch.Tensor | None:
    """Σ mix(start + p, base[p]) over positions `pos` (host or device), on base's device."""
    if base is None:
        return None
    dpos = pos.to(base.device, non_blocking=True)
    return digest_device.lanes_at(base[dpos], dpos, start)


def apply_segment(dseg: DeviceSegment, dst: torch.Tensor, dtype: DType, undo: UndoLog, *,
                  inverse: bool, fold: bool, where: str) -> torch.Tensor | None:
    """Apply a decoded segment in place to `dst` (the torch words of exactly its range).

    The undo record is appended before any word is written, so a failure at any point rolls
    back exactly. Returns the digest change's two lanes (int64[2] on dst's device) when `fold`,
    else None.

    Raises:
        UsageError: dst is not the segment's range in the dtype's words.
        FormatError: inverse on a segment that is not invertible (before touching dst).
    """
    if dst.numel() != dseg.numel or dst.element_size() != dtype.width:
        raise UsageError(f"{where}: destination of {dst.numel()} {dst.dtype} words for a "
                         f"segment of {dseg.numel} {dtype.name} elements")
    if dseg.pos is None:
        src = dseg.z.to(dst.device, non_blocking=True)
        before = None
        if not undo.fresh:
            undo.entries.append(DeviceUndo(dst, None, _saved(dst)))
            if fold:  # the old half of the digest change, before the words are overwritten
                before = digest_device.lanes_run(dst, dseg.start)
        dst.copy_(src)
        if not fold:
            return None
        lanes = digest_device.lanes_run(src, dseg.start)
        return lanes if before is None else lanes - before
    op = int(dseg.op)
    if inverse:
        if dseg.op not in (Op.XOR, Op.ADD):
            raise FormatError(f"{where}: a {dseg.op.name.lower()} segment cannot be applied "
                              "inversely (only xor/add with gaps or bitmap positions can)")
        op = D.OP_SUB if dseg.op == Op.ADD else op
    pos = dseg.pos.to(dst.device, non_blocking=True)
    z = dseg.z.to(dst.device, non_blocking=True).to(torch.int64)
    old = dst[pos]
    undo.entries.append(DeviceUndo(dst, dseg.pos, _saved(old)))
    new = D.combine(old, z, op, 8 * dtype.width)
    dst.index_put_((pos,), new)
    if not fold:
        return None
    if dseg.old_lanes is not None:  # the held words' half was summed while staging
        return digest_device.lanes_at(new, pos, dseg.start) - dseg.old_lanes
    return digest_device.lanes_change(pos, old, new, dseg.start)


def lanes_to_digests(lanes: Sequence[torch.Tensor]) -> list[bytes]:
    """The digest bytes of device lane pairs, with one copy to the host for all of them."""
    if not lanes:
        return []
    host = torch.stack([x.to(lanes[0].device) for x in lanes]).cpu().numpy().astype("<i8")
    return [row.tobytes() for row in host]


def _host(count: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    return torch.empty(count, dtype=dtype, pin_memory=pinned)
