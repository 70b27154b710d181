"""Recovering a file target after a process was killed mid-transaction (no network).

Called by `SafetensorsTarget` under its lock, so whatever a journal or temporary describes
belongs to a dead process, never to a live transaction. See `journal.py` for what is written
when, and `safetensors_file.py` for the commit order this undoes or completes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError
from .journal import Journal, fsync_dir, read_journal, replay_undo
from .sidecar import Sidecar, file_stats, read_sidecar, write_sidecar


@dataclass(frozen=True, slots=True)
class Place:
    """Where a target's parts live: OUT (a file or a directory), its sidecar and its journal."""

    out: Path
    sidecar: Path
    journal: Path

    @property
    def data_dir(self) -> Path:
        """The directory holding the data files (and the temporaries renamed over them)."""
        return self.out if self.out.is_dir() else self.out.parent


def recover(place: Place) -> str | None:
    """Undo or complete the transaction a journal describes; what was done, or None if there
    was nothing to do (no journal, one cut short before any data changed, or a commit whose
    new sidecar was already durable)."""
    try:
        journal = read_journal(place.journal)
    except FormatError as exc:
        place.journal.unlink(missing_ok=True)
        return (f"{exc}: removed; {place.out} is re-materialized by the next pull unless its "
                "sidecar says it is consistent")
    if journal is None:
        place.journal.unlink(missing_ok=True)  # none, or cut short: the data is untouched
        return None
    side = read_sidecar(place.sidecar)
    claimed = None if side is None or side.state != "committed" else (side.version, side.root)
    # the new version's claim is durable: the commit happened (an undo journal knows only the
    # version before: any other committed claim is the new one's)
    before = None if journal.before is None else (journal.before.version, journal.before.root)
    if claimed is not None and (claimed != before if journal.kind == "undo"
                                else claimed == (journal.after.version, journal.after.root)):
        place.journal.unlink()
        return None
    if journal.kind == "undo":
        return _undo(place, journal)
    return _renames(place, journal)


def _undo(place: Place, journal: Journal) -> str:
    try:
        if journal.before is None:
            raise ValueError("an undo journal without the version before")
        files = [place.data_dir / n for n in journal.files]
        maps = [np.memmap(f, dtype=np.uint8, mode="r+") for f in files]
        replay_undo(journal.records, maps)
        for m, f in zip(maps, files, strict=True):
            m.flush()
            fsync_file(f)
    except (OSError, ValueError, FormatError) as exc:
        # the sidecar says "applying": held() is None and the next pull re-materializes
        place.journal.unlink(missing_ok=True)
        return (f"{place.out}: a killed process's update could not be rolled back from its "
                f"journal ({exc}); it holds nothing trusted and the next pull re-materializes it")
    before = journal.before
    write_sidecar(place.sidecar, Sidecar.of(before, files=file_stats(place.out)))
    place.journal.unlink()
    return (f"{place.out}: a process was killed while updating it; rolled back to version "
            f"{before.version} from its crash journal (bit-exact, no network)")


def _renames(place: Place, journal: Journal) -> str:
    where = place.data_dir
    done = [inode(where / final) == ino for _, final, ino in journal.renames]
    if any(done):  # the new version's files are (partly) in place: finish the set
        for (tmp, final, _), moved in zip(journal.renames, done, strict=True):
            if not moved and (where / tmp).exists():  # (gone only if removed by hand)
                os.replace(where / tmp, where / final)
        fsync_dir(where)
        write_sidecar(place.sidecar, Sidecar.of(journal.after, files=file_stats(place.out)))
        place.journal.unlink()
        return (f"{place.out}: a process was killed while committing version "
                f"{journal.after.version}; its renames were completed from the crash journal "
                "(no network)")
    for tmp, _, _ in journal.renames:
        (where / tmp).unlink(missing_ok=True)
    place.journal.unlink()
    before = "nothing" if journal.before is None else f"version {journal.before.version}"
    return (f"{place.out}: a process was killed before committing version "
            f"{journal.after.version}; its temporaries were removed and it holds {before} as "
            "before")


def clean_stale(place: Place) -> None:
    """Remove temporaries a killed process left beside OUT, inside it, and the sidecar's."""
    out = place.out
    stale = [p for p in out.parent.iterdir()
             if p.name.startswith((f".{out.name}.tmp-", f".{out.name}.old-"))]
    if out.is_dir():  # atomic mode's copies of data files
        stale += [p for p in out.iterdir()
                  if p.name.startswith(".") and ".safetensors.tmp-" in p.name]
    if place.sidecar.parent.is_dir():
        stale += [p for p in place.sidecar.parent.iterdir()
                  if p.name.startswith(f".{place.sidecar.name}.")]
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


__all__ = ["Place", "clean_stale", "fsync_file", "inode", "recover"]
