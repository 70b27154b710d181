"""Stage a route: fetch its chunks through the sources, check and decode them, off the pause.

Every chunk is fetched through `SourceList.fetch` (which checks size and SHA-256 against the
manifest once, and fails over between sources), parsed and validated (`decode_chunk`), and its
segments checked to lie inside the coverage the manifest gives the chunk.

Memory, bounded by the manifests before anything is read: each of the `workers` threads holds
one chunk in flight, whose frame no source reads past its manifest size (`ref.size`) and whose
body no frame may declare past what its coverage admits (`chunk_body_bound`; a full chunk: its
dense words exactly). So a hostile store or peer costs at most workers × max(ref.size +
chunk_body_bound) beyond the decoded chunks of a route that passes every check (what a legitimate
publish of that route would hold too); the first failure cancels the chunks not yet started.

The first step of a route applies to the bits held now, so its exponent-grouped positions are
decoded against them already (`regap`); applied forwards, its gap-coded segments on host
tensors are decoded to the words they write and the digest lanes of the words they replace
(`prepare`: the pause only scatters them), and for its other segments, with incremental
verification, those lanes are summed alone (`olds`). Nothing of the target is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from .. import catalog
from ..codec import Op, Positions, Segment, regap_segment
from ..codec.coding import CONTEXT_CODINGS
from ..codec.digest import staged_old_digest
from ..codec.prepared import SEALED_SCATTER, PreparedSegment, prepare_segment
from ..codec.prepared_many import gap_coded, prepare_gap_segments
from ..errors import FormatError, ObjectNotFound, UsageError
from ..format import ChunkFrame, ChunkRef, Manifest, decode_chunk
from ..format.chunk import body_bound, declared_body
from ..layout import ShardBox, segment_outside
from ..sources import ChunkId, SourceList
from ..targets.base import Held, Target, host_words_at
from ..tensors import DType, TensorSpec, Words, dtype_named
from .device import DeviceSegment, decode_segment
from .inputs import Chunk, Step
from .rows import RowPlan, Rows, rows_of


def stage_route(route: list[catalog.Rep], manifests: list[tuple[Manifest, Manifest]],
                sources: SourceList, target: Target, held: Held | None, *, where: str,
                incremental: bool, workers: int, early: EarlyDecodings | None = None) -> list[Step]:
    """Fetch, check and decode every chunk of `route` (manifests: from `routes.read_route`).

    `early`: decodings of the first step's chunks made before its manifest existed
    (`receive.early`); a chunk the sources serve with a digest found there is checked against
    the manifest as any other and takes its decoding from there instead of decoding it again.

    Raises:
        ObjectNotFound (a chunk is gone: retry to re-plan), ChecksumError, FormatError.
    """
    jobs = [(mi, ci) for mi, (m, _e) in enumerate(manifests) for ci in range(len(m.chunks))]
    # The first delta of the route applies to the bits held now: decode its exponent-grouped
    # positions against them already (slow scan, off the pause), and sum the digest lanes of
    # the words it will replace. Later deltas in a chain depend on bits that do not exist
    # yet; they decode during apply. (An inverse step has no grouped positions: refused.)
    first = manifests[0][0]
    first_from = first.root if route[0].inverse else first.base_root
    base_bits = target.peek() if held is not None and first_from == held.root else {}
    first_specs = first.specs()
    widths = [[dtype_named(t.dtype).width for t in m.tensors] for m, _e in manifests]
    if route[0].inverse or (early is not None and not early.fits(held, first_specs, incremental)):
        early = None  # decoded against other bits, another tensor table or another check

    def fetch(job: tuple[int, int]) -> Chunk:
        m = manifests[job[0]][0]
        ref = m.chunks[job[1]]
        name = f"chunk {where}/{ref.key}"
        blob = sources.fetch(ChunkId.of(m, route[job[0]].key, job[1]))
        bound = chunk_body_bound(ref, m, widths[job[0]])
        hit = early.get(ref.checksum) if early is not None and job[0] == 0 else None
        if hit is not None and declared_body(blob) <= bound:  # the same bytes, decoded already
            check_segments(hit.frame, ref, m, name)
            return Chunk(*hit.chunk_parts(ref))
        frame = decode_chunk(blob, where=name, max_body=bound)
        check_segments(frame, ref, m, name, inverse=route[job[0]].inverse)
        if job[0] != 0 or not base_bits:
            return Chunk(frame, ref)
        return Chunk(*decode_first(frame, first_specs, base_bits, name, inverse=route[0].inverse,
                                   incremental=incremental).chunk_parts(ref))

    try:
        with ThreadPoolExecutor(workers) as pool:
            chunks = list(pool.map(fetch, jobs))
    except ObjectNotFound as exc:
        raise ObjectNotFound(f"{exc}: the version's chunks are missing (deleted by retention "
                             "or never written); retry to re-plan") from exc
    steps = []
    it = iter(chunks)
    for r, (m, expect) in zip(route, manifests, strict=True):
        steps.append(Step(m, [next(it) for _ in m.chunks], r.inverse, expect,
                          first_specs if m is first else None))
    return steps


@dataclass(frozen=True, slots=True)
class FirstDecoding:
    """A chunk of a route's first step decoded against the held bits (`decode_first`):
    `frame` as parsed (what `check_segments` checks), the fields of its `Chunk` besides."""

    frame: ChunkFrame
    regapped: ChunkFrame
    olds: list[bytes | None] | None
    decoded: list[DeviceSegment | None] | None
    prepared: list[PreparedSegment | None] | None
    rows: RowPlan | None

    def chunk_parts(self, ref: ChunkRef) -> tuple[Any, ...]:
        """Chunk(*parts): the fields of the staged chunk `ref`."""
        return self.regapped, ref, self.olds, self.decoded, self.prepared, self.rows


class EarlyDecodings(Protocol):
    """Decodings made before the manifest existed (`receive.early.EarlyChunks`)."""

    def fits(self, held: Held | None, specs: list[TensorSpec], incremental: bool) -> bool: ...

    def get(self, checksum: str) -> FirstDecoding | None: ...


def decode_first(frame: ChunkFrame, specs: list[TensorSpec], base_bits: Mapping[str, Words],
                 where: str, *, inverse: bool, incremental: bool) -> FirstDecoding:
    """What staging computes for a chunk of a route's first step from the held bits: its
    words for a host tensor (`prepare`, applied forwards: context-coded segments decoded
    straight into them) or a device one (`device_decoded`: the pause only copies compact arrays
    up and applies), exponent-grouped and ctx positions not prepared re-coded against the held
    bits (`regap`), and the digest lanes of the words it replaces for the others (`old_digest`,
    with incremental verification)."""
    decoded = [device_decoded(seg, specs, base_bits, where) for seg in frame.segments]
    bulk, batches = ({}, []) if inverse else prepared_in_bulk(frame, specs, base_bits, where)

    def staged(j: int, seg: Segment) -> tuple[Segment, PreparedSegment | None]:
        if j in bulk:
            done = bulk[j]
            if isinstance(done, Exception):  # raised where the segment comes, as prepare would
                raise done
            return seg, done
        if not inverse and seg.positions in CONTEXT_CODINGS:
            prep = prepare(seg, specs, base_bits, where)
            if prep is not None:  # placed straight from its coder: no re-coding as gaps
                return seg, prep
        seg = regap(seg, specs, base_bits, where)
        return seg, None if inverse else prepare(seg, specs, base_bits, where)

    pairs = [staged(j, seg) for j, seg in enumerate(frame.segments)]
    regapped = ChunkFrame(tuple(seg for seg, _ in pairs))
    prepared = [prep for _, prep in pairs]
    olds = ([None if prep is not None else old_digest(seg, specs, base_bits, where)
             for seg, prep in zip(regapped.segments, prepared, strict=True)]
            if incremental else None)
    return FirstDecoding(frame, regapped, olds, decoded if any(decoded) else None,
                         prepared if any(p is not None for p in prepared) else None,
                         RowPlan.of(batches, len(prepared)) if batches else None)


def chunk_body_bound(ref: ChunkRef, m: Manifest, width: list[int]) -> int:
    """The largest decompressed body chunk `ref` of `m` may declare (`format.chunk.body_bound`
    over the words its manifest says it covers; `width`: bytes per element of each tensor)."""
    words = [(stop - start, width[ti]) for ti, start, stop in ref.covers]
    words += [(math.prod(shape), width[ti]) for ti, _offset, shape in ref.boxes]
    return body_bound(words, ref.size, full=m.base is None)


def check_segments(frame: ChunkFrame, ref: ChunkRef, m: Manifest, where: str, *,
                   inverse: bool = False) -> None:
    """Every segment must lie inside the chunk's declared coverage (no writes elsewhere), and
    for a delta applied inversely be invertible (the planner took the manifest's word for it).

    A segment in a box (part of a trainer rank's strided shard, spec §3) spans a flat range
    that interleaves other chunks' elements: its positions are decoded here, before anything is
    applied, and must all lie in one of the chunk's boxes (chunks apply in parallel and roll
    back exactly only if what they write is disjoint).
    """
    boxes = [(ti, ShardBox(tuple(m.tensors[ti].shape), tuple(o), tuple(s))) for ti, o, s in ref.boxes]
    # the ranges each tensor has in the chunk (one, but for a tensor split by the span): a
    # chunk of many small tensors has thousands of segments and ranges, and testing every
    # segment against every range took seconds a version for 8000 tensors
    ranges: dict[int, list[tuple[int, int]]] = {}
    for ti, start, stop in ref.covers:
        ranges.setdefault(ti, []).append((start, stop))
    for i, seg in enumerate(frame.segments):
        if not any(start <= seg.start and seg.stop <= stop
                   for start, stop in ranges.get(seg.tensor, ())):
            why = [segment_outside(seg, box) for ti, box in boxes if ti == seg.tensor]
            if None not in why:
                raise FormatError(f"{where}: segment {i} writes tensor {seg.tensor} "
                                  f"[{seg.start}, {seg.stop}) outside the chunk's coverage"
                                  + (f" ({why[0]})" if why else ""))
        if m.base is None and seg.op != Op.DENSE:
            raise FormatError(f"{where}: a full representation may only hold dense segments")
        if inverse and not seg.invertible:
            name = m.tensors[seg.tensor].name if seg.tensor < len(m.tensors) else seg.tensor
            raise FormatError(f"{where}: segment {i} of tensor {name!r} is "
                              f"{seg.op.name.lower()}/{seg.positions.name.lower()}, which cannot "
                              "be applied inversely, though the manifest lists only invertible ops "
                              "for it: the manifest misstates its chunks; nothing applied")
    if m.base is None:
        total = sum(seg.numel for seg in frame.segments)
        need = (sum(stop - start for _t, start, stop in ref.covers)
                + sum(box.numel for _t, box in boxes))
        if total != need:
            raise FormatError(f"{where}: full chunk carries {total} of {need} covered elements")


def regap(seg: Segment, specs: list[TensorSpec], base_bits: Mapping[str, Words],
          where: str) -> Segment:
    """Decode a segment's exponent-grouped or context-coded positions (and ctx values) against
    the held bits, before the pause (host tensors; device ones: `device_decoded`)."""
    spec = specs[seg.tensor]
    base = _host_base(base_bits, spec)
    if (seg.positions != Positions.GROUPS and seg.positions not in CONTEXT_CODINGS) or base is None:
        return seg  # nothing to do, or a mismatch the apply step reports properly
    return regap_segment(seg, base[seg.start: seg.stop], spec.dtype, where)


def old_digest(seg: Segment, specs: list[TensorSpec], base_bits: Mapping[str, Words],
               where: str) -> bytes | None:
    """Σ mix(i, held word) over the words `seg` will rewrite (None: left to the apply)."""
    spec = specs[seg.tensor] if seg.tensor < len(specs) else None
    base = _host_base(base_bits, spec) if spec is not None else None
    if spec is None or base is None:
        return None  # a mismatch the apply step reports properly, or a device tensor
    return staged_old_digest(seg, base[seg.start: seg.stop], spec.dtype, where)


def prepare(seg: Segment, specs: list[TensorSpec], base_bits: Mapping[str, Words],
            where: str) -> PreparedSegment | None:
    """The segment's words against the held bits of its host tensor (None: not prepared: a
    device tensor, a dense or exponent-grouped segment, or a mismatch the apply step reports
    properly)."""
    spec = specs[seg.tensor] if seg.tensor < len(specs) else None
    base = _host_base(base_bits, spec) if spec is not None else None
    if spec is None or base is None:
        return None
    return prepare_segment(seg, base[seg.start: seg.stop], spec.dtype, where)


def prepared_in_bulk(frame: ChunkFrame, specs: list[TensorSpec], base_bits: Mapping[str, Words],
                     where: str) -> tuple[dict[int, PreparedSegment | FormatError | UsageError],
                                          list[Rows]]:
    """`prepare` of every gap-coded segment of a host tensor (by its index in the frame), in
    one kernel call per dtype (codec.prepared_many); each refused one as the error `prepare`
    raises. A decoded frame's streams and kept views' words are reached by address. Also the
    batches of them the pause scatters as rows (`receive.rows`), planned against `base_bits`.
    """
    by_dtype: dict[DType, list[tuple[int, Segment, np.ndarray, int, np.ndarray]]] = {}
    decoded = frame.body is not None  # its streams: slices of one contiguous body
    for j, seg in enumerate(frame.segments):
        if not gap_coded(seg) or seg.tensor >= len(specs):
            continue
        spec = specs[seg.tensor]
        words = host_words_at(base_bits, spec.name) if spec.name in base_bits else None
        if words is None or words[2].type is not spec.dtype.uint or words[3] != spec.numel:
            continue  # (as _host_base: not this tensor's host words) or not contiguous
        if decoded or (seg.pos_bytes.flags.c_contiguous and seg.val_bytes.flags.c_contiguous):
            by_dtype.setdefault(spec.dtype, []).append(  # else prepare copies them
                (j, seg, words[0][seg.start: seg.stop], words[1] + seg.start * spec.dtype.width,
                 words[0]))
    out: dict[int, PreparedSegment | FormatError | UsageError] = {}
    batches: list[Rows] = []
    for dtype, items in by_dtype.items():
        at = None
        if frame.body is not None and frame.stream_offsets is not None:
            at = np.empty((len(items), 3), np.int64)
            at[:, :2] = frame.stream_offsets[[j for j, *_ in items]] + frame.body.ctypes.data
            at[:, 2] = [a for _, _, _, a, _ in items]
        done = prepare_gap_segments([s for _, s, *_ in items], [b for _, _, b, *_ in items],
                                    dtype, where, addresses=at)
        out.update(zip((j for j, *_ in items), done, strict=True))
        # rows as `plan_rows` takes them (the held words were checked above, the range by
        # the prepare): one group a call
        staged = [(item, prep) for item, prep in zip(items, done, strict=True)
                  if isinstance(prep, PreparedSegment) and prep.pos.size < SEALED_SCATTER]
        if staged and staged[0][1].group is not None:
            batch = rows_of(staged[0][1].group,
                            [(j, prep.row, a, specs[seg.tensor].name, view, seg.tensor)
                             for (j, seg, _, a, view), prep in staged])
            if batch is not None:
                batches.append(batch)
    return out, batches


def device_decoded(seg: Segment, specs: list[TensorSpec], views: Mapping[str, Words],
                   where: str) -> DeviceSegment | None:
    """The segment decoded for the device holding its tensor (None: a host tensor, a dense
    segment, or a mismatch the apply step reports properly). Grouped and ctx positions are
    placed against the words the device holds now, so this is for the route's first step only."""
    spec = specs[seg.tensor] if seg.tensor < len(specs) else None
    view = views.get(spec.name) if spec is not None else None
    if spec is None or not isinstance(view, torch.Tensor) or view.numel() != spec.numel \
            or view.element_size() != spec.dtype.width:
        return None
    if seg.op == Op.DENSE:  # its words are the frame's bytes: copied up in the pause (a staged
        return None  # full version would otherwise sit in host memory twice)
    return decode_segment(seg, view[seg.start: seg.stop], spec.dtype, where,
                          pinned=view.is_cuda, held=True)


def _host_base(views: Mapping[str, Words], spec: TensorSpec) -> np.ndarray | None:
    base = views.get(spec.name)
    if not isinstance(base, np.ndarray) or base.dtype != spec.dtype.uint \
            or base.size != spec.numel:
        return None
    return base
