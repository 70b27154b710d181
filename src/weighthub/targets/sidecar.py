"""The sidecar of a safetensors target: what version its data files hold, and their stats.

`X.safetensors.weighthub.json` next to a file, `weighthub.json` inside a directory. Its claim
is kept true: it is written (fsynced, renamed into place, the directory fsynced) only after the
data it describes is durable, and says "applying" before an in-place write-back changes a byte.
It also records each data file's size and mtime at commit, so an edit outside weighthub is seen.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import msgspec

from .base import Held
from .journal import fsync_dir

SIDECAR_FILE_SUFFIX = ".weighthub.json"
SIDECAR_DIR_NAME = "weighthub.json"


class Sidecar(msgspec.Struct):
    store: str
    model: str
    version: int
    root: str
    state: str  # "committed" | "applying"
    # data file name → [size, mtime in ns] at commit; empty in sidecars older than this field
    # (those are trusted as before)
    files: dict[str, list[int]] = {}

    @classmethod
    def of(cls, held: Held, state: str = "committed",
           files: dict[str, list[int]] | None = None) -> Sidecar:
        return cls(held.store, held.model, held.version, held.root, state, files or {})

    @property
    def held(self) -> Held:
        return Held(self.store, self.model, self.version, self.root)


def data_files(path: Path) -> list[Path]:
    """The data files of OUT: itself, or the .safetensors files in it."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix == ".safetensors")
    return [path]


def file_stats(where: Path) -> dict[str, list[int]]:
    """Size and mtime (ns) of each data file at `where` (OUT, or its temporary), by name."""
    out = {}
    for f in data_files(where):
        st = f.stat()
        out[f.name] = [st.st_size, st.st_mtime_ns]
    return out


def read_sidecar(path: Path) -> Sidecar | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=Sidecar)
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # unreadable: treat as holding nothing (it will be re-materialized)


def write_sidecar(dest: Path, side: Sidecar) -> None:
    """Replace `dest` with `side` durably (a reader sees the old or the new one, whole)."""
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}")
    with tmp.open("wb") as f:
        f.write(msgspec.json.encode(side))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    fsync_dir(dest.parent)


def changed_since(where: Path, side: Sidecar) -> str | None:
    """The first data file whose size or mtime is not what the sidecar recorded, or None.

    Cheap enough for every held() (a stat per file). Blind to an edit that keeps the size
    within the filesystem's timestamp granularity of weighthub's own last write; a delta
    pull still proves the held bits first (verify_base), and `weighthub verify` all of them.
    """
    if not side.files:
        return None
    now = file_stats(where)
    for name in sorted(set(now) | set(side.files)):
        if now.get(name) != side.files.get(name):
            return name
    return None


def describe(out: Path, sidecar: Path, journal: Path) -> str:
    """What OUT holds according to its sidecar and crash journal, and whether it is consistent
    (for messages to a process that could not wait for another's transaction)."""
    side = read_sidecar(sidecar)
    if side is None:
        return "no version weighthub committed"
    what = f"version {side.version} (root {side.root[:12]}…)"
    if side.state != "committed":
        if journal.exists():
            return (f"{what} being changed: not consistent until that transaction commits or "
                    f"rolls back (if its process died, the next pull restores {what} from the "
                    "crash journal)")
        return f"{what} partly updated: not consistent; the next pull re-materializes it"
    if journal.exists():
        return f"{what}, consistent (a newer version's commit is being completed)"
    if out.exists() and data_files(out) and changed_since(out, side) is not None:
        return f"{what} according to its sidecar, but modified outside weighthub since"
    return f"{what}, consistent"


__all__ = ["SIDECAR_DIR_NAME", "SIDECAR_FILE_SUFFIX", "Sidecar", "changed_since", "data_files",
           "describe", "file_stats", "read_sidecar", "write_sidecar"]
