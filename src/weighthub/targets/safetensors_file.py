"""A safetensors file, or a directory of them, as a target updated through mmap.

What the file holds is recorded in a sidecar (`sidecar.py`), whose claim is kept true: it is
written only after the data it describes is durable. One transaction at a time per target,
across processes (`lock.py`: others wait, bounded, then get TargetBusy saying what it holds).

A missing target is materialized under a temporary name and renamed into place at commit, so a
failed pull leaves no data file behind. A held version is updated in one of two modes:

    in-place  the data files are mapped and written in place. Before each step the engine
              applies, the old words it may write are journaled (fsynced, `journal.py`; the
              engine's plan, O(changed)), and before the first the sidecar says "applying";
              at commit the data is fsynced, then the new sidecar written and the journal
              removed. A process killed anywhere in that leaves a journal from which the next
              open (or held()) restores the old version bit-exactly, without network.
    atomic    each data file is copied, the copy updated and fsynced, then renamed over the
              file (journaled, so a set of renames is completed or undone after a crash):
              programs that read the file and ignore the sidecar never see a mix.

The sidecar also records each data file's size and mtime at commit. A file whose size or
mtime changed since was modified outside weighthub: its bits are not trusted as the version
(BaseMismatch), and neither is a path weighthub did not write replaced (UsageError), unless
the target is opened with `overwrite=True` (`weighthub pull --force`).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Literal

import numpy as np

from ..errors import BaseMismatch, FormatError, UsageError
from ..tensors import TensorSpec, readonly
from . import sidecar as sc
from .base import Held, Plan
from .journal import Journal, UndoRecord, append_batch, fsync_dir, planned_records, write_journal
from .lock import TargetLock
from .recovery import Place, clean_stale, fsync_file, recover
from .safetensors_header import read_header
from .safetensors_io import load_checkpoint, write_empty_safetensors
from .sidecar import SIDECAR_DIR_NAME, SIDECAR_FILE_SUFFIX, Sidecar, data_files

# A directory OUT holds one data file: manifests describe tensors, not the files a checkpoint
# was published from, so a sharded checkpoint comes back as this one file (same names, bits)
DIR_DATA_FILE = "model.safetensors"


Mode = Literal["in-place", "atomic"]
MODES: tuple[Mode, ...] = ("in-place", "atomic")
_log = logging.getLogger(__name__)


class SafetensorsTarget:
    """OUT as a `.safetensors` file (path ends with .safetensors) or a directory of them.

    Args:
        path: OUT. A directory gets one file, DIR_DATA_FILE, when materialized.
        overwrite: replace a file OUT that weighthub did not write, and rewrite (rather than
            refuse) one modified outside weighthub. A directory holding files weighthub did not
            write is refused even so: replacing it would delete them.
        mode: how a held version is updated. "in-place" (default): the changed words are
            written into OUT (journaled first); a reader that ignores the sidecar may see a
            mix until the commit. "atomic": each data file is copied, the
            copy updated and renamed over OUT at commit, so such readers see the old file or
            the new one, whole (costs a copy of every data file per transaction).
        lock_timeout: seconds to wait for another process's transaction on OUT before
            raising TargetBusy.

    `recovered` says what the last recovery from a crash journal did (None: none was needed).
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = False,
                 mode: Mode = "in-place", lock_timeout: float = 60.0) -> None:
        if mode not in MODES:
            raise UsageError(f"mode={mode!r}: choose one of {', '.join(MODES)}")
        self.path = Path(path).absolute()
        self.is_file = self.path.suffix == ".safetensors"
        self.overwrite = overwrite
        self.mode = mode
        self.journal = self._beside("weighthub-journal")
        self._lock = TargetLock(self._beside("weighthub-lock"), timeout=lock_timeout,
                                describe=self.describe)
        self.recovered: str | None = None
        # the open transaction: its writable maps, the data files they are of, what was held
        # before, and whether a step was journaled (then the sidecar says "applying")
        self._txn = False
        self._before: Held | None = None
        self._maps: list[np.memmap] = []
        self._files: list[Path] = []
        self._journaled = False
        self._tmp: Path | None = None  # a materialization's temporary file or directory
        self._copies: list[tuple[Path, Path]] = []  # atomic mode: (temporary copy, data file)

    @property
    def _place(self) -> Place:
        return Place(self.path, self.sidecar, self.journal)

    def _beside(self, what: str) -> Path:
        return self.path.with_name(f".{self.path.name}.{what}")

    @property
    def sidecar(self) -> Path:
        if self.is_file:
            return self.path.with_name(self.path.name + SIDECAR_FILE_SUFFIX)
        return self.path / SIDECAR_DIR_NAME

    def exists(self) -> bool:
        return self.path.exists() and bool(data_files(self.path))

    def describe(self) -> str:
        """What OUT holds now, read without the lock (for messages)."""
        return sc.describe(self.path, self.sidecar, self.journal)

    # -- Target protocol ----------------------------------------------------------------------
    def held(self) -> Held | None:
        """The committed version OUT holds, or None: it holds nothing and is materialized.

        A crash journal left by a killed process is recovered first (under the lock; see
        `recover`). Anything short of a plainly committed, unmodified sidecar is judged again
        under the lock, so a commit by another process in flight is waited for, not misread.

        Raises:
            UsageError: OUT holds files weighthub did not write (refused before any fetch).
            BaseMismatch: OUT's files changed size or mtime since weighthub committed them, so
                its bits are not trusted as the version (unless `overwrite`: then it holds
                nothing and is rewritten from the store).
            TargetBusy: another process kept OUT locked past `lock_timeout`.
        """
        if self._txn:
            return self._before  # our own transaction: the bits are not committed yet
        side = sc.read_sidecar(self.sidecar)
        if not self.journal.exists() and (side is None or (
                side.state == "committed" and self.exists()
                and sc.changed_since(self.path, side) is None)):
            return self._judge(side)  # the common cases, without taking the lock
        with self._lock:
            self.recover()
            return self._judge(sc.read_sidecar(self.sidecar))

    def _judge(self, side: Sidecar | None) -> Held | None:
        if side is None:
            self._check_replaceable()
            return None
        if side.state != "committed" or not self.exists():
            return None
        changed = sc.changed_since(self.path, side)
        if changed is None:
            return side.held
        if self.overwrite:
            return None
        raise BaseMismatch(f"{self.path} was modified outside weighthub after it was pulled to "
                           f"version {side.version} ({changed}: size or mtime differ from "
                           f"{self.sidecar.name}); pull with --force to rewrite it from the store")

    def _check_replaceable(self) -> None:
        """Refuse to materialize over files weighthub did not write: a readable sidecar (and,
        in a directory, nothing but .safetensors files beside it) marks what it wrote."""
        if self.is_file:
            if self.path.exists() and sc.read_sidecar(self.sidecar) is None and not self.overwrite:
                raise UsageError(f"{self.path} exists and was not written by weighthub (no "
                                 f"{self.sidecar.name} beside it); pull with --force to replace "
                                 "it, or pull into another path")
        elif self.path.is_dir() and any(self.path.iterdir()) and not self._owned_directory():
            raise UsageError(f"{self.path} is a non-empty directory that holds no weighthub "
                             "version; remove it or pull into another path")

    def specs(self) -> list[TensorSpec] | None:
        if self.held() is None:
            return None  # not holding a version: it will be materialized afresh
        return sorted((e.spec for f in data_files(self.path) for e in read_header(f)),
                      key=lambda s: s.name)

    def peek(self) -> dict[str, np.ndarray]:
        if self._txn and self._maps:  # a wrapper's commit reads the bits being committed
            return {n: readonly(v) for n, v in self._views(self._maps, self._files).items()}
        if self.held() is None:
            return {}
        return self._map(data_files(self.path), "r")

    def open(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
        """Lock OUT (bounded wait), recover a crashed transaction, and return writable views:
        a mapping of the data files (in-place), of their copies (atomic), or of a new
        temporary (materializing)."""
        self.held()  # refuses foreign or modified files before leaving a lock file beside them
        self._lock.acquire()
        try:
            self.recover()
            clean_stale(self._place)
            self._before = held = self.held()
            self._txn = True
            if held is None:
                return self._materialize(specs)
            files = data_files(self.path)
            if self.mode == "atomic":
                token = uuid.uuid4().hex[:8]
                for f in files:
                    copy = f.with_name(f".{f.name}.tmp-{token}")
                    self._copies.append((copy, f))
                    shutil.copyfile(f, copy)
                return self._map([c for c, _ in self._copies], "r+")
            return self._map(files, "r+")
        except BaseException:
            self._end()
            raise

    def journal_step(self, plan: Plan) -> None:
        """Before a step writes in place: journal the old words it may write (fsynced), and
        before the first step, say "applying" in the sidecar. Temporaries (materializing,
        atomic) need no journal: they are discarded or renamed whole."""
        if not self._txn or self._before is None or self._tmp is not None or self._copies:
            return
        planned = plan()
        records = None if planned is None else planned_records(planned, self._maps)
        if records is None:  # not known ahead: every byte of every data file (views, no copies)
            records = [UndoRecord(i, 0, 0, None, m) for i, m in enumerate(self._maps)]
        append_batch(self.journal, Journal("undo", self._before, self._before,
                                           [f.name for f in self._files]), records)
        if not self._journaled:
            sc.write_sidecar(self.sidecar, Sidecar.of(self._before, "applying"))
            self._journaled = True

    def commit(self, held: Held) -> None:
        """Make `held` durable, then claim it: data fsynced before the sidecar says so; a crash
        anywhere in between is recovered from the journal by the next open or held()."""
        if not self._txn:
            raise UsageError(f"commit of {self.path} without an open transaction")
        try:
            if self._tmp is not None:
                self._commit_materialized(held)
            elif self._copies:
                self._maps.clear()
                self._commit_renames(list(self._copies), held)
            else:
                self._commit_in_place(held)
        except BaseException:
            self._txn = False
            self.recover()  # back to the old version if the write-back had begun
            raise
        finally:
            self._end()

    def abort(self) -> None:
        """Discard the transaction (the engine rolled the bits back): make that durable and
        claim the old version again; temporaries are deleted. Unlock."""
        try:
            in_place = self._txn and self._before is not None and not (self._tmp or self._copies)
            if in_place and self._before is not None:
                self._sync_maps()  # writing through the map (and back) moved the mtime
                side = sc.read_sidecar(self.sidecar)
                if self._journaled or side is None or sc.changed_since(self.path, side):
                    sc.write_sidecar(self.sidecar, Sidecar.of(self._before,
                                                              files=sc.file_stats(self.path)))
                self.journal.unlink(missing_ok=True)
        finally:
            self._end()

    # -- commits ------------------------------------------------------------------------------
    def _commit_in_place(self, held: Held) -> None:
        self._sync_maps()
        self._claim(held)

    def _sync_maps(self) -> None:
        for m, f in zip(self._maps, self._files, strict=True):
            m.flush()
            fsync_file(f)

    def _commit_renames(self, renames: list[tuple[Path, Path]], held: Held) -> None:
        for tmp, _ in renames:
            fsync_file(tmp)
        write_journal(self.journal, Journal("rename", self._before, held, [], [
            (t.name, f.name, t.stat().st_ino) for t, f in renames]))
        for tmp, final in renames:
            os.replace(tmp, final)
        fsync_dir(self._place.data_dir)
        self._copies.clear()
        self._claim(held)

    def _claim(self, held: Held) -> None:
        sc.write_sidecar(self.sidecar, Sidecar.of(held, files=sc.file_stats(self.path)))
        self.journal.unlink(missing_ok=True)

    def _commit_materialized(self, held: Held) -> None:
        for m in self._maps:
            m.flush()
        self._maps.clear()
        tmp, self._tmp = self._tmp, None
        if tmp is None:
            raise UsageError(f"{self.path}: nothing was materialized to commit")
        if self.is_file:
            self._commit_renames([(tmp, self.path)], held)
            return
        fsync_file(tmp / DIR_DATA_FILE)
        # renaming the directory keeps its files' mtimes: the sidecar goes inside, then the
        # directory is renamed into place (one rename: atomic)
        sc.write_sidecar(tmp / SIDECAR_DIR_NAME, Sidecar.of(held, files=sc.file_stats(tmp)))
        old = None
        if self.path.exists() and any(self.path.iterdir()):
            # weighthub's own directory (checked in _materialize), e.g. after a crash
            old = self._beside(f"old-{uuid.uuid4().hex[:8]}")
            os.replace(self.path, old)
        os.replace(tmp, self.path)  # rename(2) replaces an empty directory atomically
        fsync_dir(self.path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    # -- recovery -----------------------------------------------------------------------------
    def recover(self) -> str | None:
        """Finish what a killed process's transaction left (under the lock, no network).

        An undo journal puts back the old bytes (the old version, bit-exact) unless the new
        version's sidecar was already durable; a rename journal completes the renames if any
        happened, or deletes the temporaries (`recovery.py`). Returns (and records in
        `recovered`, and logs) what it did, or None when there was nothing to recover.
        """
        if self._txn:
            return None  # our own transaction's journal is not a crash's
        with self._lock:
            what = recover(self._place)
        if what is not None:
            self.recovered = what
            _log.warning("%s", what)
        return what

    # -- helpers ------------------------------------------------------------------------------
    def _end(self) -> None:
        """Close the transaction: drop its maps and temporaries, unlock."""
        self._maps.clear()
        self._files = []
        self._journaled = False
        self._discard_tmp()
        for copy, _ in self._copies:
            copy.unlink(missing_ok=True)
        self._copies.clear()
        self._txn = False
        if self._lock.held:  # the transaction's, or open()'s before it failed
            self._lock.release()

    def _discard_tmp(self) -> None:
        tmp, self._tmp = self._tmp, None
        if tmp is None:
            return
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)

    def _owned_directory(self) -> bool:
        """A directory weighthub wrote (a sidecar, .safetensors files and nothing else), so
        it may be re-materialized, e.g. after a crash left it "applying"."""
        if sc.read_sidecar(self.sidecar) is None:
            return False
        return all(p.name == SIDECAR_DIR_NAME or (p.suffix == ".safetensors" and p.is_file())
                   for p in self.path.iterdir())

    def _map(self, files: list[Path], mode: Literal["r", "r+"]) -> dict[str, np.ndarray]:
        """Views of `files`' tensors through maps opened with `mode`; writable maps are kept
        for the transaction."""
        maps = [np.memmap(f, dtype=np.uint8, mode=mode) for f in files]
        if mode != "r":
            self._maps, self._files = maps, [f for _, f in self._copies] or list(files)
        return self._views(maps, files)

    def _views(self, maps: list[np.memmap], files: list[Path]) -> dict[str, np.ndarray]:
        views: dict[str, np.ndarray] = {}
        for m, f in zip(maps, files, strict=True):
            for e in read_header(f):
                raw = m[e.offset: e.offset + e.spec.nbytes]
                if e.spec.nbytes and e.offset % e.spec.dtype.width:
                    raise FormatError(f"{f}: tensor {e.spec.name!r} is not aligned for in-place "
                                      "update; re-materialize the file")
                views[e.spec.name] = raw.view(e.spec.dtype.uint)
        return views

    def _materialize(self, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
        self._check_replaceable()  # again: held() does not see every path (a crashed apply's)
        token = uuid.uuid4().hex[:8]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self._beside(f"tmp-{token}")
        if self.is_file:
            file = self._tmp
        else:
            self._tmp.mkdir()
            file = self._tmp / DIR_DATA_FILE
        write_empty_safetensors(file, specs)
        return self._map([file], "r+")


__all__ = ["DIR_DATA_FILE", "MODES", "SIDECAR_DIR_NAME", "SIDECAR_FILE_SUFFIX", "SafetensorsTarget",
           "load_checkpoint", "write_empty_safetensors"]
