"""The crash journal of a file target: what to undo (or finish) if its process dies mid-commit.

One file next to the target (`.NAME.weighthub-journal`), written and fsynced before the
bytes it covers change, removed once the new (or restored) sidecar is durable. Two kinds:

    undo    an in-place transaction: before each step, the old words of every place the step
            may write. Recovery writes them back in reverse order: the old version, bit-exact,
            with no network.
    rename  an atomic commit or a materialization: fsynced temporaries and the names they
            replace. Recovery finishes the renames if any happened (the new version), or
            deletes the temporaries (the old version): a set of renames is not atomic.

Layout: a JSON header line, then batches, one per step of an in-place transaction (one, empty,
for renames): `WHJB` + u64 count, undo records (struct `<IQBQ`: file index, byte offset, word
width (0: a byte range), count; then int64 positions and old words, or `count` old bytes), and
`WHJE`. The records are fsynced before the end mark is written, and the end mark before the
data the batch covers changes: a batch cut short was being written while that data was still
untouched, and is ignored (a journal with no complete batch, entirely).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import FormatError
from .base import Held

_RECORD = struct.Struct("<IQBQ")
_BATCH = struct.Struct("<4sQ")  # start mark, record count
_START, _END = b"WHJB", b"WHJE"
_WIDTHS = (0, 1, 2, 4, 8)


@dataclass(slots=True)
class UndoRecord:
    """Old bytes of one range of data file `file`: words at `positions` of the word array that
    starts at byte `offset` (width > 0), or `old` as raw bytes at `offset` (width 0)."""

    file: int
    offset: int
    width: int
    positions: np.ndarray | None
    old: np.ndarray

    def region(self, data: np.ndarray) -> np.ndarray:
        """This record's words (or bytes) in `data`, one data file's bytes (uint8, mapped)."""
        if self.positions is None:
            return data[self.offset: self.offset + self.old.nbytes]
        end = self.offset + (int(self.positions.max()) + 1) * self.width  # (any order)
        return data[self.offset: end].view(f"u{self.width}")


@dataclass(slots=True)
class Journal:
    kind: str  # "undo" | "rename"
    before: Held | None  # the committed version before the transaction
    after: Held  # the version being committed
    files: list[str]  # data file names the records' `file` indexes (undo)
    renames: list[tuple[str, str, int]] = field(default_factory=list)  # (temporary, final, inode)
    records: list[UndoRecord] = field(default_factory=list)


def fsync_dir(path: Path) -> None:
    """Make a rename or an unlink in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _held(h: Held | None) -> dict[str, object] | None:
    return None if h is None else {"store": h.store, "model": h.model, "version": h.version,
                                   "root": h.root}


def _pack(r: UndoRecord) -> list[bytes | memoryview]:
    n = r.old.size if r.positions is None else int(r.positions.size)
    out: list[bytes | memoryview] = [_RECORD.pack(r.file, r.offset, r.width, n)]
    if r.positions is not None:
        out.append(np.ascontiguousarray(r.positions, np.int64).data)
    out.append(np.ascontiguousarray(r.old).data)
    return out


def append_batch(path: Path, journal: Journal, records: Iterable[UndoRecord] = ()) -> None:
    """Append one batch of `records` to the journal at `path` (created with `journal`'s header
    if missing) durably: the records, fsync, the batch's end mark, fsync (and the directory's
    fsync when created). Only then may the data files change as the batch says."""
    head = {"kind": journal.kind, "before": _held(journal.before), "after": _held(journal.after),
            "files": journal.files, "renames": journal.renames}
    created = not path.exists()
    with path.open("ab") as f:
        if created:
            f.write(json.dumps(head).encode() + b"\n")
        batch = list(records)
        f.write(_BATCH.pack(_START, len(batch)))
        for r in batch:
            for part in _pack(r):
                f.write(part)
        f.flush()
        os.fsync(f.fileno())
        f.write(_END)
        f.flush()
        os.fsync(f.fileno())
    if created:
        fsync_dir(path.parent)


def write_journal(path: Path, journal: Journal, records: Iterable[UndoRecord] = ()) -> None:
    """A new journal at `path` holding one batch (see append_batch)."""
    path.unlink(missing_ok=True)
    append_batch(path, journal, records)


