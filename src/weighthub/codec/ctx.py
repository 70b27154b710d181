"""The context-coded segment codings (format/spec.md §2): the streams of a sparse xor/add
segment coded against the old words' exponents, by the adaptive binary range coder (`ctx`,
codec.ctx_kernels) or by rANS with multi-symbol models (`ans`, codec.ans_kernels, the default).
Both code the same information (exponent-group keys, ranks within the group, value entries).

`ctx_streams` builds either coding's streams from a scan's compacted changes (work ∝ changed
elements, plus one pass over the old words to rank each change within its exponent group);
`decode_changes` decodes a context-coded segment against the base words into its positions and
values as coded (what a receiver's staging prepares the pause's words from, `codec.prepared`);
`decode_ctx` re-codes those as plain gaps and varint/zigzag values, for the paths that apply
or digest a gap-coded segment; `decode_ranks` stops before the placement, for a base held on a
device.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import FormatError, UsageError
from ..tensors import DType, readonly
from . import ans_kernels as A
from . import ctx_kernels as C
from . import kernels as K
from .ans import min_symbol_bits
from .coding import CONTEXT_CODINGS, Op, Positions, Values
from .place import ctx_place
from .ranks import ranks_of_changes
from .segment import Segment, check_status

# A stream of L bytes cannot hold more changes than this many per byte; a reader refuses a larger
# declared count before allocating anything for it. ctx: a coded decision costs at least
# −log2(1 − P_MIN/P_TOTAL) bits (the probability clamp), a change at least one position decision
# and four value decisions (with margin). ans: a change codes at least one quotient symbol and one
# value head symbol, each costing at least ans.min_symbol_bits of its alphabet (the value head's
# smallest alphabet is 8-bit floats'); decoding one shrinks a state (≥ 2^16) by at least 15/16
# of that many bits.
MAX_CHANGES_PER_VALUE_BYTE = 512
MAX_CHANGES_PER_POSITION_BYTE = 2048
ANS_CHANGES_PER_POSITION_BYTE = int(8 / min_symbol_bits(A.Q_ALPHABET) * 16 / 15) + 1
ANS_CHANGES_PER_VALUE_BYTE = int(8 / min_symbol_bits(A.head_alphabet.py_func(8)) * 16 / 15) + 1
_CHANGES_PER_BYTE = {Positions.CTX: (MAX_CHANGES_PER_POSITION_BYTE, MAX_CHANGES_PER_VALUE_BYTE),
                     Positions.ANS: (ANS_CHANGES_PER_POSITION_BYTE, ANS_CHANGES_PER_VALUE_BYTE)}


def ctx_streams(old: np.ndarray, pos: np.ndarray, oldv: np.ndarray, newv: np.ndarray,
                dtype: DType, op: Op, coding: Positions = Positions.CTX
                ) -> tuple[np.ndarray, np.ndarray] | None:
    """(positions, values) streams of a context coding (`coding`: Positions.CTX or ANS) for
    these changes of the range `old`, or None where they span more exponent groups than a ctx
    reader models (C.MAX_VALUE_CONTEXTS; ans has no such limit).

    Args:
        old: the range's old words (all of them: ranks count every element of a group).
        pos: changed positions in the range (int64, strictly increasing); oldv/newv their words.
        op: XOR or ADD (the values are old ^ new, or the zigzag of new − old).
    """
    if op not in (Op.XOR, Op.ADD) or not dtype.is_float:
        raise UsageError(f"ctx coding takes xor/add on a float dtype, not {op.name} on {dtype.name}")
    keys, ranks = group_ranks(old, pos, dtype)
    return ctx_streams_ranked(keys, ranks, oldv, newv, dtype, op, coding)


def group_ranks(old: np.ndarray, pos: np.ndarray, dtype: DType) -> tuple[np.ndarray, np.ndarray]:
    """(keys uint64, ranks int64) of changed positions `pos` (strictly increasing) of the range
    `old`: each one's old exponent and its rank among the range's elements of that exponent
    (the context both `groups` and `ctx` code positions in; codec/device.py does it on a device).

    Raises UsageError for positions not increasing or out of range.
    """
    count = int(pos.size)
    keys = np.empty(count, np.uint64)
    ranks = np.empty(count, np.int64)
    done = ranks_of_changes(readonly(old), readonly(pos.astype(np.int64, copy=False)), count,
                            dtype.exponent_shift, np.uint64(dtype.exponent_mask), keys, ranks)
    if done != count:
        raise UsageError("grouped positions: positions not increasing or out of range")
    return keys, ranks


def ctx_streams_ranked(keys: np.ndarray, ranks: np.ndarray, oldv: np.ndarray, newv: np.ndarray,
                       dtype: DType, op: Op, coding: Positions = Positions.CTX
                       ) -> tuple[np.ndarray, np.ndarray] | None:
    """`ctx_streams` from the changes' group keys and ranks (`group_ranks`, on the host or a
    device) instead of the range's old words: work ∝ changed elements only."""
    if op not in (Op.XOR, Op.ADD) or not dtype.is_float or coding not in CONTEXT_CODINGS:
        raise UsageError(f"context coding takes xor/add on a float dtype with coding ctx or ans, "
                         f"not {op.name} on {dtype.name} with {coding.name}")
    count = int(keys.size)
    bits = 8 * dtype.width
    if coding == Positions.ANS:
        return A.ans_encode(keys, ranks, readonly(oldv), readonly(newv), count,
                            dtype.exponent_mask + 1, op == Op.XOR, np.uint64((1 << bits) - 1),
                            bits - 1)
    if np.count_nonzero(np.bincount(keys.astype(np.int64), minlength=1)) * \
            int(C.value_layout(bits)[2]) > C.MAX_VALUE_CONTEXTS:
        return None  # more exponent groups than a reader models (64-bit floats only; spec §2)
    mask, sign_shift = np.uint64((1 << bits) - 1), bits - 1
    cap_pos, cap_val = 64 + count * 2 + 64 * (dtype.exponent_mask + 1), 64 + count * 2
    while True:
        pos_out, val_out = np.empty(cap_pos, np.uint8), np.empty(cap_val, np.uint8)
        plen, vlen = C.ctx_encode(keys, ranks, readonly(oldv), readonly(newv), count,
                                  dtype.exponent_mask + 1, op == Op.XOR, mask, sign_shift,
                                  pos_out, val_out)
        if plen <= cap_pos and vlen <= cap_val:
            return pos_out[:plen], val_out[:vlen]
        cap_pos, cap_val = 2 * cap_pos + 8 * count, 2 * cap_val + 8 * count


