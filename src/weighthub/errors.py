"""One error tree for weighthub.

Every error says what failed, where, and what to do next. Backend exceptions (OSError,
zstd errors, …) are mapped once, at the seam where they happen (`raise X(...) from exc`).

    WeighthubError
    ├── UsageError              bad arguments, paths or settings given by the caller
    ├── FormatError             bytes that do not parse: hostile, truncated or corrupt input
    │   ├── ChecksumError       a chunk or manifest whose checksum does not match
    │   ├── UnknownCodecError   a codec/op name or id this build does not know
    │   ├── FormatVersionError  a format version this build cannot read
    │   └── LimitError          a size, count or offset over the format's limits
    ├── StoreError              the object store failed
    │   ├── ObjectNotFound      a key that is not there
    │   ├── ObjectExists        a create-only write lost the race (someone else committed)
    │   └── StoreUnavailable    the store cannot be read or written
    │       ├── StoreTimeout    it did not answer in time: retrying may help
    │       └── StoreRefused    it answered no (permissions, I/O error, bad credentials)
    ├── VersionError            the version history does not allow what was asked
    │   ├── VersionNotFound     no committed version with that number
    │   ├── NoSyncPath          no chain of retained versions reaches the target
    │   ├── BaseMismatch        a delta whose base is not what the receiver holds
    │   └── ModelMismatch       tensor names, dtypes or shapes differ from the store's model
    ├── IntegrityError          bits that are not what the manifest says (digest mismatch)
    ├── ApplyError              the target failed during apply; it was rolled back
    ├── TargetBusy              another process holds the target's transaction lock (bounded
    │                           wait ran out); nothing was changed: retry later
    ├── PlacementError          a serving engine's loader or a shard layout does not place the
    │                           canonical tensors as declared (gaps, overlaps, renamed/skipped)
    ├── AttestationError        rollouts whose policy the trainer cannot vouch for: unattested,
    │                           not published by it, too stale, or weights drifted under it
    └── NetError                a peer, relay or hub failed
        ├── AuthError           a request without a valid token was refused (or ours was)
        └── PeerUnavailable     a peer/hub cannot serve what was asked
            ├── PeerTimeout     it did not answer in time (dead or overloaded): fail over
            └── PeerRefused     it answered no (busy, not holding the version): ask another
"""

from __future__ import annotations


class WeighthubError(Exception):
    """Base of every error weighthub raises on purpose."""


class UsageError(WeighthubError):
    """Bad arguments, paths or settings given by the caller."""


class FormatError(WeighthubError):
    """Bytes that do not parse as a weighthub chunk frame or manifest."""


class ChecksumError(FormatError):
    """A chunk or manifest whose stored checksum does not match its bytes."""


class UnknownCodecError(FormatError):
    """A codec, op or dtype name/id that this build does not know."""


class FormatVersionError(FormatError):
    """A format version this build cannot read."""


class LimitError(FormatError):
    """A declared size, count or offset beyond the format's limits (refused before allocation)."""


class StoreError(WeighthubError):
    """The object store failed."""


class ObjectNotFound(StoreError):
    """A key that is not in the store."""


class ObjectExists(StoreError):
    """A create-only write found the key already there: another writer committed first."""


class StoreUnavailable(StoreError):
    """The store cannot be read or written (permissions, I/O error, timeout)."""


class StoreTimeout(StoreUnavailable):
    """The store did not answer in time (a retry may succeed)."""


class StoreRefused(StoreUnavailable):
    """The store answered, and refused (permissions, I/O error, credentials): retrying won't help."""


class VersionError(WeighthubError):
    """The version history does not allow what was asked."""


class VersionNotFound(VersionError):
    """No committed version with that number."""


class NoSyncPath(VersionError):
    """No chain of retained representations reaches the target version."""


class BaseMismatch(VersionError):
    """A delta whose base version or digest is not what the receiver holds."""


class ModelMismatch(VersionError):
    """Tensor names, dtypes or shapes differ from the store's model."""


class IntegrityError(WeighthubError):
    """Bits that are not what the manifest says (a digest mismatch after apply or on verify)."""


class ApplyError(WeighthubError):
    """The target failed while changes were applied; it was rolled back to its committed version."""


class TargetBusy(WeighthubError):
    """Another process is changing the target (its lock stayed held past the bounded wait)."""


class PlacementError(WeighthubError):
    """A loader or shard layout does not place the canonical tensors as declared."""


class AttestationError(WeighthubError):
    """Rollouts from a policy the trainer did not publish (or too stale, or drifted): refused."""


class NetError(WeighthubError):
    """A peer, relay or hub failed."""


class AuthError(NetError):
    """A request without a valid token was refused (or ours was)."""


class PeerUnavailable(NetError):
    """A peer or hub did not answer in time, or does not serve what was asked."""


class PeerTimeout(PeerUnavailable):
    """A peer or hub did not answer in time (dead, partitioned or overloaded)."""


class PeerRefused(PeerUnavailable):
    """A peer or hub answered, and refused (busy, or not holding what was asked)."""
