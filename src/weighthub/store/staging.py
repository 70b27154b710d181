"""Node-level staging: receivers on one host fetch each chunk from the store once, not once each.

`StagingStore` wraps any Store. Chunk objects (keys ending in `.whc`) are immutable once
written: a publish writes each under a key unique to that publish (catalog: `{rep}-{token}/`),
so a cached copy can never be stale. They are kept in a directory shared by every process on the
host (default /dev/shm/weighthub-<hash of the store URL>). Everything else (manifests, listings)
goes straight to the wrapped store: a manifest's create-only write *is* the commit, so its
presence must always be asked of the store itself.

Who fetches: the first process to miss a chunk takes an exclusive `flock` on that key's lock
file, fetches it, writes it to a temporary file and renames it into place; processes that miss
meanwhile block on the same lock (bounded by `lock_timeout`), then find the file and read it.
A holder that dies releases its lock with its file descriptors, so nobody waits for a corpse.
If the wait times out the waiter fetches for itself (correct, just not deduplicated).

Trust: the cache is a copy of bytes whose size and SHA-256 the receiver checks against the manifest
on every read, so a corrupt cached file is caught there (ChecksumError), never applied.

Size: after each insertion, if the cache holds more than `max_bytes`, whole versions are
evicted, oldest first (by the `v{version}` first key segment), never the one just written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..errors import StoreUnavailable, UsageError
from .base import Store, check_key

CHUNK_SUFFIX = ".whc"
_LOCKS = ".locks"


def default_stage_dir(url: str) -> Path:
    """/dev/shm/weighthub-<hash of url> (the system temp dir where there is no /dev/shm)."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return Path(base) / f"weighthub-{hashlib.sha256(url.encode()).hexdigest()[:16]}"


class StagingStore:
    """A Store that serves chunk objects from a host-wide cache shared between processes.

    Args:
        inner: the store to read through (S3, local, …).
        stage_dir: the shared cache directory; default `default_stage_dir(inner.url)`.
        max_bytes: cache size bound; the oldest versions are evicted past it.
        lock_timeout: longest wait for another process fetching the same chunk (seconds).
    """

    def __init__(self, inner: Store, stage_dir: str | os.PathLike[str] | None = None, *,
                 max_bytes: int = 4 << 30, lock_timeout: float = 120.0) -> None:
        if max_bytes <= 0 or lock_timeout <= 0:
            raise UsageError("StagingStore: max_bytes and lock_timeout must be > 0")
        self.inner = inner
        # the same URL: a target records where its version came from, and that is the store
        self.url = inner.url
        self.dir = Path(stage_dir) if stage_dir is not None else default_stage_dir(inner.url)
        self.max_bytes = max_bytes
        self.lock_timeout = lock_timeout
        self.fetched = 0  # chunks this process fetched from the inner store (for reports/tests)
        try:
            (self.dir / _LOCKS).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"cannot create the staging directory {self.dir}: "
                                   f"{exc.strerror}") from exc

    def __repr__(self) -> str:
        return f"StagingStore({self.inner!r}, stage_dir={str(self.dir)!r})"

    # -- cached reads ----------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        if not _is_chunk(key):
            return self.inner.get(key)
        path = self.dir / check_key(key)
        data = _read(path)
        if data is not None:
            return data
        with self._key_lock(key) as locked:
            data = _read(path)  # someone fetched it while we waited
            if data is not None:
                return data
            data = self.inner.get(key)
            self.fetched += 1
            if locked:  # without the lock another process may be writing it: do not race it
                self._insert(key, path, data)
        return data

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        if _is_chunk(key):
            path = self.dir / check_key(key)
            with contextlib.suppress(FileNotFoundError), path.open("rb") as f:
                f.seek(max(0, start))
                return f.read(max(0, stop - start))
        return self.inner.get_range(key, start, stop)

    def size(self, key: str) -> int:
        if _is_chunk(key):
            with contextlib.suppress(FileNotFoundError):
                return (self.dir / check_key(key)).stat().st_size
        return self.inner.size(key)

    # -- everything else goes to the store -------------------------------------------------------
    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        self.inner.put(key, data, create_only=create_only)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
        if _is_chunk(key):
            (self.dir / check_key(key)).unlink(missing_ok=True)

    def children(self, prefix: str) -> list[str]:
        return self.inner.children(prefix)

    # -- the cache -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[bool]:
        """Exclusive per-key flock, waited for at most lock_timeout; yields whether it is held."""
        name = hashlib.sha256(key.encode()).hexdigest()[:32]
        fd = os.open(self.dir / _LOCKS / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            locked = _flock(fd, fcntl.LOCK_EX, self.lock_timeout)
            try:
                yield locked
            finally:
                if locked:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _insert(self, key: str, path: Path, data: bytes) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
            try:
                tmp.write_bytes(data)
                os.replace(tmp, path)  # readers see the whole chunk or none of it
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS):
                return  # a full or read-only cache costs a refetch, never a failed sync
            raise StoreUnavailable(f"cannot write {path} in the staging directory: "
                                   f"{exc.strerror}") from exc
        self._evict(keep=key.split("/", 1)[0])

    def _evict(self, keep: str) -> None:
        """Delete whole versions, oldest first, until the cache fits in max_bytes."""
        fd = os.open(self.dir / _LOCKS / "evict", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 0):
                return  # another process is evicting right now
            versions = sorted(p for p in self.dir.iterdir() if p.is_dir() and p.name != _LOCKS)
            sizes = {p: _tree_bytes(p) for p in versions}
            total = sum(sizes.values())
            for p in versions:
                if total <= self.max_bytes:
                    break
                if p.name == keep:
                    continue
                # readers holding a file open keep its bytes; later readers miss and refetch
                shutil.rmtree(p, ignore_errors=True)
                total -= sizes[p]
        finally:
            os.close(fd)  # releases the flock

    def clear(self) -> None:
        """Delete every cached chunk (the directory stays)."""
        for p in self.dir.iterdir():
            if p.is_dir() and p.name != _LOCKS:
                shutil.rmtree(p, ignore_errors=True)


def _is_chunk(key: str) -> bool:
    return key.endswith(CHUNK_SUFFIX)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreUnavailable(f"cannot read {path} in the staging directory: "
                               f"{exc.strerror}") from exc


def _flock(fd: int, op: int, timeout: float) -> bool:
    """flock with a deadline (flock itself would wait forever): poll the non-blocking form."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, f)).st_size
    return total

