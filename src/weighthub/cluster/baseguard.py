"""A node's check that its target still holds the bits it committed: it trusts nothing else.

An edit behind weighthub's back (a tool writing into the output file, a stray process, a bad
disk) would otherwise be built upon: incremental digests only prove the words an apply
rewrote, so a flipped word elsewhere survives every later version. `pull` proves its base in
full each time; a node applies a version every few seconds to minutes, so it checks in two
tiers, both against what the node itself recorded:

    cheap   before every apply and every poll: a stat of each data file of a file target
            (size, mtime_ns, inode, ctime_ns) against the values taken right after the
            node's last commit. ctime cannot be set back by a user (os.utime sets it to now),
            so an edit that restores size and mtime still shows; a replaced file shows by its
            inode. A mismatch triggers a full check at once (a `touch` that changed no bit is
            re-recorded, not re-materialized). Sees nothing inside process memory.
    full    every `every_versions` committed versions or `every_s` seconds (0: never by that
            rule), and first after the node starts (it did not write what it finds there):
            every tensor digested against the held version's root (`verify.check_root`).
            The net under the cheap one: memory targets, edits in the window between a
            check and a commit (the commit's own stat then covers them), a bad disk.

What the guard does not do: re-materialize. It says what it found (`Finding`); the node
reports it, stops serving the bits and brings the target back through its join/receiver path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import BaseMismatch, WeighthubError
from ..receive.verify import check_root
from ..targets import SafetensorsTarget
from ..targets.base import Held, Target

Fingerprint = tuple[tuple[str, int, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class Finding:
    """The held bits are not the version the target claims: which check saw it, and how."""

    version: int | None  # the version the target claimed (None: not known to this node)
    check: str  # "stat": the files changed and their digests confirm it; "full": digests alone
    detail: str


def data_files(target: Target) -> list[Path]:
    """The files a target's bits live in (none for in-memory targets)."""
    if not isinstance(target, SafetensorsTarget):
        return []
    if target.is_file:
        return [target.path]
    try:
        return sorted(p for p in target.path.iterdir() if p.suffix == ".safetensors")
    except FileNotFoundError:
        return []


def fingerprint(files: list[Path]) -> Fingerprint:
    out = []
    for f in files:
        try:
            st = os.stat(f)
        except FileNotFoundError:
            out.append((str(f), -1, -1, -1, -1))
            continue
        out.append((str(f), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns))
    return tuple(out)


class BaseGuard:
    """See the module docstring. Called from the node's follow thread only.

    Args:
        target: the node's target (the inner one, not a wrapper that may hide what it holds).
        every_versions: a full check after this many committed versions (0: not by count).
        every_s: a full check after this many seconds (0: not by time).
    """

    def __init__(self, target: Target, *, every_versions: int, every_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.every_versions = every_versions
        self.every_s = every_s
        self._clock = clock
        self._root: str | None = None  # the root whose bits were last proved or committed
        self._version: int | None = None
        self._stat: Fingerprint = ()
        self._commits = 0  # commits since the last full check
        self._full_at = clock()
        self.full_checks = 0

    def committed(self, held: Held) -> None:
        """The node committed `held`: its bits are proved (digests), its files are as it left them."""
        self._root, self._version = held.root, held.version
        self._stat = fingerprint(data_files(self.target))
        self._commits += 1

    def check(self) -> Finding | None:
        """None if the held bits can be trusted (or nothing is held); else what was found."""
        try:
            held = self.target.held()
        except BaseMismatch as exc:  # the target's own stat check (its sidecar) saw the edit
            return Finding(self._version, "stat", str(exc))
        if held is None:
            return None
        stat = fingerprint(data_files(self.target))
        known = self._root == held.root  # else: just started, or committed by someone else
        if known and stat == self._stat and not self._due():
            return None
        check = "stat" if known and stat != self._stat else "full"
        try:
            check_root(self.target.peek(), self.target.specs() or [], held.root)
        except BaseMismatch as exc:
            return Finding(held.version, check, self._what(held, stat, exc))
        except (WeighthubError, OSError, ValueError) as exc:  # truncated, unreadable, not mappable
            return Finding(held.version, check, self._what(held, stat, f"its bits cannot be read "
                                                               f"({type(exc).__name__}: {exc})"))
        self._root, self._version, self._stat = held.root, held.version, stat
        self._commits, self._full_at = 0, self._clock()
        self.full_checks += 1
        return None

    def _what(self, held: Held, stat: Fingerprint, found: object) -> str:
        files = sorted({s[0] for s in set(stat) ^ set(self._stat)}) if self._stat else []
        changed = f"{', '.join(files)} changed since it was committed; " if files else ""
        return f"version {held.version}: {changed}{found}"

    def _due(self) -> bool:
        return ((self.every_versions > 0 and self._commits >= self.every_versions)
                or (self.every_s > 0 and self._clock() - self._full_at >= self.every_s))


def rematerializing(target: Target) -> Target | None:
    """The target to write a full representation over `target`'s modified bits through.

    None: `target` itself will (an in-memory target overwrites its tensors in place once the
    node's wrapper says it holds nothing). A safetensors file's own stat check is made to
    refuse the bits (its mtime moved by 2 s, beyond any filesystem's timestamp granularity:
    every `pull` refuses it too until the commit), and an instance that may rewrite such a
    file does so through a temporary and a rename: a failed attempt leaves it refused, never
    blessed.
    """
    if not isinstance(target, SafetensorsTarget):
        return None
    for f in data_files(target):
        try:
            st = os.stat(f)
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
        except OSError:  # missing: refused by its stat check already; not ours to touch:
            continue     # the instance below then rewrites it in place, which works or fails
    return SafetensorsTarget(target.path, overwrite=True)
