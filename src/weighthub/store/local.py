"""Local-directory store, the embedded default.

Writes go to a temporary file in the target directory, are fsynced, then renamed into place,
so readers never see a partial object. Create-only writes use link(2), which fails atomically if
the name exists: two publishers (even in different processes) racing for the same version see
exactly one winner.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from ..errors import ObjectExists, ObjectNotFound, StoreUnavailable, UsageError
from .base import check_key


class LocalStore:
    def __init__(self, root: str | os.PathLike[str], *, create: bool = True):
        self.root = Path(root).expanduser().absolute()
        self.url = f"file://{self.root}"
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"store {self.root} exists and is not a directory")
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreUnavailable(f"cannot create store directory {self.root}: "
                                       f"{exc.strerror}") from exc

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"{key!r} is not in store {self.url}") from None
        except OSError as exc:
            raise StoreUnavailable(f"cannot read {path}: {exc.strerror}") from exc

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        path = self._path(key)
        try:
            with path.open("rb") as f:
                f.seek(start)
                return f.read(max(0, stop - start))
        except FileNotFoundError:
            raise ObjectNotFound(f"{key!r} is not in store {self.url}") from None
        except OSError as exc:
            raise StoreUnavailable(f"cannot read {path}: {exc.strerror}") from exc

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise ObjectNotFound(f"{key!r} is not in store {self.url}") from None

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        path = self._path(key)
        tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            if create_only:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise ObjectExists(f"{key!r} already exists in store {self.url}") from None
            else:
                os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise StoreUnavailable(f"store {self.root} is not writable ({exc.strerror}): fix "
                                       "its permissions or choose another store") from exc
            raise StoreUnavailable(f"cannot write {path}: {exc.strerror}") from exc
        finally:
            if tmp.exists():
                tmp.unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"cannot delete {key!r} in {self.url}: {exc.strerror}") from exc
        # drop now-empty parent directories so deleted versions leave nothing behind
        parent = self._path(key).parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def children(self, prefix: str) -> list[str]:
        path = self.root / check_key(prefix) if prefix else self.root
        try:
            return sorted(p.name for p in path.iterdir() if not p.name.startswith(".tmp-"))
        except (FileNotFoundError, NotADirectoryError):  # an object has no children
            return []
        except OSError as exc:
            raise StoreUnavailable(f"cannot list {path}: {exc.strerror}") from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
