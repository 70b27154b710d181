"""Receive: bring a target to a version, all or nothing (the transaction engine).

    plan     cheapest route of representations from what the target holds (catalog.plan)
    stage    fetch every chunk of the route through the sources (each checked once against
             its manifest: size and SHA-256), parse and validate the frames; find the digests
             of the held version: nothing is touched yet                         (stage, routes)
    apply    in place, recording the old words of everything changed (UndoLog)         (apply)
    verify   digests of every touched tensor against each version the route passes through
                                                                                       (verify)
    commit   the target records the new version; or, on any failure anywhere in apply/verify,
             roll back exactly to the previous committed version and raise            (engine)

Where a target's tensor lives decides who applies it (DESIGN v2 "Backend"): host numpy words
go to the numba kernels (`codec.apply`), torch word views on a device to `receive.device`
(decoded on the host while staging, applied and digested on the device in the pause); both
leave the same bits, and a target may mix them. On the host, the route's first delta (applied
forwards) is decoded against the held words while staging too (`codec.prepared`: positions,
old and new words), so its pause is a scatter that checks each word it overwrites is the one
staged.

`engine.transact` is the one code path that opens a target, applies, verifies and commits or
rolls back. Its inputs are `Step`s of decoded chunks (`inputs`): a store route staged by the
`Receiver` (the facade: `sync`, or `stage` + `apply`), an elastic join's dense tensors from
holders (`cluster.join`), a compact LoGRA step's replayed words (`train.compact`).

Apply, verify and commit are the pause. Tensor digests are linear (format/spec.md §4), so by
default verification costs O(changed): a tensor's new digest is the held version's digest plus,
for every element a delta rewrote, mix(new) − mix(old). The apply kernel folds mix(new) into
the digest lanes as it writes each word (the words are not read back from the target), and
mix(old) from the word it replaces, or, for the route's first delta, from the held bits while
staging; a full representation's ranges are digested from the target's memory after they are
written. The held version's digests come from this receiver's last commit, or the held
version's manifest (bound to the held root), or, failing both, a digest of the held bits while
staging. This proves every rewritten word and trusts the words it did not rewrite to be the
held version's (as every mode trusts untouched tensors); `verify="full"` re-digests every
touched tensor from memory instead (O(touched tensors), ~10x the time at RL change rates, and
it also catches a write behind the kernels' back), and `verify_base=True` proves the whole held
version first.

Rolling back (a target at v asked for u < v) may take a backward route: deltas u+1 … v applied
inversely, newest first (catalog.plan chooses it when it is fewer bytes than an anchor). Each
inverse step is bound like a forward one, but the other way round: the target must hold the
delta's version with the delta's root, and afterwards the digests must be those of the delta's
base, as the base's own manifest records them (a delta's manifest records only its version's).
Its segments are checked to be invertible while staging, before anything is touched, and it
applies, folds digests and rolls back through the same kernels and undo log.
"""

from __future__ import annotations

from .engine import Outcome, transact
from .inputs import Chunk, Step
from .receiver import Receiver, Staged, SyncResult

__all__ = ["Chunk", "Outcome", "Receiver", "Staged", "Step", "SyncResult", "transact"]