def read_journal(path: Path) -> Journal | None:
    """The journal at `path` with the records of its complete batches, or None if there is
    none or no batch of it is complete (nothing it covers had changed yet). A batch cut short
    at the end is ignored: the step it was written for had not begun.

    Undo records are read-only views of the journal file (mapped, not loaded).

    Raises:
        FormatError: a journal that does not parse (the target cannot be recovered from it;
            the caller treats the target as holding nothing).
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size == 0:
        return None
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        line = bytes(raw[: min(size, 1 << 20)]).split(b"\n", 1)[0]
        if len(line) + 1 > size:
            return None  # the header itself was cut short
        head = json.loads(line)
        before = None if head["before"] is None else Held(**head["before"])
        out = Journal(head["kind"], before, Held(**head["after"]), list(head["files"]),
                      [(str(t), str(f), int(i)) for t, f, i in head["renames"]])
        if out.kind not in ("undo", "rename"):
            raise ValueError(f"kind {out.kind!r}")
        at, batches = len(line) + 1, 0
        while at < size:
            batch = _batch(raw, at, size, out)
            if batch is None:
                break  # cut short while being written: its step had not begun
            records, at = batch
            out.records += records
            batches += 1
    except (ValueError, KeyError, TypeError, struct.error, RecursionError) as exc:
        raise FormatError(f"{path}: crash journal does not parse ({exc})") from None
    return out if batches else None


def _batch(raw: np.ndarray, at: int, size: int, out: Journal
           ) -> tuple[list[UndoRecord], int] | None:
    """One batch from byte `at`: its records and where the next begins; None if cut short."""
    if at + _BATCH.size > size:
        return None
    magic, count = _BATCH.unpack(raw[at: at + _BATCH.size].tobytes())
    if magic != _START:
        raise ValueError(f"no batch at byte {at}")
    at += _BATCH.size
    records = []
    for _ in range(count):
        if at + _RECORD.size > size:
            return None
        file, offset, width, n = _RECORD.unpack(raw[at: at + _RECORD.size].tobytes())
        at += _RECORD.size
        if width not in _WIDTHS or file >= len(out.files):
            raise ValueError(f"record at byte {at}: width {width}, file {file}")
        nbytes = n * max(width, 1) + (8 * n if width else 0)
        if at + nbytes > size:
            return None
        positions = None
        if width:
            positions = raw[at: at + 8 * n].view(np.int64)
            at += 8 * n
        old = raw[at: at + n * max(width, 1)].view(f"u{width}" if width else np.uint8)
        at += n * max(width, 1)
        records.append(UndoRecord(file, offset, width, positions, old))
    if at + len(_END) > size:
        return None
    if raw[at: at + len(_END)].tobytes() != _END:
        raise ValueError(f"batch ending at byte {at} has no end mark")
    return records, at + len(_END)


def planned_records(planned: list[tuple[np.ndarray, np.ndarray | None]],
                    maps: Sequence[np.ndarray]) -> list[UndoRecord] | None:
    """Undo records of the old words a step plans to write (see receive.undo_plan) in the
    data files mapped by `maps`, or None if a range lies outside them. Ranges written whole are
    views of the maps, not copies: the journal is written before any of them changes."""
    out = []
    for dst, pos in planned:
        where = _locate(dst, maps)
        if where is None:
            return None
        file, offset = where
        if pos is None:
            if dst.size:
                out.append(UndoRecord(file, offset, 0, None, dst.reshape(-1).view(np.uint8)))
        elif pos.size:
            out.append(UndoRecord(file, offset, dst.dtype.itemsize, pos, dst[pos]))
    return out


def _locate(view: np.ndarray, maps: Sequence[np.ndarray]) -> tuple[int, int] | None:
    """(file index, byte offset) of contiguous `view` inside one of `maps`, or None."""
    if not view.flags.c_contiguous:
        return None
    at = view.ctypes.data
    for i, m in enumerate(maps):
        base = m.ctypes.data
        if base <= at and at + view.nbytes <= base + m.nbytes:
            return i, at - base
    return None


def replay_undo(records: list[UndoRecord], data: Sequence[np.ndarray]) -> None:
    """Write each record's old bytes back into `data` (each data file's bytes, writable),
    newest first: a range changed twice ends with its oldest bytes.

    Raises:
        FormatError: a record outside its data file (a journal that is not this target's).
    """
    for r in reversed(records):
        d = data[r.file]
        region = r.region(d) if r.positions is None or r.positions.size else None
        if region is None:
            continue
        want = r.old.size if r.positions is None else int(r.positions.max()) + 1
        if region.size != want or (r.positions is not None and int(r.positions.min()) < 0):
            raise FormatError(f"crash journal record at byte {r.offset} of data file {r.file} "
                              "lies outside it: the journal is not this target's")
        if r.positions is None:
            region[:] = r.old
        else:
            region[r.positions] = r.old


__all__ = ["Journal", "UndoRecord", "append_batch", "fsync_dir", "planned_records", "read_journal",
           "replay_undo", "write_journal"]
