"""The kernel that codes every small range of a chunk in one call (`codec.small`).

For each range it does what `encode.encode_range` does for a range of at most SMALL_RANGE
elements: the element-wise scan, the digest change, the value coding chosen by the same
estimates, the `ans` context coding where encode_range tries it (`compact` where small ranges do
not share their chunk's zstd table), gaps or a bitmap by the same estimates, and the smallest
of those or dense. It calls the very kernels that path calls, in the same order, so every
estimate, choice and byte is the same; a range whose changes reach the grouped coding's minimum
(without a context coding) is left to `encode_range` (FALLBACK), as is one whose every element
changed under a context coding (encode_range's `_CTX_SURE` shortcut). The ranges' words are
reached through their addresses (`words_at`): thousands of arrays cannot be passed to one call
any other way without copying them.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..digest.kernels import sum_change
from ..kernel_cache import njit
from . import kernels as K
from .ans_kernels import ans_encode
from .coding import Op, Positions, Values

# what became of each range (CONTEXT: a SPARSE range coded `ans`)
NOTHING, SPARSE, DENSE, FALLBACK, CONTEXT = 0, 1, 2, 3, 4

_ADD, _XOR, _OVERWRITE = int(Op.ADD), int(Op.XOR), int(Op.OVERWRITE)
_ZIGZAG, _VARINT, _RAW = int(Values.ZIGZAG), int(Values.VARINT), int(Values.RAW)
_GAPS, _BITMAP = int(Positions.GAPS), int(Positions.BITMAP)
_ANS, _ANS_VALUES = int(Positions.ANS), int(Values.ANS)
INVERTIBLE_SLACK = 4  # encode._INVERTIBLE_SLACK: bytes sparse may cost beyond dense
CTX_SURE = 4096  # encode._CTX_SURE: changes from which encode_range takes its shortcut


@intrinsic
def _pointer(typingctx, address):
    """An int64 address as a void pointer (for numba.carray)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def words_at(address, n, proto):
    return numba.carray(_pointer(address), n, proto.dtype)


@njit(cache=True, nogil=True, boundscheck=False)
def code_small_ranges(olds, news, sizes, starts, proto, mask, sign_shift, mask_ops, value_sample,
                      group_min, context, shift, gmask, kinds, codings, counts, lengths, lanes,
                      out):
    """Code ranges i = 0..len(sizes)-1; returns the bytes of `out` used.

    olds, news: int64 addresses of range i's old and new words (C-contiguous, `proto`'s dtype,
        `sizes[i]` each); the caller keeps the arrays alive.
    starts: each range's first canonical element (the digest's positions).
    mask, sign_shift: `encode.width_masks` of the words' width. mask_ops: xor/add allowed.
    value_sample: EncodePolicy.value_sample. group_min: changes from which grouped positions
        are a candidate (those ranges are FALLBACK); -1 where they never are.
    kinds[i]: NOTHING (no change), SPARSE, DENSE or FALLBACK. codings[i]: (op, positions,
        values) of a SPARSE range. counts[i]: its changes. lengths[i]: its position and value
        stream bytes, laid in `out` one range after another (position stream, then values).
    lanes[i]: += its digest change's lane sums (every range with a change, FALLBACK included).
    out: at least Σ sizes[i] × width + INVERTIBLE_SLACK bytes.
    """
    m = sizes.shape[0]
    width = proto.itemsize
    nmax = 1
    for i in range(m):
        nmax = max(nmax, sizes[i])
    pos = np.empty(nmax, np.int64)
    ov = np.empty(nmax, proto.dtype)
    nv = np.empty(nmax, proto.dtype)
    gaps = np.empty(nmax * 10 + 16, np.uint8)
    bitmap = np.empty((nmax + 7) // 8, np.uint8)
    vals = np.empty(nmax * 10 + 16, np.uint8)
    keys = np.empty(nmax, np.uint64)
    ranks = np.empty(nmax, np.int64)
    cpos = cval = np.empty(0, np.uint8)
    used = 0
    for i in range(m):
        n = sizes[i]
        k = K.scan_tail(words_at(olds[i], n, proto), words_at(news[i], n, proto), 0, n, pos, ov, nv, 0)
        counts[i] = k
        if k == 0:
            kinds[i] = NOTHING
            continue
        sum_change(pos[:k], ov[:k], nv[:k], starts[i], lanes[i])
        # values: encode._pick_values
        stride = max(1, k // value_sample) if value_sample > 0 else 1
        scale = k / ((k + stride - 1) // stride)
        add, xor, raw = K.value_estimates(ov, nv, k, stride, mask, sign_shift, scale)
        op, vc = _OVERWRITE, _RAW
        if mask_ops:
            op, vc, best = _ADD, _ZIGZAG, add
            if xor < best:
                op, vc, best = _XOR, _VARINT, xor
            if raw < best:
                op, vc = _OVERWRITE, _RAW
        # the context coding: encode._ctx_segment (none for overwrites)
        clen = -1
        if context and op != _OVERWRITE:
            if k >= CTX_SURE:
                kinds[i] = FALLBACK
                continue
            K.group_ranks(words_at(olds[i], n, proto), pos, k, shift, gmask, keys, ranks)
            cpos, cval = ans_encode(keys, ranks, ov, nv, k, int(gmask) + 1, op == _XOR, mask,
                                    sign_shift)
            clen = cpos.shape[0] + cval.shape[0]
        elif 0 <= group_min <= k:
            kinds[i] = FALLBACK
            continue
        # positions: encode._position_candidates (gaps; a bitmap where more than 1 in 16 changed)
        g = K.encode_gaps(pos, k, gaps)
        pc, plen = _GAPS, g
        if k * 16 > n:
            nb = (n + 7) // 8
            bitmap[:nb] = 0
            for t in range(k):
                p = pos[t]
                bitmap[p >> 3] |= np.uint8(1 << (p & 7))
            if K.stream_estimate(bitmap[:nb]) < K.stream_estimate(gaps[:g]):
                pc, plen = _BITMAP, nb
        vlen = K.encode_values(ov, nv, k, vc, mask, sign_shift, vals)
        if 0 <= clen < min(plen + vlen, n * width):  # a small range compares what it writes
            plen = cpos.shape[0]
            out[used:used + plen] = cpos
            out[used + plen:used + clen] = cval
            kinds[i] = CONTEXT
            codings[i, 0], codings[i, 1], codings[i, 2] = op, _ANS, _ANS_VALUES
            lengths[i, 0], lengths[i, 1] = plen, clen - plen
            used += clen
            continue
        if plen + vlen >= n * width + INVERTIBLE_SLACK:
            kinds[i] = DENSE
            continue
        out[used:used + plen] = bitmap[:plen] if pc == _BITMAP else gaps[:plen]
        out[used + plen:used + plen + vlen] = vals[:vlen]
        kinds[i] = SPARSE
        codings[i, 0], codings[i, 1], codings[i, 2] = op, pc, vc
        lengths[i, 0], lengths[i, 1] = plen, vlen
        used += plen + vlen
    return used
