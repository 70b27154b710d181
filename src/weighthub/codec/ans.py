"""An adaptive rANS coder in numba: the entropy coder of the `ans` segment coding
(format/spec.md §2, "ANS coding"; the streams themselves are in codec.ans_kernels).

Why rANS with multi-symbol models, after the binary range coder of `ctx`: `ctx` codes a changed
word as ~20 binary decisions (unary quotient, remainder bits one at a time, a 5-level length
tree, an 8-level mantissa tree), 200-300 ns per change on one core, so the coder, not the scan,
was the cost of a delta. Here a change is two or three symbols of small alphabets (Golomb
quotient, bit length, top mantissa bits) and raw bit fields that enter the state in one step
each: 2-3 ns a symbol to list, ~5 to code, ~6 to decode.

Models. A context of alphabet A is a coding table `cum[k, 0..A]` (symbol s: start cum[k, s],
frequency cum[k, s+1] − cum[k, s], at scale TOTAL) rebuilt from observation weights
`cnt[k, 0..A−1]`: FLOOR each, the rest in proportion, what rounding leaves to the heaviest. So no
table is ever transmitted, every symbol stays codable, and no frequency exceeds
TOTAL − FLOOR·(A − 1): a symbol costs at least log2(TOTAL / (TOTAL − FLOOR·(A − 1))) bits, the
lower bound that lets a reader refuse a declared count its stream bytes cannot hold. A young
context rebuilds after every observation, an older one at intervals growing to REBUILD_MAX, so
rebuilding costs little per symbol while small tensors' few changes still teach it fast.
Contexts carry over from one exponent group to the next with their weights scaled down
(`model_enter`): neighbouring exponents code alike, and light weights adapt fast.

rANS (ryg_rans' 32-bit state with 16-bit renormalization): the encoder lists each symbol's
(start, frequency, scale bits) while running the models forwards, then codes the list
backwards; the decoder reads forwards. A raw field of k ≤ RAW_MAX bits is a symbol of frequency
1 at scale k. A stream is the final encoder state (4 bytes, little-endian) followed by the
16-bit words (little-endian) the decoder reads in order; decoding must end in the encoder's
initial state STATE_LOW with every word read, so truncation, trailing bytes and corruption that
stays in range are refused at the latest there. The decoder never reads past the end (missing
words read as 0 and are counted: an overrun shows as words read > words held).

Call pattern. numba passes arrays to a function that it does not inline with reference-count
updates, and a helper that calls helpers is not inlined: a `put_symbol` wrapping the three steps
below ran 4x slower. So the hot helpers are leaves (`symbol_op`, `observe`, `dec_symbol`,
`get_raw`), and the kernels spell out, for each symbol:

    if cnt[k, a + 2] != group: model_enter(cum, cnt, k, a, group)     # rare
    ops[n] = symbol_op(cum, k, s); n += 1                              # or dec_symbol
    if observe(cnt, k, a, s): model_rebuild(cum, cnt, k, a)            # rare

The one-context models of a group's every change (Rice quotient, value head) are entered at the
group's first change and count by the change's index instead (`next_rebuild`).

`observe`, `dec_symbol` and `get_raw` are inlined into the kernels by numba itself
(inline="always"): left to LLVM, each decoded symbol paid a call with its arrays' reference
counts, and the decoder took 34 ns a change on a MiniLM step instead of 20 (with the branch-free
renormalization of `_renorm`). The kernels carry these helpers compiled in, which is why
their disk cache is stamped with every kernel source (weighthub.kernel_cache).

Indices the kernels compute (a stream's word offset, an op's or a change's slot, a table row)
are cast to unsigned: numba adds a wrap-around fix (a compare and a select) to every signed
index LLVM cannot prove non-negative. Without those fixes, on MiniLM steps, the rank decode
takes 0.92-0.93x the time and the encoder (ans_encode) 0.84-0.91x.

All arithmetic is int64; states are < 2^32.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .kernels import BAD_CODE, STREAM_OVERRUN, TRAILING_BYTES

PROB_BITS = 12
TOTAL = 1 << PROB_BITS
FLOOR = 4  # frequency every symbol keeps (see the module docstring)
STATE_LOW = 1 << 16  # states live in [STATE_LOW, 2^32)
RAW_MAX = 16  # bits one raw symbol carries
WEIGHT = 32  # an observation's weight
PRIOR = 4  # every symbol's weight in a fresh context
CARRY_WEIGHT = 256  # a context entering a new group keeps at most this weight in all
WEIGHT_LIMIT = 1 << 20  # weights halve past this total
REBUILD_MAX = 256  # observations between table rebuilds, at most
MIN_ALPHABET = 4  # dec_symbol tests the first four starts at once
HEAD_BYTES = 8  # the two final encoder states

_MASK16 = 0xFFFF
_U1 = np.uint64(1)
_LIFT = 2.0 ** -30  # model_rebuild's float floor (see there)
_FRESH = -1  # the group of a context not used yet (groups count from 0)


def min_symbol_bits(alphabet: int) -> float:
    """The fewest bits a symbol of a context with this alphabet can cost (module docstring)."""
    return float(np.log2(TOTAL / (TOTAL - FLOOR * (alphabet - 1))))


# --- models -----------------------------------------------------------------------------------
# A kind of context (same alphabet A) is two int32 arrays: cum[k, 0..A] (context k's coding
# table) and cnt[k, 0..A+2]: the observation weights of the A symbols, then the observations
# since the table was made, the count at which it is next rebuilt, and the group the context
# is in (_FRESH: not used yet).


@njit(cache=True, nogil=True, boundscheck=False)
def model_rebuild(cum, cnt, k, a):
    """cum[k] from the weights cnt[k, :a]: FLOOR each, the rest in proportion (rounded down),
    what rounding leaves to the heaviest symbol (the first of equals)."""
    total = 0
    best = 0
    heaviest = cnt[k, 0]
    for s in range(a):
        w = cnt[k, s]
        total += w
        if w > heaviest:
            heaviest = w
            best = s
    if total > WEIGHT_LIMIT:  # forget slowly (halving can tie the heaviest with an earlier one)
        total = 0
        best = 0
        heaviest = cnt[k, 0] >> 1
        for s in range(a):
            w = cnt[k, s] >> 1
            cnt[k, s] = w
            total += w
            if w > heaviest:
                heaviest = w
                best = s
    avail = TOTAL - FLOOR * a
    # floor(cnt·avail / total) by a float product: one division per table instead of one
    # per symbol. Exact: the quotient is at most avail < 2^12, so the two roundings err by
    # < 2^-39, while a quotient that is not an integer is at least 1/total ≥ 2^-21 below the
    # next one; the 2^-30 added lifts an integer quotient computed a hair low back to itself
    ratio = np.float64(avail) / np.float64(total)
    # Starts up to the heaviest symbol count up from 0, those after it down from TOTAL: the
    # heaviest takes what rounding leaves, and no pass goes back to shift the starts (with
    # the heaviest found while summing: 0.67-0.79x the time of a rebuild in three passes, on
    # alphabets of 8, 16 and 21; an integer reciprocal instead of the float one: 1.1-1.2x)
    acc = 0
    for s in range(best + 1):
        cum[k, s] = acc
        acc += FLOOR + int(np.float64(cnt[k, s]) * ratio + _LIFT)
    acc = TOTAL
    cum[k, a] = TOTAL
    for s in range(a - 1, best, -1):
        acc -= FLOOR + int(np.float64(cnt[k, s]) * ratio + _LIFT)
        cum[k, s] = acc


@njit(cache=True, nogil=True, boundscheck=False)
def models(contexts, a):
    """(cum, cnt) of `contexts` contexts of alphabet a (≥ MIN_ALPHABET), each made fresh by
    model_enter when first used (a segment uses few of the contexts it may need)."""
    cum = np.empty((contexts, a + 1), np.int32)
    cnt = np.empty((contexts, a + 3), np.int32)
    for k in range(contexts):
        cnt[k, a + 2] = _FRESH
    return cum, cnt


@njit(cache=True, nogil=True, boundscheck=False)
def model_enter(cum, cnt, k, a, group):
    """Context k is first used in `group`. A fresh context starts uniform (every weight
    PRIOR); one used in an earlier group starts as it ended it, its weights scaled down to
    CARRY_WEIGHT in all where they weigh more (neighbouring exponent groups code alike, and
    light weights adapt fast to this one). Scaling is idempotent, so skipping groups that do
    not use the context changes nothing."""
    if cnt[k, a + 2] == _FRESH:
        for s in range(a):
            cnt[k, s] = PRIOR
    else:
        total = 0
        for s in range(a):
            total += cnt[k, s]
        if total > CARRY_WEIGHT:
            for s in range(a):
                cnt[k, s] = np.int64(cnt[k, s]) * CARRY_WEIGHT // total
    cnt[k, a] = 0
    cnt[k, a + 1] = 1
    cnt[k, a + 2] = group
    model_rebuild(cum, cnt, k, a)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def next_rebuild(seen):
    """The observation count at which a table rebuilt at `seen` is next rebuilt (observe's
    schedule). A kernel whose hot context is a single one, entered at a group's first change,
    tells its count by the change's index instead of keeping it in cnt, where each symbol's
    count waited on the previous symbol's store: 0.94-0.95x the time of a MiniLM step's rank
    decode (with the two-pass model_rebuild)."""
    return seen + min(max(1, seen >> 2), REBUILD_MAX)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def observe(cnt, k, a, s):
    """Count symbol s in context k. True when its table is due to be rebuilt (every observation
    while young, then at intervals growing by a quarter up to REBUILD_MAX)."""
    cnt[k, s] += WEIGHT
    seen = cnt[k, a] + 1
    cnt[k, a] = seen
    if seen == cnt[k, a + 1]:
        cnt[k, a + 1] = next_rebuild(seen)
        return True
    return False


# --- encoder: a forward pass lists ops, a backward pass codes them ------------------------------
# An op is one uint32: start (16 bits) | (frequency − 1) << 16 (12 bits) | (scale bits − 1) << 28.


@njit(cache=True, nogil=True, boundscheck=False)
def symbol_op(cum, k, s):
    """The op of symbol s in context k's table."""
    start = np.int64(cum[np.uint64(k), np.uint64(s)])
    freq = np.int64(cum[np.uint64(k), np.uint64(s + 1)]) - start
    return np.uint32(start | ((freq - 1) << 16) | ((PROB_BITS - 1) << 28))


