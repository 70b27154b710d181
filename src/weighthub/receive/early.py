"""Decoding a version's chunks as they arrive, before its manifest exists.

A publisher pushes each chunk down the relay tree while it still encodes the next, and writes
the manifest only after the last one is stored. A receiver beside a node daemon can decode the
chunks landing in that daemon's cache meanwhile (`EarlyDecoder`): against the bits it holds and
the tensor table of the version it holds (a delta from it keeps that table), on one thread,
while the publisher still works. Staging then finds most of the work done.

What it produces is a memo, not a staging (`EarlyChunks`, keyed by each frame's SHA-256).
`stage_route` takes a chunk's decoding from it only when the chunk the sources served has that
digest (so: the very bytes the committed manifest names, checked as always), the manifest's
tensor table is the one decoded against, the target still holds the version it held, and the
frame passes the checks staging makes with the manifest (coverage, body bound). Otherwise, or
for what the decoder did not reach, staging decodes as before: the memo can make staging
sooner, never different. A file it cannot read or decode is left to staging, which reports it.

Memory: one frame at a time (at most MAX_FRAME_BYTES, its body at most BODY_FACTOR times its
size: a frame compressing better is left to staging) plus the decodings, which staging would
hold anyway (`codec.prepared`: 12 bytes per changed bf16 word).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from .. import catalog
from ..errors import WeighthubError
from ..format import decode_chunk
from ..format.chunk import MAX_BODY_BYTES
from ..format.manifest import chunk_checksum
from ..targets.base import Held
from ..tensors import TensorSpec, Words
from .stage import FirstDecoding, decode_first

log = logging.getLogger(__name__)

POLL_S = 0.005  # between looks at the directory while nothing new is there
LIFETIME_S = 600.0  # a decoder whose version never comes (a failed publish) stops by itself
# the thread's nice: it runs while the version is published, and where the publisher shares
# the host's cores (a trainer beside its engines) it must take only what the publish leaves
NICE = 19
MAX_FRAME_BYTES = 1 << 30  # larger files are left to staging (a chunk is ~16-64 MiB of words)
BODY_FACTOR = 16  # a body declared larger than this times its frame is left to staging


class EarlyChunks:
    """Decodings of chunks by the SHA-256 of their frames, for one held version, tensor table
    and verification mode (`fits`)."""

    def __init__(self, held_root: str, specs: list[TensorSpec], incremental: bool) -> None:
        self.held_root = held_root
        self.specs = specs
        self.incremental = incremental
        self.used = 0  # decodings staging took
        self._by_digest: dict[str, FirstDecoding] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_digest)

    def fits(self, held: Held | None, specs: list[TensorSpec], incremental: bool) -> bool:
        """Were these decodings made for a first step from `held`, with `specs`?"""
        return (held is not None and held.root == self.held_root and specs == self.specs
                and incremental == self.incremental)

    def add(self, checksum: str, decoding: FirstDecoding) -> None:
        with self._lock:
            self._by_digest[checksum] = decoding

    def get(self, checksum: str) -> FirstDecoding | None:
        with self._lock:
            hit = self._by_digest.get(checksum)
            self.used += hit is not None
            return hit


class EarlyDecoder:
    """A thread decoding the chunks of `version`'s delta from the held version as they appear
    in `directory` (a LocalStore that is filled by rename, e.g. a node daemon's relay cache),
    until `stop` or for `lifetime_s`."""

    def __init__(self, directory: Path, version: int, held: Held, specs: list[TensorSpec],
                 base_bits: Mapping[str, Words], *, incremental: bool,
                 poll_s: float = POLL_S, lifetime_s: float = LIFETIME_S) -> None:
        self.version = version
        self.chunks = EarlyChunks(held.root, specs, incremental)
        self._dir = Path(directory) / catalog.version_dir(version)
        self._pattern = f"{catalog.rep_name(held.version)}-*/c*{catalog.CHUNK_SUFFIX}"
        self._specs = specs
        self._base_bits = base_bits
        self._poll_s = poll_s
        self._deadline = time.monotonic() + lifetime_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weighthub-early", daemon=True)
        self._thread.start()

    def stop(self) -> EarlyChunks:
        """End the thread (after the chunk it is decoding); what it decoded."""
        self._stop.set()
        self._thread.join()
        return self.chunks

    def _run(self) -> None:
        tid = threading.get_native_id()  # Linux: nice is per thread
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, max(NICE, os.getpriority(os.PRIO_PROCESS, tid)))
        seen: set[Path] = set()
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            new = sorted(set(self._dir.glob(self._pattern)) - seen)
            for path in new:
                if self._stop.is_set():
                    return
                seen.add(path)
                self._decode(path)
            if not new:
                self._stop.wait(self._poll_s)

    def _decode(self, path: Path) -> None:
        where = f"early chunk {path}"
        try:
            if path.stat().st_size > MAX_FRAME_BYTES:
                return
            blob = path.read_bytes()
            frame = decode_chunk(blob, where=where,
                                 max_body=min(MAX_BODY_BYTES, BODY_FACTOR * len(blob)))
            decoding = decode_first(frame, self._specs, self._base_bits, where, inverse=False,
                                    incremental=self.chunks.incremental)
        except (OSError, WeighthubError) as exc:  # staging decodes it, and reports what fails
            log.debug("%s: left to staging (%s)", where, exc)
            return
        except Exception:  # a bug, but staging still decodes the chunk itself: say so, go on
            log.exception("%s: the early decoder failed; left to staging", where)
            return
        self.chunks.add(chunk_checksum(blob), decoding)
