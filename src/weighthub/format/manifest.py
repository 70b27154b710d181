"""Manifests: the description of one representation of a version (see spec.md).

A manifest is JSON (msgspec), human-readable with `weighthub inspect`. Writing the primary
manifest of version v create-only *is* the commit of v. Parsing validates every field, every
cross-reference (tensor indices, coverage ranges and boxes) and every limit before the manifest
is used.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re

import msgspec
import numpy as np

from ..errors import FormatError, FormatVersionError, LimitError, UnknownCodecError
from ..tensors import TensorSpec, dtype_named

# 2: linear tensor digests (spec §4) and SHA-256 chunk checksums; 1 (xxh3-128 for both) is refused
MANIFEST_FORMAT = 2
CHUNK_CHECKSUM = "sha256"  # the chunk checksum's algorithm in this format (named in errors)
KIND = "weighthub.manifest"
MAX_MANIFEST_BYTES = 256 << 20
MAX_TENSORS = 1 << 20
MAX_CHUNKS = 1 << 20
MAX_DIMS = 16
MAX_ELEMENTS = 1 << 48
MAX_INT = (1 << 63) - 1  # versions, sizes and counts: int64 wherever they are stored or computed
_KEY_RE = re.compile(r"[A-Za-z0-9._/\-]{1,512}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def chunk_checksum(frame: bytes | memoryview) -> str:
    """The manifest's checksum of a chunk frame: SHA-256, lowercase hex.

    Cryptographic because chunks may come from untrusted peers: the manifest (from the store)
    is what binds them. hashlib releases the GIL, so fetch threads check in parallel.
    """
    return hashlib.sha256(frame).hexdigest()


class TensorEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]
    digest: str  # linear digest (spec §4) of the canonical bits at this version, 32 hex digits
    changed: int = 0  # elements that differ from the base (numel for a full version)
    ops: list[str] = []  # "op/positions/values" used by this tensor's segments

    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, dtype_named(self.dtype), tuple(self.shape))


class ChunkRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    key: str  # store key, relative to the store root
    size: int  # bytes of the chunk frame
    checksum: str  # SHA-256 hex of the chunk frame (chunk_checksum)
    covers: list[tuple[int, int, int]]  # (tensor index, start, stop): element ranges it owns
    # (tensor index, offset, shape): n-D blocks it owns (part of a trainer rank's strided
    # shard); a tensor is covered by ranges or by boxes, never both. Omitted when empty, so
    # box-free manifests are byte-identical to those written before boxes existed.
    boxes: list[tuple[int, list[int], list[int]]] = []


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: int
    kind: str
    model: str  # digest of the tensor table (names, dtypes, shapes): the model's identity
    version: int
    base: int | None  # None: a full representation
    base_root: str | None
    root: str  # root digest of the version
    tensors: list[TensorEntry]
    chunks: list[ChunkRef]
    dense_bytes: int
    payload_bytes: int
    changed: int  # total changed elements vs base
    publisher: str = ""
    created: float = 0.0

    @property
    def is_full(self) -> bool:
        return self.base is None

    def specs(self) -> list[TensorSpec]:
        return [t.spec() for t in self.tensors]


_encoder = msgspec.json.Encoder()


def encode_manifest(m: Manifest) -> bytes:
    return _encoder.encode(m)


class _Head(msgspec.Struct):
    """What a manifest says of itself before its format is known: decoded alone, skipping the
    rest (decoding the whole document untyped took ~20 ms per MB: a model with 8000 tensors
    has a 1.4 MB manifest)."""

    kind: object = None
    format: object = None


def decode_manifest(buf: bytes, *, where: str) -> Manifest:
    """Parse and validate a manifest. Raises FormatError subclasses naming `where`."""
    if len(buf) > MAX_MANIFEST_BYTES:
        raise LimitError(f"{where}: manifest of {len(buf)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        head = msgspec.json.decode(buf, type=_Head)
    except msgspec.ValidationError:  # not a JSON object
        raise FormatError(f"{where}: not a weighthub manifest") from None
    except msgspec.DecodeError as exc:
        raise FormatError(f"{where}: manifest is not valid JSON: {exc}") from exc
    except RecursionError:  # msgspec recurses per nesting level; a manifest nests 4 deep
        raise FormatError(f"{where}: manifest JSON is nested too deeply to parse (a corrupt or "
                          "hostile manifest): republish the version") from None
    if head.kind != KIND:
        raise FormatError(f"{where}: not a weighthub manifest")
    fmt = head.format
    if fmt != MANIFEST_FORMAT:
        if type(fmt) is int and fmt < MANIFEST_FORMAT:
            raise FormatVersionError(
                f"{where}: manifest format {fmt} was written by an older weighthub (different "
                f"digests and checksums); this build reads {MANIFEST_FORMAT}: publish afresh into "
                "a new store, or read it with the weighthub that wrote it")
        raise FormatVersionError(f"{where}: manifest format {fmt!r}; this build "
                                 f"reads {MANIFEST_FORMAT}: upgrade weighthub")
    try:
        m = msgspec.json.decode(buf, type=Manifest)
    except msgspec.ValidationError as exc:
        raise FormatError(f"{where}: invalid manifest: {exc}") from exc
    except msgspec.DecodeError as exc:  # in a part the head's decode skipped
        raise FormatError(f"{where}: manifest is not valid JSON: {exc}") from exc
    except RecursionError:
        raise FormatError(f"{where}: manifest JSON is nested too deeply to parse (a corrupt or "
                          "hostile manifest): republish the version") from None
    _validate(m, where)
    return m


def _validate(m: Manifest, where: str) -> None:
    if not 0 <= m.version <= MAX_INT or (m.base is not None and not 0 <= m.base < m.version):
        raise FormatError(f"{where}: version {m.version} with base {m.base}")
    if not all(0 <= n <= MAX_INT for n in (m.dense_bytes, m.payload_bytes, m.changed)):
        raise LimitError(f"{where}: dense_bytes {m.dense_bytes}, payload_bytes "
                         f"{m.payload_bytes} or changed {m.changed} outside 0..2^63-1")
    if (m.base is None) != (m.base_root is None):
        raise FormatError(f"{where}: base and base_root must both be set or both be null")
    if len(m.tensors) > MAX_TENSORS or len(m.chunks) > MAX_CHUNKS:
        raise LimitError(f"{where}: {len(m.tensors)} tensors / {len(m.chunks)} chunks over limits")
    for digest in [m.root, m.model] + ([m.base_root] if m.base_root else []):
        if not _HEX32.fullmatch(digest):
            raise FormatError(f"{where}: {digest!r} is not a 128-bit hex digest")
    numels = []
    names = set()
    for t in m.tensors:
        try:
            dtype_named(t.dtype)
        except UnknownCodecError as exc:
            raise UnknownCodecError(f"{where}: tensor {t.name!r}: {exc}") from None
        if len(t.shape) > MAX_DIMS or any(d < 0 for d in t.shape):
            raise FormatError(f"{where}: tensor {t.name!r} has bad shape {t.shape}")
        numel = math.prod(t.shape)
        # each dim too: an empty tensor (a 0 dim) would otherwise carry any other dim to
        # torch/numpy, which refuse dims past int64
        if numel > MAX_ELEMENTS or any(d > MAX_ELEMENTS for d in t.shape):
            raise LimitError(f"{where}: tensor {t.name!r} has {numel} elements (shape {t.shape}; "
                             f"at most {MAX_ELEMENTS}, and no dim over it)")
        if t.name in names or not t.name:
            raise FormatError(f"{where}: tensor name {t.name!r} empty or repeated")
        if not 0 <= t.changed <= numel:
            raise FormatError(f"{where}: tensor {t.name!r} has {t.changed} changed of {numel} "
                              "elements")
        if not _HEX32.fullmatch(t.digest):
            raise FormatError(f"{where}: tensor {t.name!r} digest {t.digest!r} is not 128-bit hex")
        names.add(t.name)
        numels.append(numel)
    covered = [0] * len(numels)
    keys = set()
    for c in m.chunks:
        if not _KEY_RE.fullmatch(c.key) or {"", ".", ".."} & set(c.key.split("/")) or c.key in keys:
            raise FormatError(f"{where}: bad or repeated chunk key {c.key!r}")
        keys.add(c.key)
        if not 0 < c.size <= MAX_INT or not _HEX64.fullmatch(c.checksum):
            raise FormatError(f"{where}: chunk {c.key!r} has bad size or checksum")
        for ti, start, stop in c.covers:
            if not 0 <= ti < len(numels) or not 0 <= start < stop <= numels[ti]:
                raise FormatError(f"{where}: chunk {c.key!r} covers bad range "
                                  f"({ti}, {start}, {stop})")
            covered[ti] += stop - start
        for ti, offset, shape in c.boxes:
            if not 0 <= ti < len(numels) or not _box_fits(offset, shape, m.tensors[ti].shape):
                raise FormatError(f"{where}: chunk {c.key!r} covers bad box ({ti}, offset "
                                  f"{offset}, shape {shape}): it must have the tensor's rank, "
                                  "no empty dim, and lie inside the tensor")
            covered[ti] += math.prod(shape)
    # coverage must tile every tensor exactly once (overlaps would double-apply)
    for ti, (have, numel) in enumerate(zip(covered, numels, strict=True)):
        if have != numel:
            raise FormatError(f"{where}: chunks cover {have} of {numel} elements of tensor "
                              f"{m.tensors[ti].name!r}")
    _check_no_overlap(m, where)


def _box_fits(offset: list[int], shape: list[int], tensor: list[int]) -> bool:
    return (len(offset) == len(shape) == len(tensor) and all(s > 0 for s in shape)
            and all(o >= 0 and o + s <= n for o, s, n in zip(offset, shape, tensor, strict=True)))


def _check_no_overlap(m: Manifest, where: str) -> None:
    ranges = sorted((ti, start, stop) for c in m.chunks for ti, start, stop in c.covers)
    for (t0, _s0, e0), (t1, s1, _e1) in itertools.pairwise(ranges):
        if t0 == t1 and s1 < e0:
            raise FormatError(f"{where}: chunk coverage overlaps in tensor {m.tensors[t0].name!r}")
    boxes: dict[int, list[tuple[list[int], list[int]]]] = {}
    for c in m.chunks:
        for ti, offset, shape in c.boxes:
            boxes.setdefault(ti, []).append((offset, shape))
    mixed = set(boxes) & {ti for ti, _a, _b in ranges}
    if mixed:
        raise FormatError(f"{where}: tensor {m.tensors[min(mixed)].name!r} is covered by both "
                          "ranges and boxes; a tensor is covered by one kind only")
    for ti, group in boxes.items():
        _check_boxes_disjoint(group, m.tensors[ti].name, where)


def _check_boxes_disjoint(group: list[tuple[list[int], list[int]]], name: str, where: str) -> None:
    """No two boxes of one tensor overlap (their volumes were already checked to add up).

    A sweep along the dim with the most distinct offsets: a box is compared only with the boxes
    that start inside its extent along that dim, vectorized (a trainer's boxes meet few others;
    a hostile manifest costs numpy work, not Python loops per pair).
    """
    if len(group) < 2 or not group[0][0]:
        return  # a 0-d tensor has one element: the volume check allows a single box
    lo = np.asarray([o for o, _s in group], np.int64)
    hi = lo + np.asarray([s for _o, s in group], np.int64)
    d = max(range(lo.shape[1]), key=lambda j: np.unique(lo[:, j]).size)
    order = np.argsort(lo[:, d], kind="stable")
    lo, hi = lo[order], hi[order]
    ends = np.searchsorted(lo[:, d], hi[:, d], side="left")  # boxes starting before i's end
    for i in range(len(group) - 1):
        if ends[i] <= i + 1:
            continue
        meet = np.all((np.maximum(lo[i + 1:ends[i]], lo[i]) < np.minimum(hi[i + 1:ends[i]], hi[i])),
                      axis=1)
        if meet.any():
            j = i + 1 + int(np.argmax(meet))
            raise FormatError(f"{where}: chunk boxes at offset {lo[i].tolist()} shape "
                              f"{(hi[i] - lo[i]).tolist()} and offset {lo[j].tolist()} shape "
                              f"{(hi[j] - lo[j]).tolist()} overlap in tensor {name!r}")
