"""The Store protocols, one per ability, and the key and timeout rules every store shares.

A store is the authority for manifests and the create-only commit. Its abilities are small
protocols (as obspec has `Get`, `GetRange`, `Put`), so a view that can only read says so:

    Readable       get, size            whole objects
    RangeReadable  get_range            bytes [start, stop) of an object
    Writable       put                  atomic writes; create_only=True is the commit primitive
    Listable       children             discover versions
    Deletable      delete               retention
    ReadableStore  Readable + RangeReadable + Listable   (what a receiver or a catalog reads)
    Store          all five             (what a publisher writes to)

Keys are relative '/'-separated paths of [A-Za-z0-9._-] segments. Lifecycle: a publisher `put`s
chunk objects (plain writes; retried freely), then `put(..., create_only=True)` the manifest:
that single create-only write is the commit. Readers `get`/`get_range` objects and `children`
to discover versions.

Every method takes a keyword `timeout`: seconds for this call, None for the store's own
default. A call raises only UsageError (an invalid key, range or timeout: a caller's bug) or a
StoreError: ObjectNotFound, ObjectExists, StoreTimeout (no answer in time: retrying may help)
or StoreRefused (an answer that says no: permissions, I/O error, credentials).

Reads are bounded in size as well as time, because a store may be hostile: `get` takes
`max_bytes`, what the caller expects at most (a chunk's size from its manifest, a manifest's
limit), and refuses a larger object with LimitError *before* reading it (a file by its stat, S3
by the first part's Content-Range), reading at most max_bytes + 1 bytes; `get_range` reads at
most stop - start bytes. Objects that are not plain data (a FIFO or device planted in a local
store) are refused with StoreRefused, never waited on or read without end.
"""

from __future__ import annotations

import math
import re
from typing import Protocol, runtime_checkable

from ..errors import LimitError, UsageError

_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9._\-]+$")
TMP_PREFIX = ".tmp-"  # a writer's temporary file (see LocalStore): never a key


def check_key(key: str) -> str:
    """`key` if it is a valid store key, else UsageError (before any backend sees it)."""
    parts = key.split("/")
    if not key or any(not _KEY_SEGMENT.match(p) or p in (".", "..") for p in parts):
        raise UsageError(f"invalid store key {key!r}: use '/'-separated [A-Za-z0-9._-] segments")
    if any(p.startswith(TMP_PREFIX) for p in parts):
        raise UsageError(f"invalid store key {key!r}: names starting with {TMP_PREFIX!r} are "
                         "reserved for a store's temporary files (swept after a crash)")
    return key


def check_max_bytes(max_bytes: int | None, where: str) -> int | None:
    """`max_bytes` if it is None or an int >= 0, else UsageError."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                  or max_bytes < 0):
        raise UsageError(f"{where}: max_bytes={max_bytes!r}; give a byte count >= 0 (or None)")
    return max_bytes


def too_large(size: int, max_bytes: int, where: str) -> LimitError:
    """The error for an object of `size` bytes read with max_bytes (refused before reading)."""
    return LimitError(f"{where}: object of {size} bytes, more than the {max_bytes} expected "
                      "(its manifest entry or the limit), refused before reading it whole: the "
                      "store holds something other than what was published; republish or "
                      "remove it")


def check_timeout(timeout: float | None, default: float | None, where: str) -> float | None:
    """Seconds this call may take: `timeout`, or the store's `default` when None.

    None (no default either) means the backend's own per-operation bounds only.
    Raises UsageError for a timeout that is not a positive finite number.
    """
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise UsageError(f"{where}: timeout={timeout!r}; give seconds > 0 (or None for the "
                         "store's default)")
    return float(timeout)


@runtime_checkable
class Readable(Protocol):
    """Reads whole objects. Safe to share between threads."""

    url: str

    def get(self, key: str, *, timeout: float | None = None,
            max_bytes: int | None = None) -> bytes:
        """The whole object. Raises ObjectNotFound; LimitError, having read at most
        max_bytes + 1 bytes, when the object is larger than `max_bytes` (None: no bound)."""
        ...

    def size(self, key: str, *, timeout: float | None = None) -> int:
        """Byte size of the object. Raises ObjectNotFound."""
        ...


@runtime_checkable
class RangeReadable(Protocol):
    """Reads parts of objects. Safe to share between threads."""

    url: str

    def get_range(self, key: str, start: int, stop: int, *,
                  timeout: float | None = None) -> bytes:
        """Bytes [start, stop) of the object (stop exclusive, clipped at its end; b'' if
        stop <= start). Raises ObjectNotFound."""
        ...


@runtime_checkable
class Writable(Protocol):
    """Writes objects atomically. Safe to share between threads."""

    url: str

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False,
            timeout: float | None = None) -> None:
        """Write atomically: readers see the old object or the new one, never a part.

        create_only: fail with ObjectExists if the key is already there (the commit primitive:
        of writers racing for one key, exactly one wins, even across processes).
        """
        ...


@runtime_checkable
class Listable(Protocol):
    """Lists names under a prefix. Safe to share between threads."""

    url: str

    def children(self, prefix: str, *, timeout: float | None = None) -> list[str]:
        """Names directly under `prefix` ('' for the root): objects and sub-prefixes, sorted.
        An object, or a prefix with nothing under it, has none ([])."""
        ...


@runtime_checkable
class Deletable(Protocol):
    """Removes objects. Safe to share between threads."""

    url: str

    def delete(self, key: str, *, timeout: float | None = None) -> None:
        """Remove the object if present (no error if absent)."""
        ...


@runtime_checkable
class ReadableStore(Readable, RangeReadable, Listable, Protocol):
    """What a reader of versions needs: objects, ranges of them, and listings."""


@runtime_checkable
class Store(Readable, RangeReadable, Writable, Listable, Deletable, Protocol):
    """An object store holding versions: every ability. Implementations are thread-safe."""
