"""The vector steps of the block placement (`codec/place.py`) and of the encoder's ranks
(`codec/ranks.py`), as LLVM IR in numba intrinsics.

The placement tracks a window of TOP consecutive keys (old exponents) and, per block of BLOCK
words, needs each window key's count in the block (`window_counts`), the lanes of one key
(`key_mask`), the lane of a key's i-th element (`nth_set_bit`) and the lanes whose key is
outside the window (`outside_lanes`). The counts and nth_set_bit have a fast lowering for CPUs
that have the instructions and a generic one for every other, chosen when numba compiles them,
for the CPU it compiles for (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, else this host):

    counts       "gfni"     each word's key becomes one bit of a byte (vpshufb, a 16-entry table
                            per 128-bit lane), the bits of every 8 bytes are transposed
                            (vgf2p8affineqb), counted (vpopcntb) and the 8 partial counts summed:
                            ~50 instructions a block (AVX-512BW with GFNI)
                 "compare"  one vector compare and a popcount per key (generic vectors, which
                            LLVM lowers for any CPU): ~100 instructions a block
    nth_set_bit  "pdep"     the i-th set bit deposited, then counted to (BMI2; not on AMD's Zen 1
                            and 2, where pdep is microcode)
                 "search"   a binary search by popcounts, without branches

The encoder's change scans (`kernels.scan_blocks`, and the one fused with the ranks) take a
block's changed lanes at once (`change_mask`: a compare of the two blocks, which LLVM lowers
for any CPU).

`lowering()` says which ones this process compiles. Both place the same changes; the tests
run the generic ones too, compiled for an x86-64-v2 CPU in a subprocess.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

BLOCK = 64  # words a block: one bit each in a uint64 lane mask
TOP = 16  # the keys of the window: one byte-sized bit position each, in two bytes

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_BYTES = ir.VectorType(_I8, BLOCK)
_SLOW_PDEP = ("znver1", "znver2")  # pdep/pext in microcode: hundreds of cycles


def _target(context) -> tuple[str, frozenset[str]]:
    """(name, enabled features) of the CPU numba's code generator compiles for."""
    codegen = context.codegen()
    try:
        name = codegen._get_host_cpu_name()
        features = codegen._get_host_cpu_features()
    except (AttributeError, RuntimeError):  # another numba: the generic lowerings
        return "", frozenset()
    return name, frozenset(f[1:] for f in features.split(",") if f.startswith("+"))


def _uses_gfni(context) -> bool:
    return {"avx512f", "avx512bw", "gfni"} <= _target(context)[1]


def _uses_pdep(context) -> bool:
    name, features = _target(context)
    return "bmi2" in features and name not in _SLOW_PDEP


def lowering() -> dict[str, str]:
    """Which lowering of each step this process compiles (the bench reports it)."""
    from numba.core.registry import cpu_target
    context = cpu_target.target_context
    return {"counts": "gfni" if _uses_gfni(context) else "compare",
            "nth_set_bit": "pdep" if _uses_pdep(context) else "search"}


def _splat(builder, x, ty):
    """A vector of type `ty` with every lane x."""
    one = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(ty, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, ty.count), [0] * ty.count))


def _shuffle(builder, a, b, lanes):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))


def _narrow(builder, x, vty):
    """The integer x as an element of the vector type vty (the caller keeps it in range)."""
    return builder.trunc(x, vty.element) if x.type.width > vty.element.width else x


