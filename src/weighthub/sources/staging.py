"""Host staging: receivers on one host fetch each chunk from elsewhere once, not once each.

`StagingSource` is the first source of a `SourceList`: a cache in a directory shared by every
process on the host (default /dev/shm/weighthub-<hash of the store URL>). Chunks are immutable
(a publish writes each under a key unique to that publish, and a cached copy is named by the
SHA-256 its manifest gives), so a cached copy can never be stale. Manifests are never cached:
they come from the store, whose create-only write of a manifest *is* the commit.

Who fetches: the list enters `claim(ref)` for each chunk. On a miss, the first process takes an
exclusive `flock` on that chunk's lock file and keeps it while the list fetches the chunk from
the next sources, checks it and `keep`s it here (written to a temporary file, renamed into
place); processes that miss meanwhile block on the same lock (bounded by `lock_timeout` and the
fetch's timeout), then find the file and read it. A holder that dies releases its lock with its
file descriptors, so nobody waits for a corpse. If the wait times out the waiter fetches for
itself (correct, just not deduplicated) and does not write the file another process is writing.

Trust: this cache checks nothing. The list checks every chunk's size and SHA-256 exactly once,
whichever source it came from: a corrupt cached file is caught there (and replaced by the
verified copy from the next source), never applied. A cached file is read only if it is a
regular file of the manifest's size, and never past it: anything else (a FIFO, a device, a link)
is a miss, so another user of a shared /dev/shm can cost a refetch, never a hang or the memory.
Temporary files of a receiver killed mid-insert are swept when a StagingSource is made
(`store.local.sweep_temporaries`: unlocked and a minute old).

Size: after each insertion, if the cache holds more than `max_bytes`, whole versions are
evicted, oldest first (`ChunkId.version`, the name of each version's directory here), never the
one just written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import ObjectNotFound, StoreRefused, UsageError
from ..store.base import Store
from ..store.local import open_temporary, sweep_temporaries
from . import ChunkId, ChunkSource, SourceList, StoreSource

log = logging.getLogger(__name__)

_LOCKS = ".locks"
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def default_stage_dir(url: str) -> Path:
    """/dev/shm/weighthub-<hash of url> (the system temp dir where there is no /dev/shm)."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return Path(base) / f"weighthub-{hashlib.sha256(url.encode()).hexdigest()[:16]}"


def host_sources(store: Store, stage_dir: str | os.PathLike[str] | None) -> SourceList:
    """A receiver's sources on a host without peers: the staging cache in `stage_dir` (if
    given: receivers on one host then fetch each chunk from the store once), then the store."""
    sources: list[ChunkSource] = [StoreSource(store)]
    if stage_dir is not None:
        sources.insert(0, StagingSource(stage_dir))
    return SourceList(sources)


