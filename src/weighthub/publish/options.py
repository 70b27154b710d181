"""Publisher options, checked once, when a publisher is made.

Both `Publisher` and `ShardedPublisher` take the same options (the single process is the
world-size-1 case of the group); every check lives here, so a bad value is refused before any
store is touched, with the option's name, its value and what to pass instead.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from ..chunking import MIN_SPAN
from ..codec import EncodePolicy
from ..codec.coding import CONTEXT_CODERS
from ..errors import UsageError

DELTA_SPAN_BYTES = 32 << 20  # dense bytes per delta chunk (≈0.1-1 MiB on the wire at RL rates)
FULL_SPAN_BYTES = 16 << 20  # dense bytes per full chunk (≈12 MiB on the wire)
# Payload a delta chunk aims for. Every chunk is a store request and a relay push, and each
# costs a fixed ~10 ms of CPU on the two ends (botocore and SeaweedFS measured on loopback;
# a real S3 adds ~20 ms of latency): a 270 MB policy at 2% change in 32 MiB spans makes nine
# ~450 KB chunks, and its publish took 0.13-0.17 s into SeaweedFS against 0.09-0.13 s in three.
DELTA_CHUNK_BYTES = 1 << 20
MAX_SPAN_GROWTH = 4  # a delta span grows to at most this many times delta_span_bytes


BACKENDS = ("auto", "host", "torch")


@dataclass(frozen=True, slots=True)
class PublishOptions:
    """What a publisher writes besides the primary representation, and how it streams it.

    Args:
        anchor_every: also write a full representation every K versions, so newcomers need not
            replay the whole chain (0: only the first version is full).
        skip_every: also write a skip delta (v-K → v) every K versions, for receivers that fall
            behind (0: off). Keeps one more baseline copy in memory.
        retain: keep this many newest versions (older ones are deleted after each commit, but
            never the newest anchor); 0 keeps everything.
        policy: which ops and codings the encoder may choose.
        workers: encoder threads (per rank); at most `2 × workers` encoded chunks are in memory.
        delta_span_bytes / full_span_bytes: dense bytes a delta / full chunk covers (a
            delta's at least; see delta_chunk_bytes).
        delta_chunk_bytes: the payload a delta chunk aims for: where the last delta's chunks
            carried less, the next one's spans grow to match its payload per dense byte
            (`delta_span`), up to MAX_SPAN_GROWTH × delta_span_bytes. 0 keeps delta spans
            fixed. Default: DELTA_CHUNK_BYTES with the default delta span, 0 with a span set
            otherwise (a span chosen, e.g. to pipeline many chunks down a tree, is kept).
        backend: where the scan runs: "auto" (where each tensor lives: CUDA tensors are scanned
            on their device and only compact streams reach the host), "host" (copy device
            tensors to the host first, as before the device backend), or "torch" (the device
            code on every tensor, CPU ones included: how tests run it without a GPU).
        host_baseline: keep the baseline of device tensors in host memory instead of a device
            copy (for memory-tight trainers): each delta then uploads the old words chunk by
            chunk, and the baseline advances by a device-to-host copy after each commit.

    Raises:
        UsageError: a negative interval, no worker, a span below the minimum, or a retention
            shorter than the anchor interval (receivers could be left without a route).
    """

    anchor_every: int = 16
    skip_every: int = 0
    retain: int = 0
    policy: EncodePolicy = field(default_factory=EncodePolicy)
    workers: int = 2
    delta_span_bytes: int = DELTA_SPAN_BYTES
    full_span_bytes: int = FULL_SPAN_BYTES
    backend: str = "auto"
    host_baseline: bool = False
    delta_chunk_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.delta_chunk_bytes is None:
            object.__setattr__(self, "delta_chunk_bytes", DELTA_CHUNK_BYTES
                               if self.delta_span_bytes == DELTA_SPAN_BYTES else 0)
        if self.backend not in BACKENDS:
            raise UsageError(f"publisher option backend={self.backend!r}: pass one of "
                             f"{list(BACKENDS)}")
        if not isinstance(self.host_baseline, bool):
            raise UsageError(f"publisher option host_baseline={self.host_baseline!r}: pass True "
                             "or False")
        for name, meaning in (("anchor_every", "0 writes only the first version full"),
                              ("skip_every", "0 writes no skip deltas"),
                              ("retain", "0 keeps every version")):
            value = _integer(getattr(self, name))
            if value is None or value < 0:
                raise UsageError(f"publisher option {name}={getattr(self, name)!r} is not a count "
                                 f"of versions: pass an integer >= 0 ({meaning})")
        workers = _integer(self.workers)
        if workers is None or workers < 1:
            raise UsageError(f"publisher option workers={self.workers!r}: pass at least 1 "
                             "encoder thread")
        for name in ("delta_span_bytes", "full_span_bytes"):
            value = _integer(getattr(self, name))
            if value is None or value < MIN_SPAN:
                raise UsageError(f"publisher option {name}={getattr(self, name)!r} is below the "
                                 f"minimum chunk span of {MIN_SPAN} bytes: pass a larger span")
        chunk = _integer(self.delta_chunk_bytes)
        if chunk is None or chunk < 0:
            raise UsageError(f"publisher option delta_chunk_bytes={self.delta_chunk_bytes!r}: "
                             "pass the payload bytes a delta chunk aims for, or 0 for fixed "
                             "delta spans")
        if self.retain and self.anchor_every and self.retain < self.anchor_every:
            raise UsageError(f"retain={self.retain} is shorter than anchor_every="
                             f"{self.anchor_every}: receivers could be left with no path; raise "
                             "retain")
        if not isinstance(self.policy, EncodePolicy):
            raise UsageError(f"publisher option policy={self.policy!r} is not an EncodePolicy: "
                             "pass one (weighthub.codec.EncodePolicy or an ENCODE_PROFILES entry)")
        if self.policy.frame_version not in (1, 2):
            raise UsageError(f"EncodePolicy(frame_version={self.policy.frame_version!r}): chunk "
                             "frames are version 2, or 1 for receivers older than version 2")
        if self.policy.coder not in CONTEXT_CODERS:
            raise UsageError(f"EncodePolicy(coder={self.policy.coder!r}): context-coded segments "
                             f"use {sorted(CONTEXT_CODERS)}: 'ans', or 'range' for receivers "
                             "older than the ans coding")

    def is_anchor(self, version: int) -> bool:
        """Does `version` get a full representation besides its delta?"""
        return version > 0 and self.anchor_every > 0 and version % self.anchor_every == 0

    def is_skip_point(self, version: int) -> bool:
        """Is `version` a skip point (it gets a skip delta, and later ones start from it)?"""
        return self.skip_every > 0 and version % self.skip_every == 0


def delta_span(options: PublishOptions, dense_bytes: int, payload_ratio: float) -> int:
    """Dense bytes per chunk of a delta from a rank holding `dense_bytes` of words, whose last
    delta carried `payload_ratio` payload bytes per dense byte (0: none yet).

    As many chunks as carry about `delta_chunk_bytes` of payload each, but at least two per
    encoder thread and at most what spans MAX_SPAN_GROWTH times `delta_span_bytes` wide make;
    the words split evenly over them (in MIN_SPAN units, rounded up: no sliver of a chunk
    left over).
    Never narrower than `delta_span_bytes`. Derived from published payloads only, so every
    backend cuts the same trajectory into the same chunks.
    """
    span, target = options.delta_span_bytes, options.delta_chunk_bytes
    if not target or payload_ratio <= 0:
        return span
    count = max(-(-int(dense_bytes * payload_ratio) // target), 2 * options.workers,
                -(-dense_bytes // (MAX_SPAN_GROWTH * span)))
    return max(span, -(-dense_bytes // (count * MIN_SPAN)) * MIN_SPAN)


def check_committer(committer: int, world: int) -> None:
    """Raise UsageError unless `committer` is a rank of a group of `world` ranks."""
    rank = _integer(committer)
    if rank is None or not 0 <= rank < world:
        raise UsageError(f"committer {committer!r} is not a rank of the group (size {world}): "
                         f"pass a rank in 0..{world - 1}")


def _integer(value: object) -> int | None:
    """`value` as an int if it is an integer of any kind (int, numpy integer), else None."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
