"""Local-directory store, the embedded default.

Writes go to a temporary file in the target directory, are fsynced, then renamed into place,
so readers never see a partial object. Create-only writes use link(2), which fails atomically if
the name exists: two publishers (even in different processes) racing for the same version see
exactly one winner.

Bounded waits: objects are opened with O_NONBLOCK and must be regular files, so a FIFO or a
device planted under a key is refused (StoreRefused) instead of blocking a reader forever. Data
moves in pieces of `PIECE` bytes with the call's deadline checked between pieces, so a slow disk
ends in StoreTimeout; a single system call that never returns (a hard NFS mount whose server
died) cannot be interrupted from Python and is the one wait this does not bound. Sizes are bounded
too: `get(max_bytes=)` refuses a file whose stat says it is larger before reading any of it, and
a read never goes past the size the stat gave (a file growing under a reader is not followed).

Temporary files: a writer creates `.tmp-<uuid>` and holds an exclusive flock on it until the
object is in place, so a writer killed mid-write (kill -9, power loss) leaves a `.tmp-*` file
whose lock is free. `sweep_temporaries` removes those, and only those: a file is a dead writer's
when nobody holds its lock and it has not been written to for STALE_TMP_S (the age covers the
instant between a writer creating the file and locking it). A store sweeps its directory tree
once, before its first write (a publish, a cache insert), so a publisher restarted after a crash
cleans up what its predecessor left.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
import uuid
from pathlib import Path

from ..errors import ObjectExists, ObjectNotFound, StoreRefused, StoreTimeout, UsageError
from .base import TMP_PREFIX, check_key, check_max_bytes, check_timeout, too_large

log = logging.getLogger(__name__)

PIECE = 64 << 20  # bytes per read/write between deadline checks: ~10-50 ms of a disk's time
STALE_TMP_S = 60.0  # an unlocked temporary file untouched this long is a dead writer's
_TIMED_OUT = (errno.ETIMEDOUT, errno.EAGAIN)  # soft network mounts report a lost server so


class LocalStore:
    """A store in a directory. Thread- and process-safe.

    Args:
        root: the directory (created unless `create=False`).
        timeout: default seconds per call; None: no deadline beyond the regular-file check.
    """

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True,
                 timeout: float | None = None) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = f"file://{self.root}"
        self.timeout = check_timeout(timeout, None, f"store {self.url}")
        self._swept = False  # dead writers' temporaries removed (before the first write)
        self._sweep_lock = threading.Lock()
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"store {self.root} exists and is not a directory")
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreRefused(f"cannot create store directory {self.root}: "
                                   f"{exc.strerror}; fix its permissions or choose another "
                                   "store") from exc

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _deadline(self, op: str, key: str, timeout: float | None) -> _Deadline:
        limit = check_timeout(timeout, self.timeout, f"{op} {key!r} in {self.url}")
        return _Deadline(f"{op} {key!r} in {self.url}", limit)

    def get(self, key: str, *, timeout: float | None = None,
            max_bytes: int | None = None) -> bytes:
        check_max_bytes(max_bytes, f"get {key!r} in {self.url}")
        return self._read(key, 0, None, self._deadline("get", key, timeout), max_bytes)

    def get_range(self, key: str, start: int, stop: int, *,
                  timeout: float | None = None) -> bytes:
        if start < 0 or stop < 0:
            raise UsageError(f"get_range({key!r}, {start}, {stop}): offsets must be >= 0")
        return self._read(key, start, stop, self._deadline("get_range", key, timeout))

    def size(self, key: str, *, timeout: float | None = None) -> int:
        path = self._path(key)
        self._deadline("size", key, timeout)  # validates it: a stat does not wait on data
        try:
            info = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(f"{key!r} is not in store {self.url}") from None
        except OSError as exc:
            raise _mapped(exc, f"cannot stat {path}") from exc
        if stat.S_ISDIR(info.st_mode):  # a prefix of other keys, not an object
            raise ObjectNotFound(f"{key!r} is not in store {self.url} (only keys under it are)")
        if not stat.S_ISREG(info.st_mode):  # a FIFO or device has no size worth reporting
            raise _not_regular(path, key)
        return info.st_size

    def _read(self, key: str, start: int, stop: int | None, deadline: _Deadline,
              max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(f"{key!r} is not in store {self.url}") from None
        except OSError as exc:
            raise _mapped(exc, f"cannot read {path}") from exc
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):  # a prefix of other keys, not an object
                raise ObjectNotFound(f"{key!r} is not in store {self.url} (only keys under it "
                                     "are)")
            if not stat.S_ISREG(info.st_mode):
                raise _not_regular(path, key)
            if max_bytes is not None and info.st_size > max_bytes:
                raise too_large(info.st_size, max_bytes, f"get {key!r} in {self.url}")
            end = info.st_size if stop is None else min(stop, info.st_size)
            pieces = []
            pos = start
            while pos < end:
                deadline.check(f"{pos - start}/{end - start} bytes read")
                piece = os.pread(fd, min(PIECE, end - pos), pos)
                if not piece:  # truncated under us: a writer replaced it, we had the old inode
                    break
                pieces.append(piece)
                pos += len(piece)
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)
        except OSError as exc:
            raise _mapped(exc, f"cannot read {path}") from exc
        finally:
            os.close(fd)

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False,
            timeout: float | None = None) -> None:
        path = self._path(key)
        deadline = self._deadline("put", key, timeout)
        self._sweep_once()
        tmp: Path | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = open_temporary(path.parent)
            try:  # the fd (and its lock) stay open until the object is in place
                view = memoryview(data).cast("B")
                total = len(view)
                while view:
                    deadline.check(f"{total - len(view)}/{total} bytes written")
                    view = view[os.write(fd, view[:PIECE]):]
                os.fsync(fd)
                deadline.check("written, not yet in place")  # a late write does not land
                if create_only:
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        raise ObjectExists(f"{key!r} already exists in store {self.url}") from None
                else:
                    os.replace(tmp, path)
                    tmp = None
                _fsync_dir(path.parent)
            finally:
                if tmp is not None:
                    tmp.unlink(missing_ok=True)
                os.close(fd)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise StoreRefused(f"store {self.root} is not writable ({exc.strerror}): fix "
                                   "its permissions or choose another store") from exc
            raise _mapped(exc, f"cannot write {path}") from exc

    def sweep_temporaries(self, *, older_than: float = STALE_TMP_S) -> int:
        """Remove the temporary files dead writers left in the store; see the module doc."""
        return sweep_temporaries(self.root, older_than=older_than)

    def _sweep_once(self) -> None:
        with self._sweep_lock:
            if self._swept:
                return
            self._swept = True
        removed = self.sweep_temporaries()
        if removed:
            log.info("store %s: removed %d temporary file(s) of killed writers", self.url,
                     removed)

    def delete(self, key: str, *, timeout: float | None = None) -> None:
        self._deadline("delete", key, timeout)  # validated; an unlink does not wait on data
        try:
            self._path(key).unlink(missing_ok=True)
        except NotADirectoryError:  # 'a/b' where 'a' is an object: nothing to delete
            return
        except OSError as exc:
            raise _mapped(exc, f"cannot delete {key!r} in {self.url}") from exc
        # drop now-empty parent directories so deleted versions leave nothing behind
        parent = self._path(key).parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def children(self, prefix: str, *, timeout: float | None = None) -> list[str]:
        path = self.root / check_key(prefix) if prefix else self.root
        self._deadline("children", prefix or "/", timeout)
        try:
            return sorted(p.name for p in path.iterdir() if not p.name.startswith(TMP_PREFIX))
        except (FileNotFoundError, NotADirectoryError):  # an object has no children
            return []
        except OSError as exc:
            raise _mapped(exc, f"cannot list {path}") from exc


class _Deadline:
    """The end of one call; `check` raises StoreTimeout once it has passed."""

    __slots__ = ("end", "limit", "what")

    def __init__(self, what: str, limit: float | None) -> None:
        self.what = what
        self.limit = limit
        self.end = None if limit is None else time.monotonic() + limit

    def check(self, progress: str) -> None:
        if self.end is not None and time.monotonic() > self.end:
            raise StoreTimeout(f"{self.what}: not done within {self.limit:g}s ({progress}); "
                               "the disk is slow or the mount hangs: retry, or raise timeout")


def _not_regular(path: Path, key: str) -> StoreRefused:
    return StoreRefused(f"{path} (key {key!r}) is not a regular file; a store holds only files "
                        "it wrote: remove it")


def open_temporary(directory: Path) -> tuple[int, Path]:
    """A new `.tmp-*` file in `directory`, open for writing and exclusively flocked: the lock
    says its writer is alive (`sweep_temporaries`), until the writer closes the fd or dies."""
    tmp = directory / f"{TMP_PREFIX}{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
    except OSError:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd, tmp


def sweep_temporaries(root: Path, *, older_than: float = STALE_TMP_S) -> int:
    """Remove every `.tmp-*` regular file under `root` that no live writer holds (its flock is
    free) and that has not been written to for `older_than` seconds. Returns how many.
    Best effort: a file it cannot open, lock or remove is left (and logged at debug level)."""
    removed = 0
    now = time.time()
    for where, _dirs, files in os.walk(root):
        for name in files:
            if not name.startswith(TMP_PREFIX):
                continue
            path = os.path.join(where, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError:
                continue  # gone already, a symlink, or unreadable: not ours to judge
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or now - info.st_mtime < older_than:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # a live writer holds it
                os.unlink(path)
                removed += 1
            except OSError as exc:
                log.debug("temporary %s not removed: %s", path, exc)
            finally:
                os.close(fd)
    return removed


def _mapped(exc: OSError, what: str) -> StoreTimeout | StoreRefused:
    """The store error for an OSError: a timed-out mount may come back, anything else won't."""
    if exc.errno in _TIMED_OUT:
        return StoreTimeout(f"{what}: {exc.strerror}; the file system did not answer in time: "
                            "retry, or check the mount")
    return StoreRefused(f"{what}: {exc.strerror}; check the disk and the store's permissions")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
