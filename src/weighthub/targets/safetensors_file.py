"""A safetensors file, or a directory of them, as a target updated in place through mmap.

What the file holds is recorded in a sidecar (`X.safetensors.weighthub.json` next to a file,
`weighthub.json` inside a directory), written atomically at commit. A missing target is
materialized under a temporary name and renamed into place at commit, so a failed pull leaves
no file behind. While an in-place update runs the sidecar says "applying": a pull that finds
that state (a crashed process) re-materializes the file rather than trusting mixed bits.

The sidecar also records each data file's size and mtime at commit. A file whose size or
mtime changed since was modified outside weighthub: its bits are not trusted as the version
(BaseMismatch), and neither is a path weighthub did not write replaced (UsageError), unless
the target is opened with `overwrite=True` (`weighthub pull --force`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from pathlib import Path

import msgspec
import numpy as np
import torch

from ..errors import BaseMismatch, FormatError, UsageError
from ..tensors import TensorSpec
from .base import Held
from .safetensors_header import entries, header_object, read_header

SIDECAR_FILE_SUFFIX = ".weighthub.json"
SIDECAR_DIR_NAME = "weighthub.json"
# A directory OUT holds one data file: manifests describe tensors, not the files a checkpoint
# was published from, so a sharded checkpoint comes back as this one file (same names, bits)
DIR_DATA_FILE = "model.safetensors"


def _files_of(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix == ".safetensors")
    return [path]


def _file_stats(where: Path) -> dict[str, list[int]]:
    """Size and mtime (ns) of each data file at `where` (OUT, or its temporary), by name."""
    out = {}
    for f in _files_of(where):
        st = f.stat()
        out[f.name] = [st.st_size, st.st_mtime_ns]
    return out


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a .safetensors file or a directory of them into CPU tensors (copies, not maps:
    a later in-place pull into the same file must not change tensors already loaded)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"checkpoint {p} does not exist")
    files = _files_of(p)
    if not files:
        raise UsageError(f"{p} holds no .safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            header = header_object(f)
        except FormatError as exc:  # a .bin, a .pt, a text file: the caller named the wrong file
            detail = str(exc).removeprefix(f"{f}: ")
            raise UsageError(f"{f} is not a safetensors file ({detail}); give a .safetensors file "
                             "or a directory of them") from None
        for e in entries(f, *header):
            if e.spec.name in state:
                raise FormatError(f"{f}: tensor {e.spec.name!r} appears in two files")
            words = np.fromfile(f, dtype=e.spec.dtype.uint, count=e.spec.numel, offset=e.offset)
            t = torch.from_numpy(words.view(np.uint8))
            state[e.spec.name] = t.view(e.spec.dtype.torch_dtype).reshape(e.spec.shape)
    return state


class _Sidecar(msgspec.Struct):
    store: str
    model: str
    version: int
    root: str
    state: str  # "committed" | "applying"
    # data file name → [size, mtime in ns] at commit; empty in sidecars older than this field
    # (those are trusted as before)
    files: dict[str, list[int]] = {}


class SafetensorsTarget:
    """OUT as a `.safetensors` file (path ends with .safetensors) or a directory of them.

    Args:
        path: OUT. A directory gets one file, DIR_DATA_FILE, when materialized.
        overwrite: replace a file OUT that weighthub did not write, and rewrite (rather than
            refuse) one modified outside weighthub. A directory holding files weighthub did not
            write is refused even so: replacing it would delete them.
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        self.path = Path(path).absolute()
        self.is_file = self.path.suffix == ".safetensors"
        self.overwrite = overwrite
        self._maps: list[np.memmap] = []
        self._tmp: Path | None = None
        self._applying = False  # this instance marked the sidecar "applying" (see abort)

    # -- sidecar ------------------------------------------------------------------------------
    @property
    def sidecar(self) -> Path:
        if self.is_file:
            return self.path.with_name(self.path.name + SIDECAR_FILE_SUFFIX)
        return self.path / SIDECAR_DIR_NAME

    def _read_sidecar(self) -> _Sidecar | None:
        try:
            return msgspec.json.decode(self.sidecar.read_bytes(), type=_Sidecar)
        except FileNotFoundError:
            return None
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # unreadable: treat as holding nothing (it will be re-materialized)

    def _write_sidecar(self, side: _Sidecar, where: Path | None = None) -> None:
        dest = where or self.sidecar
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(msgspec.json.encode(side))
        os.replace(tmp, dest)

    def exists(self) -> bool:
        return self.path.exists() and bool(_files_of(self.path))

    # -- Target protocol ----------------------------------------------------------------------
    def held(self) -> Held | None:
        """The committed version OUT holds, or None: it holds nothing and is materialized.

        Raises:
            UsageError: OUT holds files weighthub did not write (refused before any fetch).
            BaseMismatch: OUT's files changed size or mtime since weighthub committed them, so
                its bits are not trusted as the version (unless `overwrite`: then it holds
                nothing and is rewritten from the store).
        """
        side = self._read_sidecar()
        if side is None:
            self._check_replaceable()
            return None
        if side.state != "committed" or not self.exists():
            return None
        changed = self._changed_since(side)
        if changed is None:
            return Held(side.store, side.model, side.version, side.root)
        if self.overwrite:
            return None
        raise BaseMismatch(f"{self.path} was modified outside weighthub after it was pulled to "
                           f"version {side.version} ({changed}: size or mtime differ from "
                           f"{self.sidecar.name}); pull with --force to rewrite it from the store")

    def _check_replaceable(self) -> None:
        """Refuse to materialize over files weighthub did not write: a readable sidecar (and,
        in a directory, nothing but .safetensors files beside it) marks what it wrote."""
        if self.is_file:
            if self.path.exists() and self._read_sidecar() is None and not self.overwrite:
                raise UsageError(f"{self.path} exists and was not written by weighthub (no "
                                 f"{self.sidecar.name} beside it); pull with --force to replace "
                                 "it, or pull into another path")
        elif self.path.is_dir() and any(self.path.iterdir()) and not self._owned_directory():
            raise UsageError(f"{self.path} is a non-empty directory that holds no weighthub "
                             "version; remove it or pull into another path")

    def _changed_since(self, side: _Sidecar) -> str | None:
        """The first data file whose size or mtime is not what the sidecar recorded, or None.

        Cheap enough for every held() (a stat per file). Blind to an edit that keeps the size
        within the filesystem's timestamp granularity of weighthub's own last write; a delta
        pull still proves the held bits first (verify_base), and `weighthub verify` all of them.
        """
        if not side.files:
            return None
        now = _file_stats(self.path)
        for name in sorted(set(now) | set(side.files)):
            if now.get(name) != side.files.get(name):
                return name
        return None

    def specs(self) -> list[TensorSpec] | None:
        if self.held() is None:
            return None  # not holding a version: it will be materialized afresh
        return sorted((e.spec for f in _files_of(self.path) for e in read_header(f)),
                      key=lambda s: s.name)

    def open(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
        held = self.held()
        try:
            if held is None:
                return self._materialize(specs)
            # map first: a file that cannot be updated in place must not be marked "applying"
            views = self._map(_files_of(self.path))
            self._write_sidecar(_Sidecar(held.store, held.model, held.version, held.root,
                                         "applying"))
            self._applying = True
            return views
        except BaseException:
            # the receiver calls open() outside its rollback scope: undo our own side effects
            # (not abort(): a sidecar left "applying" by a crashed process must stay so)
            self._maps.clear()
            self._discard_tmp()
            raise

    def commit(self, held: Held) -> None:
        for m in self._maps:
            m.flush()
        self._maps.clear()
        side = _Sidecar(held.store, held.model, held.version, held.root, "committed")
        self._applying = False
        if self._tmp is not None:
            tmp, self._tmp = self._tmp, None
            if self.is_file:
                # an old sidecar must not outlive the bits it describes if we crash in between
                self.sidecar.unlink(missing_ok=True)
                os.replace(tmp, self.path)
            else:
                side.files = _file_stats(tmp)  # renaming the directory keeps its files' mtimes
                self._write_sidecar(side, tmp / SIDECAR_DIR_NAME)
                old = None
                if self.path.exists() and any(self.path.iterdir()):
                    # weighthub's own directory (checked in _materialize), e.g. after a crash
                    old = self.path.with_name(f".{self.path.name}.old-{uuid.uuid4().hex[:8]}")
                    os.replace(self.path, old)
                os.replace(tmp, self.path)  # rename(2) replaces an empty directory atomically
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
                return
        side.files = _file_stats(self.path)
        self._write_sidecar(side)

    def abort(self) -> None:
        for m in self._maps:
            m.flush()
        self._maps.clear()
        if self._discard_tmp() or not self._applying:
            return  # never bless an "applying" sidecar that a crashed process left behind
        self._applying = False
        side = self._read_sidecar()
        if side is not None and side.state == "applying":
            side.state = "committed"  # the receiver rolled the bits back before calling abort
            side.files = _file_stats(self.path)  # rolling back wrote them: a new mtime
            self._write_sidecar(side)

    # -- helpers ------------------------------------------------------------------------------
    def _discard_tmp(self) -> bool:
        """Remove what _materialize created, if anything; True if there was something."""
        if self._tmp is None:
            return False
        tmp, self._tmp = self._tmp, None
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        return True

    def _owned_directory(self) -> bool:
        """A directory weighthub wrote (a sidecar, .safetensors files and nothing else), so
        it may be re-materialized, e.g. after a crash left it "applying"."""
        if self._read_sidecar() is None:
            return False
        return all(p.name == SIDECAR_DIR_NAME or (p.suffix == ".safetensors" and p.is_file())
                   for p in self.path.iterdir())

    def peek(self) -> dict[str, np.ndarray]:
        if self.held() is None:
            return {}
        return self._map(_files_of(self.path), writable=False)

    def _map(self, files: list[Path], *, writable: bool = True) -> dict[str, np.ndarray]:
        views: dict[str, np.ndarray] = {}
        for f in files:
            in_file = read_header(f)
            if not in_file:
                continue
            m = np.memmap(f, dtype=np.uint8, mode="r+" if writable else "r")
            if writable:
                self._maps.append(m)  # flushed at commit/abort
            for e in in_file:
                raw = m[e.offset: e.offset + e.spec.nbytes]
                if e.spec.nbytes and e.offset % e.spec.dtype.width:
                    raise FormatError(f"{f}: tensor {e.spec.name!r} is not aligned for in-place "
                                      "update; re-materialize the file")
                views[e.spec.name] = raw.view(e.spec.dtype.uint)
        return views

    def _materialize(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
        self._check_replaceable()  # again: held() does not see every path (a crashed apply's)
        token = uuid.uuid4().hex[:8]
        if self.is_file:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._tmp = file = self.path.with_name(f".{self.path.name}.tmp-{token}")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._tmp = self.path.with_name(f".{self.path.name}.tmp-{token}")
            self._tmp.mkdir()
            file = self._tmp / DIR_DATA_FILE
        write_empty_safetensors(file, specs)
        return self._map([file])


def write_empty_safetensors(path: Path, specs: list[TensorSpec]) -> None:
    """A safetensors file with the given tensors, zero-filled (sparse).

    Tensors are laid out widest dtype first: safetensors wants contiguous data, and this order
    keeps every tensor aligned to its width so it can be updated through integer views.
    """
    header: dict[str, object] = {}
    offset = 0
    for s in sorted(specs, key=lambda s: (-s.dtype.width, s.name)):
        header[s.name] = {"dtype": s.dtype.name, "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)


__all__ = ["DIR_DATA_FILE", "SafetensorsTarget", "load_checkpoint", "write_empty_safetensors"]