def check_ctx_count(seg: Segment, where: str) -> None:
    """Refuse a context-coded segment declaring more changes than its streams can code
    (spec §2)."""
    per_pos, per_val = _CHANGES_PER_BYTE[seg.positions]
    if seg.count > per_val * seg.val_bytes.size or seg.count > per_pos * seg.pos_bytes.size:
        raise FormatError(f"{where}: a {seg.positions.name.lower()} segment declares {seg.count} "
                          f"changes in {seg.pos_bytes.size}+{seg.val_bytes.size} stream bytes; at "
                          f"most {per_val} per value byte and {per_pos} per position byte fit")


def decode_ranks(seg: Segment, dtype: DType, where: str
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decode a context-coded segment without its base words: (group keys, group starts, ranks,
    value entries), the ranks and entries group-major (group g's are [starts[g], starts[g+1])).
    What is left is the placement against the base (`place.ctx_place`, or on a device).

    Raises:
        FormatError: a count its streams cannot hold (refused before allocating for it), or
            corrupt or hostile streams.
    """
    check_ctx_count(seg, where)
    count, size = seg.count, dtype.exponent_mask + 1
    gkey, gstart = np.empty(size, np.int64), np.zeros(size + 1, np.int64)
    ranks, zs = np.empty(count, np.int64), np.empty(count, np.uint64)
    decode = A.ans_decode_ranks if seg.positions == Positions.ANS else C.ctx_decode_ranks
    ngroups = int(decode(seg.numel, size, 8 * dtype.width, readonly(seg.pos_bytes),
                         readonly(seg.val_bytes), count, gkey, gstart, ranks, zs))
    check_status(ngroups, where)
    return gkey[:ngroups], gstart[:ngroups + 1], ranks, zs


def decode_changes(seg: Segment, base: np.ndarray, dtype: DType,
                   where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The positions (int64, increasing), the values as coded (uint64: the XOR, or the zigzag
    difference of an add) and the words of `base` there (base's type) of a context-coded
    segment, placed against `base` (the range's words the segment applies to; read only).

    Raises:
        FormatError: corrupt or hostile streams (refused before any work proportional to a
            declared count that the streams cannot hold).
    """
    gkey, gstart, ranks, zs = decode_ranks(seg, dtype, where)
    count = seg.count
    pos = np.empty(count, np.int64)
    z = np.empty(count, np.uint64)
    old = np.empty(count, base.dtype)
    status = ctx_place(readonly(base), dtype.exponent_shift, np.uint64(dtype.exponent_mask),
                       gkey, gstart, gkey.size, ranks, zs, pos, z, old)
    check_status(int(status), where)
    return pos, z, old


def decode_ctx(seg: Segment, base: np.ndarray, dtype: DType, where: str) -> Segment:
    """The same segment with its context-coded streams (ctx or ans) re-coded as plain gaps and
    varint/zigzag values, decoded against `base` (the range's words the segment applies to;
    read only). Any other segment is returned as it is.

    Raises:
        FormatError: corrupt or hostile streams (refused before any work proportional to a
            declared count that the streams cannot hold).
    """
    if seg.positions not in CONTEXT_CODINGS:
        return seg
    pos, z, _ = decode_changes(seg, base, dtype, where)
    count = seg.count
    gaps = np.empty(10 * count + 16, np.uint8)
    glen = K.encode_gaps(readonly(pos), count, gaps)
    vals = np.empty(10 * count + 16, np.uint8)
    vlen = K.encode_varints(readonly(z), count, vals)
    return replace(seg, positions=Positions.GAPS,
                   values=Values.VARINT if seg.op == Op.XOR else Values.ZIGZAG,
                   pos_bytes=gaps[:glen], val_bytes=vals[:vlen])
