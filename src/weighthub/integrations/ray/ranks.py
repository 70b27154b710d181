"""Trainer ranks that publish together (`ShardedPublisher`) into a sync group's hub.

`ShardedPublisher` commits straight to the store; the group's node daemons follow the hub's
latest version, so the committer rank announces each version it committed (with the manifest's
digest, as `NetPublisher` does). Every rank publishes; only the committer talks to the hub. A
hub that does not answer never fails the publish: the version is committed, `announced` in the
result is False, and nodes find it in the store listing (while the hub fails, or once it has
named the version before for their `store_check_s`); the next version's announcement supersedes it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ...cluster.hubclient import HubClient
from ...errors import WeighthubError
from ...publish import PublishResult, ShardedPublisher
from ...store import Store

log = logging.getLogger(__name__)


class RankPublisher:
    """One trainer rank's publisher in a sync group; `publish` on every rank, every step."""

    def __init__(self, publisher: ShardedPublisher, store: Store, hub: HubClient | None) -> None:
        self.publisher = publisher
        self.store = store
        self.hub = hub  # the committer rank's client; None on the other ranks

    def publish(self, state: Mapping[str, torch.Tensor], **kwargs: Any) -> PublishResult:
        """`ShardedPublisher.publish`, then (committer rank) the hub hears of the version."""
        result = self.publisher.publish(state, **kwargs)
        self.announced = False
        if self.hub is not None:
            try:
                self.hub.announce_committed(self.store, result.version, publisher=self.publisher.id)
                self.announced = True
            except WeighthubError as exc:
                log.warning("version %s is committed but the hub %s did not hear of it (%s); "
                            "nodes find it in the store listing", result.version, self.hub.address, exc)
        return result

    def close(self) -> None:
        if self.hub is not None:
            self.hub.stop(leave=False)  # it never registered as a holder