def _function(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _block_keys(context, builder, sig, args):
    """IR: the keys (bytes) of the BLOCK words of args[0] from args[1], the key of a word w
    being (w >> args[2]) & args[3] (< 256)."""
    wty = context.get_value_type(sig.args[0].dtype)
    words = context.make_array(sig.args[0])(context, builder, args[0])
    vty = ir.VectorType(wty, BLOCK)

    def word(x):
        return builder.trunc(x, wty) if wty.width < 64 else x

    v = builder.load(builder.bitcast(builder.gep(words.data, [args[1]]), vty.as_pointer()),
                     align=1)
    v = builder.and_(builder.lshr(v, _splat(builder, word(args[2]), vty)),
                     _splat(builder, word(args[3]), vty))
    return builder.trunc(v, _BYTES) if wty.width > 8 else v


def _counts_gfni(builder, slot, inside):
    """IR: the count of each slot 0..TOP-1 among the block's slots (bytes; `inside`: lanes
    whose slot is in the window), as a <TOP x i8>."""
    index = builder.select(inside, slot, ir.Constant(_BYTES, [0x80] * BLOCK))  # 0x80: zero
    pshufb = _function(builder, "llvm.x86.avx512.pshuf.b.512", _BYTES, [_BYTES, _BYTES])
    affine = _function(builder, "llvm.x86.vgf2p8affineqb.512", _BYTES, [_BYTES, _BYTES, _I8])
    popcount = _function(builder, "llvm.ctpop.v64i8", _BYTES, [_BYTES])
    # affine(x = bit j in byte j, A = 8 bytes): byte j gets bit j of each of A's 8 bytes
    bits = ir.Constant(_BYTES, [1 << (j % 8) for j in range(BLOCK)])
    sums = []
    for half in (0, 1):  # slots 0-7 and 8-15, one bit each
        table = ir.Constant(_BYTES, [1 << (j % 16 - 8 * half) if 0 <= j % 16 - 8 * half < 8
                                     else 0 for j in range(BLOCK)])
        onehot = builder.call(pshufb, [table, index])
        s = builder.call(popcount, [builder.call(affine, [bits, onehot, ir.Constant(_I8, 0)])])
        for step in (32, 16, 8):  # sum the 8 bytes of each position across the 8 quadwords
            s = builder.add(s, _shuffle(builder, s, s, [j ^ step for j in range(BLOCK)]))
        sums.append(s)
    return _shuffle(builder, sums[0], sums[1], list(range(8)) + list(range(BLOCK, BLOCK + 8)))


def _counts_compare(builder, slot):
    """IR: as _counts_gfni, one compare and popcount per slot."""
    counts = ir.Constant(ir.VectorType(_I8, TOP), ir.Undefined)
    for q in range(TOP):
        hit = builder.icmp_unsigned("==", slot, ir.Constant(_BYTES, [q] * BLOCK))
        c = builder.trunc(builder.ctpop(builder.bitcast(hit, _I64)), _I8)
        counts = builder.insert_element(counts, c, ir.Constant(_I32, q))
    return counts


@intrinsic
def window_counts(typingctx, words, start, shift, gmask, kbase, tleft, kb, qp, addp):
    """The block of BLOCK words from `start`: kb[:] = their keys; tleft[q] += addp if q == qp
    (the update a change found in the previous block left pending); then tleft[q] -= the count
    of key kbase + q in the block (q < TOP; tleft's integers are the vector's lanes: int32
    lanes take half the instructions of int64). Returns the bits q whose tleft went negative (a
    change of that key is in the block), and bit TOP if a word's key is outside the window."""
    if not (isinstance(words, types.Array) and isinstance(words.dtype, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        keys = _block_keys(context, builder, sig, args)
        kbp = context.make_array(sig.args[6])(context, builder, args[6]).data
        builder.store(keys, builder.bitcast(kbp, _BYTES.as_pointer()), align=1)
        slot = builder.sub(keys, _splat(builder, builder.trunc(args[4], _I8), _BYTES))
        inside = builder.icmp_unsigned("<", slot, ir.Constant(_BYTES, [TOP] * BLOCK))
        counts = (_counts_gfni(builder, slot, inside) if _uses_gfni(context)
                  else _counts_compare(builder, slot))
        lty = ir.VectorType(context.get_value_type(sig.args[5].dtype), TOP)
        ptr = builder.bitcast(context.make_array(sig.args[5])(context, builder, args[5]).data,
                              lty.as_pointer())
        pending = builder.select(
            builder.icmp_unsigned("==", ir.Constant(lty, list(range(TOP))),
                                  _splat(builder, _narrow(builder, args[7], lty), lty)),
            _splat(builder, _narrow(builder, args[8], lty), lty), ir.Constant(lty, [0] * TOP))
        left = builder.sub(builder.add(builder.load(ptr, align=8), pending),
                           builder.zext(counts, lty))
        builder.store(left, ptr, align=8)
        due = builder.icmp_signed("<", left, ir.Constant(lty, [0] * TOP))
        due = builder.zext(builder.bitcast(due, ir.IntType(TOP)), _I64)
        outside = builder.icmp_unsigned("!=", builder.bitcast(inside, _I64),
                                        ir.Constant(_I64, -1))
        return builder.or_(due, builder.shl(builder.zext(outside, _I64),
                                            ir.Constant(_I64, TOP)))

    return types.int64(words, start, shift, gmask, kbase, tleft, kb, qp, addp), codegen


@intrinsic
def change_mask(typingctx, old, new, start):
    """The lane mask of the BLOCK words from `start` where old and new differ (uint64)."""
    if not (isinstance(old, types.Array) and old == new and isinstance(old.dtype, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        vty = ir.VectorType(context.get_value_type(sig.args[0].dtype), BLOCK)
        blocks = []
        for arr, ty in zip(args[:2], sig.args[:2], strict=True):
            data = context.make_array(ty)(context, builder, arr).data
            blocks.append(builder.load(builder.bitcast(builder.gep(data, [args[2]]),
                                                       vty.as_pointer()), align=1))
        return builder.bitcast(builder.icmp_unsigned("!=", *blocks), _I64)

    return types.uint64(old, new, start), codegen


@intrinsic
def key_mask(typingctx, kb, key):
    """The lane mask of `key` among the BLOCK keys kb[:] (stored by window_counts)."""
    def codegen(context, builder, sig, args):
        kbp = context.make_array(sig.args[0])(context, builder, args[0]).data
        keys = builder.load(builder.bitcast(kbp, _BYTES.as_pointer()), align=1)
        hit = builder.icmp_unsigned("==", keys,
                                    _splat(builder, builder.trunc(args[1], _I8), _BYTES))
        return builder.bitcast(hit, _I64)

    return types.uint64(kb, key), codegen


@intrinsic
def outside_lanes(typingctx, kb, kbase):
    """The lane mask of the BLOCK keys kb[:] (stored by window_counts) outside the window
    kbase .. kbase + TOP − 1: one compare, where testing the TOP keys one by one took TOP."""
    def codegen(context, builder, sig, args):
        kbp = context.make_array(sig.args[0])(context, builder, args[0]).data
        keys = builder.load(builder.bitcast(kbp, _BYTES.as_pointer()), align=1)
        slot = builder.sub(keys, _splat(builder, builder.trunc(args[1], _I8), _BYTES))
        out = builder.icmp_unsigned(">=", slot, ir.Constant(_BYTES, [TOP] * BLOCK))
        return builder.bitcast(out, _I64)

    return types.uint64(kb, kbase), codegen


@intrinsic
def set_lane(typingctx, arr, q, value):
    """arr[q] = value for q < TOP (else nothing; value in arr's integer type), stored as the
    whole vector arr[:TOP]: the next window_counts loads it whole, which a narrower store
    could not forward."""
    def codegen(context, builder, sig, args):
        lty = ir.VectorType(context.get_value_type(sig.args[0].dtype), TOP)
        ptr = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data,
                              lty.as_pointer())
        hit = builder.icmp_unsigned("==", ir.Constant(lty, list(range(TOP))),
                                    _splat(builder, _narrow(builder, args[1], lty), lty))
        builder.store(builder.select(hit, _splat(builder, _narrow(builder, args[2], lty), lty),
                                     builder.load(ptr, align=8)), ptr, align=8)
        return context.get_dummy_value()

    return types.none(arr, q, value), codegen


@intrinsic
def nth_set_bit(typingctx, m, i):
    """The index of the i-th (from 0) set bit of the uint64 m; i < 64 (and < popcount(m) for
    a meaningful answer; else 63 with pdep, undefined but in 0..63 with the search)."""
    def codegen(context, builder, sig, args):
        mask, nth = args[0], builder.zext(args[1], _I64) if args[1].type.width < 64 else args[1]
        if _uses_pdep(context):
            pdep = _function(builder, "llvm.x86.bmi.pdep.64", _I64, [_I64, _I64])
            bit = builder.call(pdep, [builder.shl(ir.Constant(_I64, 1), nth), mask])
            return builder.cttz(builder.or_(bit, ir.Constant(_I64, -(1 << 63))),
                                ir.Constant(ir.IntType(1), 1))
        at = ir.Constant(_I64, 0)
        for half in (32, 16, 8, 4, 2, 1):  # a branch per halving mispredicted half the time
            low = builder.ctpop(builder.and_(mask, ir.Constant(_I64, (1 << half) - 1)))
            skip = builder.icmp_unsigned(">=", nth, low)
            nth = builder.select(skip, builder.sub(nth, low), nth)
            mask = builder.select(skip, builder.lshr(mask, ir.Constant(_I64, half)), mask)
            at = builder.select(skip, builder.add(at, ir.Constant(_I64, half)), at)
        return at

    return types.int64(m, i), codegen