@njit(cache=True, nogil=True, boundscheck=False)
def put_raw(ops, n, v, nbits):
    """List the low `nbits` (0..64) bits of v (uint64 or int64), most significant piece first,
    in pieces of at most RAW_MAX bits. Returns the ops listed."""
    while nbits > 0:
        take = nbits - (nbits - 1) // RAW_MAX * RAW_MAX  # the top piece: 1..RAW_MAX bits
        nbits -= take
        piece = np.int64((np.uint64(v) >> np.uint64(nbits)) & np.uint64((1 << take) - 1))
        ops[np.uint64(n)] = np.uint32(piece | ((take - 1) << 28))
        n += 1
    return n


@intrinsic
def _high_product(typingctx, a, b):
    """The high 64 bits of the 128-bit product of two uint64 (one multiply on x86-64)."""
    if a != types.uint64 or b != types.uint64:
        return None

    def codegen(context, builder, signature, args):
        wide = ir.IntType(128)
        p = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        return builder.trunc(builder.lshr(p, ir.Constant(wide, 64)), ir.IntType(64))

    return types.uint64(a, b), codegen


# ceil(2^64 / f) for each frequency f ≥ 2 a symbol can have (index f; 0 and 1 unused): the
# encoder's x // f is high_product(x, _RECIPROCAL[f]), exact for x < 2^32 (the error,
# below x / 2^64 < 2^-32, never reaches the 1/f ≥ 2^-12 between a quotient and the next).
# A multiply instead of a 64-bit division, and no branches (see _encode_op): code_ops takes
# 0.89-0.90x the time on a synthetic list of symbols and raw fields (a state's chain of
# dependent steps per op, two states side by side, is what remains).
_RECIPROCAL = np.array([0, 0] + [-(-(1 << 64) // f) for f in range(2, TOTAL + 1)], np.uint64)


@njit(cache=True, nogil=True, boundscheck=False)
def _encode_op(x, op, words, g):
    """Code one op into state x, renormalizing into words[g - 1] first if needed: (x, g)."""
    start = op & _MASK16
    freq = ((op >> 16) & 0xFFF) + 1
    bits = (op >> 28) + 1
    # without branches: whether an op renormalizes is as good as random, and raw ops and
    # symbols alternate. The word is written whether or not it is taken (g > 0 here: each op
    # takes at most one word, and the ops left to code are at least one)
    big = x >= ((STATE_LOW >> bits) << 16) * freq
    words[np.uint64(g - 1)] = x & _MASK16
    g -= np.int64(big)
    x = x >> 16 if big else x
    q = np.int64(_high_product(np.uint64(x), _RECIPROCAL[np.uint64(freq)]))
    q = x if freq == 1 else q
    return (q << bits) + x - q * freq + start, g


@njit(cache=True, nogil=True, boundscheck=False)
def code_ops(ops, n, out):
    """Code ops[:n] (listed in decoding order) backwards into `out` (uint8, at least
    HEAD_BYTES + 2n bytes), op j with state j mod 2. Returns the stream's length; the stream is
    out[:length]. The loop takes the ops in pairs so that the two states' dependency chains
    (a reciprocal multiply each) run side by side."""
    words = np.empty(n, np.uint16)
    g = n
    x0 = np.int64(STATE_LOW)
    x1 = np.int64(STATE_LOW)
    j = n - 1
    if j >= 0 and j & 1 == 0:  # an odd count: the last op is state 0's alone
        x0, g = _encode_op(x0, np.int64(ops[np.uint64(j)]), words, g)
        j -= 1
    while j > 0:
        x1, g = _encode_op(x1, np.int64(ops[np.uint64(j)]), words, g)
        x0, g = _encode_op(x0, np.int64(ops[np.uint64(j - 1)]), words, g)
        j -= 2
    for i in range(4):
        out[i] = (x0 >> (8 * i)) & 0xFF
        out[4 + i] = (x1 >> (8 * i)) & 0xFF
    m = HEAD_BYTES
    for j in range(g, n):
        w = np.int64(words[np.uint64(j)])
        out[np.uint64(m)] = w & 0xFF
        out[np.uint64(m + 1)] = w >> 8
        m += 2
    return m


# --- decoder ----------------------------------------------------------------------------------
# State (xa, xb, i): xa decodes the next op, xb the one after (each helper returns them swapped,
# so ops alternate between the two states as the encoder assigned them); i counts 16-bit words
# consumed after the head. Past the end words read as 0 and i keeps counting, so an overrun
# shows as i > the words held (checked by the callers in every loop a stream could otherwise
# keep going, and at the end).


@njit(cache=True, nogil=True, boundscheck=False)
def _u32(buf, p):
    return (np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8) | (np.int64(buf[p + 2]) << 16)
            | (np.int64(buf[p + 3]) << 24))


@njit(cache=True, nogil=True, boundscheck=False)
def dec_init(buf):
    """(xa, xb, i, words held, status): status STREAM_OVERRUN for a stream shorter than its
    head, BAD_CODE for an odd word area or a state below STATE_LOW (no encoder ends there)."""
    nb = buf.shape[0]
    if nb < HEAD_BYTES:
        return 0, 0, 0, 0, STREAM_OVERRUN
    x0, x1 = _u32(buf, 0), _u32(buf, 4)
    status = 0
    if (nb - HEAD_BYTES) % 2 or x0 < STATE_LOW or x1 < STATE_LOW:
        status = BAD_CODE
    return x0, x1, 0, (nb - HEAD_BYTES) // 2, status


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def dec_symbol(xa, xb, i, buf, cum, k):
    """Decode one symbol with context k's table: (symbol, xa, xb, i) for the next op. The first
    four starts are tested at once (no branch to mispredict on the common symbols), the rest
    one by one; the search ends because cum[k, A] = TOTAL > slot."""
    slot = xa & (TOTAL - 1)
    s = ((np.int64(cum[k, 1]) <= slot) + (np.int64(cum[k, 2]) <= slot)
         + (np.int64(cum[k, 3]) <= slot) + (np.int64(cum[k, 4]) <= slot))
    if s == 4:
        while cum[k, s + 1] <= slot:
            s += 1
    start = np.int64(cum[k, s])
    x = (np.int64(cum[k, s + 1]) - start) * (xa >> PROB_BITS) + slot - start
    x, i = _renorm(x, i, buf)
    return s, xb, x, i


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _renorm(x, i, buf):
    """x below STATE_LOW takes the next word: (x, i). Without a branch (whether a symbol
    renormalizes is as good as random, and a mispredicted branch cost more than the select)."""
    p = HEAD_BYTES + 2 * i
    q = np.uint64(min(p, buf.shape[0] - 2))  # a stream holds its 8-byte head: q ≥ 6
    w = np.int64(buf[q]) | (np.int64(buf[q + _U1]) << 8)
    w = w if p + 1 < buf.shape[0] else np.int64(0)
    low = x < STATE_LOW
    return ((x << 16) | w) if low else x, i + np.int64(low)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def get_raw(xa, xb, i, buf, nbits):
    """Decode a raw field of nbits (0..64) bits coded by put_raw: (value uint64, xa, xb, i)."""
    v = np.uint64(0)
    while nbits > 0:
        take = nbits - (nbits - 1) // RAW_MAX * RAW_MAX
        nbits -= take
        piece = xa & ((1 << take) - 1)
        x = xa >> take
        if x < STATE_LOW:  # a branch here: raw fields are short, renormalizing is rare
            p = HEAD_BYTES + 2 * i
            x <<= 16
            if p + 1 < buf.shape[0]:
                x |= np.int64(buf[np.uint64(p)]) | (np.int64(buf[np.uint64(p + 1)]) << 8)
            i += 1
        xa, xb = xb, x
        v = (v << np.uint64(take)) | np.uint64(piece)
    return v, xa, xb, i


@njit(cache=True, nogil=True, boundscheck=False)
def dec_finish(xa, xb, i, words):
    """Status of a stream after its last symbol: every word read, both states back at the
    start."""
    if i > words:
        return STREAM_OVERRUN
    if i < words:
        return TRAILING_BYTES
    if xa != STATE_LOW or xb != STATE_LOW:
        return BAD_CODE
    return 0
