"""Which version a node should hold: the hub's latest, checked against the store's listing.

The hub is asked first: it answers in one small call and records each manifest's SHA-256, which
lets a node trust a manifest relayed to it. The store's listing is the truth about what is
committed, though, and it is read:
- while the hub fails (one timeout, then the store alone for a while: a dead or silent hub
  costs one timeout per period, not per poll), and when the hub knows no version yet;
- when the hub has said the same latest version for `store_check_s`: a hub that was down or
  restarting while a publisher announced its version (a publisher's announcement is retried,
  but a one-shot `weighthub publish` or a publisher that died right after its commit does not
  retry) keeps answering the version before, and its nodes would wait for the next publish.
  The check costs one store listing per period and only while no new version arrives.
  A listing can also be ahead of the hub for a moment: a publisher commits to the store, then
  announces to the hub, and a check in between reads the new version. So a version the
  listing shows ahead of the hub is followed only if the hub still lags `ANNOUNCE_GRACE_S`
  later; until then the hub's answer stands (seen in the RL demo: a node that followed the
  store at once took its manifest from the store, not the relayed one the hub vouches for,
  and staged that step ~0.08 s later, with a false warning).
"""

from __future__ import annotations

import logging
import time

from .. import catalog
from ..errors import NetError, WeighthubError
from ..store import Store
from .hubclient import HubClient

log = logging.getLogger(__name__)

# How long the hub may lag a version the store lists before it is taken as missed: a
# publisher's announcement follows its commit by one hub call (milliseconds; a slow hub is
# what the grace waits for).
ANNOUNCE_GRACE_S = 2.0


class LatestVersion:
    """The latest committed version for one follower (a node), and the hub's health as seen by it.

    Args:
        hub: the hub (None: the store alone).
        store: the store versions are committed to.
        timeout: the hub client's timeout (a failed hub is skipped for max(5, 2 × timeout) s).
        store_check_s: how long the hub may repeat one latest version before the store's
            listing is read as well (0: never while the hub answers).
        where: who follows (for log lines).
    """

    def __init__(self, hub: HubClient | None, store: Store, *, timeout: float, store_check_s: float,
                 where: str) -> None:
        self.hub = hub
        self.store = store
        self.timeout = timeout
        self.store_check_s = store_check_s
        self.where = where
        self.digests: dict[int, str] = {}  # version -> manifest SHA-256 the hub recorded
        self._down_until = 0.0
        self._said: tuple[int | None, float] = (None, time.monotonic())  # hub's answer, since when
        self._ahead: tuple[int, float] | None = None  # a version listed ahead of the hub, when

    def hub_up(self) -> bool:
        return self.hub is not None and time.monotonic() >= self._down_until

    def hub_failed(self, exc: WeighthubError) -> None:
        """Skip the hub for a while after a network failure (see the module doc)."""
        if isinstance(exc, NetError):
            self._down_until = time.monotonic() + max(5.0, 2 * self.timeout)
        log.warning("%s: hub failed (%s); using the store %s meanwhile", self.where, exc, self.store.url)

    def latest(self) -> int | None:
        """The version to hold: the hub's, or the store's (module doc). Raises the store's errors."""
        if not self.hub_up():
            return catalog.latest_version(self.store)
        try:
            record = self.hub.latest_record()  # type: ignore[union-attr]
        except NetError as exc:
            self.hub_failed(exc)
            return catalog.latest_version(self.store)
        if record is None:
            return catalog.latest_version(self.store)
        version = int(record["version"])
        if isinstance(record.get("manifest_sha256"), str):
            self.digests = {version: record["manifest_sha256"]}
        now = time.monotonic()
        if self._said[0] != version:
            self._said = (version, now)
        elif self.store_check_s and now - self._said[1] >= self.store_check_s:
            self._said = (version, now)  # the next check one period from now
            listed = catalog.latest_version(self.store)
            if listed is not None and listed > version and self._ahead is None:
                self._ahead = (listed, now)  # maybe committed but not yet announced: wait
        return self._behind_the_store(version, now)

    def _behind_the_store(self, version: int, now: float) -> int:
        """The hub's version, or the store's when the hub has lagged it past the grace."""
        if self._ahead is None:
            return version
        listed, since = self._ahead
        if version >= listed:
            self._ahead = None  # the announcement came
            return version
        if now - since < ANNOUNCE_GRACE_S:
            return version
        self._ahead = None
        log.warning("%s: the hub's latest is version %d but %s has version %d committed "
                    "(the hub missed its announcement); following the store", self.where,
                    version, self.store.url, listed)
        return listed
