"""The codings' names and wire ids (op, positions, values; format/spec.md §2), and the policies
that choose among them (`EncodePolicy`, the named `ENCODE_PROFILES`).

Plain data, apart from the kernels that run the codings: manifests name codings
("xor/gaps/varint"), chunk tables carry their ids and `weighthub publish --encode` lists the
profiles, and none of that may import numba (or torch), which cost seconds per process
(`weighthub inspect` reads manifests only). The kernels take these ids as compile-time
constants (codec/kernels.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import IntEnum

from ..errors import FormatError, UnknownCodecError


class Op(IntEnum):
    XOR = 1  # positions + XOR of the bit patterns; invertible, placement-agnostic
    ADD = 2  # positions + wrap-around integer difference; invertible, placement-agnostic
    OVERWRITE = 3  # positions + new words; idempotent
    DENSE = 4  # every word of the range


class Positions(IntEnum):
    ALL = 0  # every element of the range (dense)
    GAPS = 1  # varint gaps between consecutive changed positions
    GROUPS = 2  # varint gaps within groups of equal old exponent (float dtypes)
    BITMAP = 3  # one bit per element, little-endian bit order
    CTX = 4  # range-coded group rank gaps, in context of the old exponent (float dtypes)
    ANS = 5  # the same rank gaps, rANS-coded with multi-symbol models (float dtypes)


class Values(IntEnum):
    RAW = 1  # full words, little-endian
    VARINT = 2  # unsigned LEB128 varint (XOR values)
    ZIGZAG = 3  # zigzag LEB128 varint of the wrap-around difference (ADD values)
    CTX = 4  # range-coded XOR or zigzag difference, in context of the old exponent
    ANS = 5  # the same values, rANS-coded with multi-symbol models


# The context codings: positions and values coded together in context of the old exponents,
# each with its own entropy coder (format/spec.md §2): a position id here pairs with the value
# id of the same name.
CONTEXT_CODINGS = {Positions.CTX: Values.CTX, Positions.ANS: Values.ANS}
CONTEXT_CODERS = {"ans": Positions.ANS, "range": Positions.CTX}  # EncodePolicy.coder → ids


# What can be applied inversely (a version back to its base, format/spec.md §2): xor and add
# words can be recovered from the new word and the value, overwrite and dense words cannot; and
# positions must be decodable without the base's bits, which exponent-grouped positions are not
# (they rank elements by the base word's exponent, and the new word's may differ).
_INVERTIBLE_OPS = frozenset({Op.XOR, Op.ADD})
_INVERTIBLE_POSITIONS = frozenset({Positions.GAPS, Positions.BITMAP})


def invertible(op: Op, positions: Positions) -> bool:
    """Can a segment of this op and position coding be applied inversely (new → old)?"""
    return op in _INVERTIBLE_OPS and positions in _INVERTIBLE_POSITIONS


@functools.cache  # a publish names one per segment, from a handful
def coding_name(op: Op, positions: Positions, values: Values) -> str:
    """A coding as manifests name it: "op/positions/values", e.g. "xor/gaps/varint"."""
    return f"{op.name}/{positions.name}/{values.name}".lower()


@functools.lru_cache(maxsize=256)  # a manifest names one per tensor, from a handful
def coding_invertible(name: str) -> bool:
    """`invertible` for a coding as manifests name it ("op/positions/values", e.g.
    "xor/gaps/varint"). An unknown or malformed name is not invertible."""
    op, _, rest = name.partition("/")
    positions = rest.partition("/")[0]
    try:
        return invertible(Op[op.upper()], Positions[positions.upper()])
    except KeyError:
        return False


# The codings a reader accepts (format/spec.md §2). Writers emit dense/all/raw and, for the
# sparse ops, xor/varint, add/zigzag and overwrite/raw; xor and add may also carry their values
# as raw words (the same z, W bytes each), and both streams of xor and add may be context-coded
# together (xor/ctx/ctx, add/ctx/ctx, xor/ans/ans, add/ans/ans). Anything else is refused before
# anything is applied.
_SPARSE_VALUES = {
    Op.XOR: frozenset({Values.VARINT, Values.RAW}),
    Op.ADD: frozenset({Values.ZIGZAG, Values.RAW}),
    Op.OVERWRITE: frozenset({Values.RAW}),
}


def check_coding(op: Op, positions: Positions, values: Values, where: str, *,
                 is_float: bool | None = None) -> None:
    """Refuse an (op, positions, values) combination the format does not allow (spec §2).

    Args:
        is_float: the segment's tensor dtype is a float type (None: not known here, as in a
            chunk frame read without its manifest); exponent-grouped positions need one.

    Raises:
        FormatError: `all` positions or raw values missing on a dense segment, `all` on a
            sparse one, a value coding its op does not take, a context coding (`ctx`, `ans`)
            on one stream only, paired with another or with overwrite, or `groups` or a context
            coding on an integer dtype.
    """
    if op == Op.DENSE:
        if positions != Positions.ALL or values != Values.RAW:
            raise FormatError(f"{where}: a dense segment must be coded dense/all/raw, not "
                              f"dense/{positions.name.lower()}/{values.name.lower()}")
        return
    if positions == Positions.ALL:
        raise FormatError(f"{where}: positions 'all' with op {op.name.lower()}: only a dense "
                          "segment covers every element")
    context = positions in CONTEXT_CODINGS
    if (CONTEXT_CODINGS.get(positions) != values if context
            else values in CONTEXT_CODINGS.values()) or (context and op not in _INVERTIBLE_OPS):
        raise FormatError(f"{where}: {op.name.lower()}/{positions.name.lower()}/"
                          f"{values.name.lower()}: context coding codes positions and values "
                          "together, for xor or add only (xor/ctx/ctx, add/ctx/ctx, "
                          "xor/ans/ans, add/ans/ans)")
    if context:
        if is_float is False:
            raise FormatError(f"{where}: context-coded positions on an integer dtype "
                              f"({positions.name.lower()} needs an exponent field)")
        return
    if values not in _SPARSE_VALUES[op]:
        allowed = sorted(v.name.lower() for v in _SPARSE_VALUES[op])
        raise FormatError(f"{where}: op {op.name.lower()} with {values.name.lower()} values; "
                          f"{op.name.lower()} takes {allowed}")
    if positions == Positions.GROUPS and is_float is False:
        raise FormatError(f"{where}: exponent-grouped positions on an integer dtype (groups "
                          "need an exponent field)")


def parse_enum(kind: type[IntEnum], raw: int, where: str) -> IntEnum:
    try:
        return kind(raw)
    except ValueError:
        known = {m.name.lower(): m.value for m in kind}
        raise UnknownCodecError(f"{where}: unknown {kind.__name__} id {raw}; known: {known}") from None


@dataclass(frozen=True, slots=True)
class EncodePolicy:
    """What encode_segment may choose from.

    mask_ops: allow xor/add (the receiver's placement copies bits). False forces overwrite,
      for placements that convert values (quantization, dtype casts).
    groups: allow exponent-grouped positions (smaller, slower to decode).
    group_probe: on large segments, first try groups on a few sample windows and build the full
      grouped stream only if they beat plain gaps there (grouping costs a pass over every
      element; on deltas whose changes do not depend on magnitude it never wins).
    value_sample: choose the value coding from byte histograms of at most about this many
      changed elements (evenly strided); 0 = all of them.
    ctx: with `groups`, code float segments' positions and values together in context of the
      old exponents instead of as exponent-grouped varints: the same context, coded near its
      entropy. Like `groups`, not invertible.
    coder: the entropy coder of those segments: "ans" (xor/ans/ans, add/ans/ans: rANS with
      multi-symbol models, 5-8x faster to encode than "range" and 0-1.2% more bytes), or
      "range" (xor/ctx/ctx, add/ctx/ctx: the binary range coder) while some receivers run a
      weighthub older than the ans coding (a rolling upgrade).
    frame_version: the chunk frame version written (spec §1): 2 (varint segment records), or 1
      while some receivers run a weighthub that reads only version 1 (a rolling upgrade).
    shared_tables: the order-0 streams of a small range (≤ 4096 elements) will share one zstd
      table with many other small ranges' (the publisher sets it for each chunk made mostly of
      them, `publish.stream.chunk_policy`), so it is not context-coded: each context-coded
      segment's models start from nothing. Unset, a small range is context-coded whenever that
      is smaller than its streams as written (in a chunk of context-coded ranges they go raw;
      in a chunk of their own they pay a table).
    """

    mask_ops: bool = True
    groups: bool = True
    min_group_count: int = 256  # below this the group table costs more than it saves
    group_probe: bool = True
    value_sample: int = 1 << 16
    ctx: bool = True
    coder: str = "ans"
    frame_version: int = 2
    shared_tables: bool = False


# Named encoder policies (Publisher(policy=...), `weighthub publish --encode NAME`). Measured with
# `weighthub bench` on the real MiniLM and SmolLM2 trajectories (lr 1e-6..1e-4, 2 cores): "compact"
# (the default) codes float xor/add segments with a context coding, `ans` by default: 1.014-1.084×
# the context entropy bound in chunk frame version 2, 3.9-7.5 bits per changed word, 0.41-0.51× a
# NeMo-style codec (coder="range", the older range coder: 0-0.8% fewer bytes, 3-5× slower to
# encode). It costs encoder and staging time: 0.07-0.12× the XOR pass to encode at 1-3% changed
# (the ans coder itself 44-122 ns per changed word; the scan and the exponent ranks over every word
# are the rest), 26-114 MB/s of compact stream to decode while staging, never in the pause. "fast"
# (plain gaps and varints under zstd) sends 1.5-1.65× the bytes but encodes at 1.7-3.4 GB/s and
# applies at 7-14 GB/s per core: the better choice on fast links. "grouped" is `compact` as it was
# before the context coders (exponent-grouped varints under zstd), 1.24-1.49× the bound. Deltas
# that use ctx/ans or groups do not invert (they rank by the old exponents): rollback then takes an
# anchor.
ENCODE_PROFILES: dict[str, EncodePolicy] = {
    "compact": EncodePolicy(),
    "grouped": EncodePolicy(ctx=False),
    "fast": EncodePolicy(groups=False, ctx=False),
}
