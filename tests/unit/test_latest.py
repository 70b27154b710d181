"""LatestVersion: a node follows the hub, and the store only when the hub really missed a version.

A publisher commits to the store and then announces to the hub, so a store check that falls
between the two sees the store ahead of the hub for a few milliseconds. That is not a missed
announcement: the node keeps the hub's answer (and the manifest digest the hub vouches for)
unless the hub still lags `ANNOUNCE_GRACE_S` later.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from weighthub.cluster import latest as latest_mod
from weighthub.cluster.latest import LatestVersion
from weighthub.store import MemoryStore


class FakeHub:
    def __init__(self, version: int) -> None:
        self.version = version

    def latest_record(self) -> dict[str, Any]:
        return {"version": self.version, "manifest_sha256": f"sha-{self.version}"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeHub, dict[str, int], Clock, LatestVersion]:
    hub, listed, clock = FakeHub(1), {"version": 1}, Clock()
    monkeypatch.setattr(latest_mod.time, "monotonic", clock)
    monkeypatch.setattr(latest_mod.catalog, "latest_version", lambda store: listed["version"])
    follower = LatestVersion(hub, MemoryStore(), timeout=5.0,  # type: ignore[arg-type]
                             store_check_s=30.0, where="node n1")
    return hub, listed, clock, follower


def test_a_check_between_commit_and_announcement_keeps_the_hubs_answer(
        world: tuple[FakeHub, dict[str, int], Clock, LatestVersion],
        caplog: pytest.LogCaptureFixture) -> None:
    hub, listed, clock, follower = world
    assert follower.latest() == 1
    clock.now += 31.0  # the hub has said 1 for a whole check period
    listed["version"] = 2  # committed; the announcement is a hub call away
    with caplog.at_level(logging.WARNING, logger=latest_mod.__name__):
        assert follower.latest() == 1
        clock.now += 0.01
        hub.version = 2  # the announcement arrives
        assert follower.latest() == 2
        assert follower.digests == {2: "sha-2"}  # the hub's record, for the relayed manifest
        clock.now += latest_mod.ANNOUNCE_GRACE_S + 1
        assert follower.latest() == 2
    assert "missed its announcement" not in caplog.text


def test_a_hub_that_still_lags_after_the_grace_is_taken_as_having_missed_it(
        world: tuple[FakeHub, dict[str, int], Clock, LatestVersion],
        caplog: pytest.LogCaptureFixture) -> None:
    _hub, listed, clock, follower = world
    assert follower.latest() == 1
    clock.now += 31.0
    listed["version"] = 3
    with caplog.at_level(logging.WARNING, logger=latest_mod.__name__):
        assert follower.latest() == 1  # within the grace
        clock.now += latest_mod.ANNOUNCE_GRACE_S / 2
        assert follower.latest() == 1
        assert "missed" not in caplog.text
        clock.now += latest_mod.ANNOUNCE_GRACE_S
        assert follower.latest() == 3  # the hub never heard of it: follow the store
    assert "the hub's latest is version 1 but" in caplog.text
    assert "has version 3 committed (the hub missed its announcement)" in caplog.text
    # once followed, the hub's older answer does not pull the node back, nor warn again
    caplog.clear()
    clock.now += 1.0
    assert follower.latest() == 1  # the node holds 3 already; the caller keeps the newer
    assert caplog.text == ""