class StagingSource:
    """A host-wide chunk cache shared between processes (a `SharedCache`); see the module doc.

    Args:
        stage_dir: the shared cache directory (e.g. `default_stage_dir(store.url)`).
        max_bytes: cache size bound; the oldest versions are evicted past it.
        lock_timeout: longest wait for another process fetching the same chunk (seconds).
    """

    def __init__(self, stage_dir: str | os.PathLike[str], *, max_bytes: int = 4 << 30,
                 lock_timeout: float = 120.0) -> None:
        if max_bytes <= 0 or lock_timeout <= 0:
            raise UsageError("StagingSource: max_bytes and lock_timeout must be > 0")
        self.dir = Path(stage_dir)
        self.name = f"staging {self.dir}"
        self.max_bytes = max_bytes
        self.lock_timeout = lock_timeout
        # (checksum, thread) pairs whose lock this process holds: `keep` writes only under it
        self._held: set[tuple[str, int]] = set()
        self._held_lock = threading.Lock()
        try:
            (self.dir / _LOCKS).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreRefused(f"cannot create the staging directory {self.dir}: "
                                   f"{exc.strerror}") from exc
        # what receivers killed mid-insert left (the directory is small: a quick walk)
        sweep_temporaries(self.dir)

    def __repr__(self) -> str:
        return f"StagingSource({str(self.dir)!r})"

    # -- source --------------------------------------------------------------------------------
    def get_chunk(self, ref: ChunkId, *, timeout: float) -> bytes:
        """The cached copy (a file read: never waits). Raises ObjectNotFound on a miss."""
        data = _read(self._path(ref), ref.size)
        if data is None:
            raise ObjectNotFound(f"chunk {ref.key}: not in {self.name}")
        return data

    @contextlib.contextmanager
    def claim(self, ref: ChunkId, *, timeout: float) -> Iterator[bytes | None]:
        """The cached copy, or None: then this caller fetches it and others wait (see module)."""
        path = self._path(ref)
        data = _read(path, ref.size)
        if data is not None:
            yield data
            return
        fd = self._lock_fd(ref)
        try:
            locked = flock_within(fd, fcntl.LOCK_EX, min(self.lock_timeout, timeout))
            token = (ref.checksum, threading.get_ident())
            if locked:
                with self._held_lock:
                    self._held.add(token)
            try:
                yield _read(path, ref.size)  # another process may have fetched it while we waited
            finally:
                if locked:
                    with self._held_lock:
                        self._held.discard(token)
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def keep(self, ref: ChunkId, data: bytes) -> None:
        """Insert a verified chunk (replacing a corrupt copy). Best effort: never raises.

        Written only under the chunk's lock: by the claim holder, or by anyone who can take the
        lock at once; otherwise another process is writing it, and racing it gains nothing.
        """
        with self._held_lock:
            held = (ref.checksum, threading.get_ident()) in self._held
        try:
            if held:
                self._insert(ref, data)
                return
            fd = self._lock_fd(ref)
            try:
                if flock_within(fd, fcntl.LOCK_EX, 0):
                    self._insert(ref, data)
            finally:
                os.close(fd)  # releases the flock
        except (OSError, StoreRefused) as exc:
            # a full or read-only cache costs a refetch, never a failed sync
            if getattr(exc, "errno", None) not in (errno.ENOSPC, errno.EDQUOT, errno.EACCES,
                                                   errno.EROFS):
                log.warning("chunk %s: not kept in %s (%s)", ref.key, self.name, exc)

    def clear(self) -> None:
        """Delete every cached chunk (the directory stays)."""
        for p in self._version_dirs():
            shutil.rmtree(p, ignore_errors=True)

    # -- the cache -------------------------------------------------------------------------------
    def _path(self, ref: ChunkId) -> Path:
        # named by what the bytes must hash to: a ChunkId built by hand with another checksum
        # must not name a path outside the cache
        if not _SHA256_HEX.match(ref.checksum) or ref.version < 0:
            raise UsageError(f"chunk {ref.key}: checksum {ref.checksum!r} / version "
                             f"{ref.version} cannot name a staging file")
        return self.dir / str(ref.version) / f"{ref.checksum}.whc"

    def _lock_fd(self, ref: ChunkId) -> int:
        self._path(ref)  # validates the checksum used as the lock file's name
        try:
            return os.open(self.dir / _LOCKS / ref.checksum, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreRefused(f"cannot open a lock file in the staging directory "
                                   f"{self.dir}: {exc.strerror}") from exc

    def _insert(self, ref: ChunkId, data: bytes) -> None:
        path = self._path(ref)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = open_temporary(path.parent)  # flocked: a sweep leaves it while we live
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view):]
            os.replace(tmp, path)  # readers see the whole chunk or none of it
        finally:
            tmp.unlink(missing_ok=True)
            os.close(fd)
        self._evict(keep=ref.version)

    def _version_dirs(self) -> list[Path]:
        return [p for p in self.dir.iterdir() if p.is_dir() and p.name.isascii() and p.name.isdigit()]

    def _evict(self, keep: int) -> None:
        """Delete whole versions, oldest first, until the cache fits in max_bytes."""
        fd = os.open(self.dir / _LOCKS / "evict", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not flock_within(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 0):
                return  # another process is evicting right now
            # directories of the layout before chunk ids (`v000000000042/...`) are never read again
            for old in self.dir.glob("v" + "[0-9]" * 12):
                shutil.rmtree(old, ignore_errors=True)
            versions = sorted(self._version_dirs(), key=lambda p: int(p.name))
            sizes = {p: _tree_bytes(p) for p in versions}
            total = sum(sizes.values())
            for p in versions:
                if total <= self.max_bytes:
                    break
                if int(p.name) == keep:
                    continue
                # readers holding a file open keep its bytes; later readers miss and refetch
                shutil.rmtree(p, ignore_errors=True)
                total -= sizes[p]
        finally:
            os.close(fd)  # releases the flock


def _read(path: Path, size: int) -> bytes | None:
    """The cached file at `path` if it is a regular file of exactly `size` bytes; None for a
    miss. Anything else found there (another size, a FIFO, a device or a link to one, planted
    or half-written) is a miss too, logged: it is never waited on or read past `size`, and
    the verified copy the list fetches next replaces it (`keep`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink: the cache never writes one
            log.warning("staging file %s is a symbolic link; ignored", path)
            return None
        raise StoreRefused(f"cannot read {path} in the staging directory: "
                           f"{exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            log.warning("staging file %s is not a regular file of the chunk's %d bytes; "
                        "ignored", path, size)
            return None
        pieces, got = [], 0
        while got < size:
            piece = os.pread(fd, size - got, got)
            if not piece:
                return None  # truncated under us: a miss
            pieces.append(piece)
            got += len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)
    except OSError as exc:
        raise StoreRefused(f"cannot read {path} in the staging directory: "
                           f"{exc.strerror}") from exc
    finally:
        os.close(fd)


def flock_within(fd: int, op: int, timeout: float, *, max_sleep: float = 0.05) -> bool:
    """flock with a deadline (flock itself would wait forever): poll the non-blocking form,
    sleeping 2 ms at first and at most `max_sleep` between tries. Whether it got the lock."""
    deadline = time.monotonic() + timeout
    delay = min(0.002, max_sleep)
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, max_sleep)


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, f)).st_size
    return total
