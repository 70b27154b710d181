"""The Ray integration's pure parts: attestation checks, the drift figure, the spec, labels.

(The actors, the loop and vLLM run in tests/integration/test_ray.py on a real Ray cluster.)
"""

from __future__ import annotations

import json

import pytest

from weighthub.cluster.topology import Labels
from weighthub.errors import AttestationError, UsageError
from weighthub.integrations.ray.attest import Attestation, PolicyLedger, drift
from weighthub.integrations.ray.spec import NodeSpec, SyncSpec
from weighthub.integrations.ray.sync import labels_of

STORE = "file:///stores/policy"


def _att(version: int, root: str = "r1", store: str = STORE) -> Attestation:
    return Attestation(engine="e0@node", store=store, model="m", version=version, root=root)


def _ledger(max_lag: int = 0) -> PolicyLedger:
    ledger = PolicyLedger(max_lag=max_lag)
    ledger.record(STORE, 0, "r0")
    ledger.record(STORE, 1, "r1")
    return ledger


def test_ledger_accepts_what_it_published_and_counts_lag() -> None:
    assert _ledger().check(_att(1)) == 0
    assert _ledger(max_lag=1).check(_att(0, "r0")) == 1


@pytest.mark.parametrize(("att", "match"), [
    (None, "no attestation"),
    (_att(2), "did not publish"),
    (_att(1, root="other"), "another model"),
    (_att(1, store="file:///elsewhere"), "another model"),
    (_att(0, root="r0"), r"1 version\(s\) stale"),
])
def test_ledger_refuses_other_policies(att: Attestation | None, match: str) -> None:
    with pytest.raises(AttestationError, match=match):
        _ledger().check(att)


def test_drift_is_the_mean_absolute_difference_per_token() -> None:
    assert drift([[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.0]]) == pytest.approx(1.0 / 3)
    assert drift([], []) == 0.0
    with pytest.raises(AttestationError, match="2 engine log-probabilities but 1"):
        drift([[-1.0, -2.0]], [[-1.0]])
    with pytest.raises(ValueError):  # a batch and its scores must pair up
        drift([[-1.0]], [])


def test_drift_limit() -> None:
    ledger = PolicyLedger(drift_limit=0.2)
    assert ledger.check_drift(0.1) == 0.1
    for bad in (0.3, float("nan"), float("inf")):
        with pytest.raises(AttestationError, match=r"limit 0\.2"):
            ledger.check_drift(bad)
    with pytest.raises(AttestationError):
        PolicyLedger(max_lag=-1)


def _spec(secret: bytes = b"s" * 32) -> SyncSpec:
    return SyncSpec("g", STORE, "127.0.0.1:9", secret,
                    {"n1": NodeSpec("127.0.0.1:10", Labels("r", "z", "h"), "/dev/shm/x")})


def test_spec_round_trips_as_a_private_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = _spec()
    path = spec.save(tmp_path / "spec.json")
    assert path.stat().st_mode & 0o777 == 0o600
    assert SyncSpec.load(path) == spec
    assert "s" * 32 not in repr(spec)  # the secret stays out of logs
    cached = SyncSpec("g", STORE, "127.0.0.1:9", b"s" * 32,
                      {"n1": NodeSpec("127.0.0.1:10", Labels("r", "z", "h"), "/x/stage", "/x/cache")})
    assert SyncSpec.from_json(cached.to_json()) == cached
    # a spec saved before nodes named their relay cache: engines there read none in place
    old = json.loads(spec.to_json())
    del old["nodes"]["n1"]["cache_dir"]
    assert SyncSpec.from_json(json.dumps(old)).node("n1").cache_dir == ""


@pytest.mark.parametrize("text", ["", "{}", '{"name": 1}', "[1]",
                                  '{"name":"g","store_url":"s","hub":"h","secret":"zz","nodes":{}}'])
def test_spec_refuses_what_is_not_one(text: str) -> None:
    with pytest.raises(UsageError, match="not a weighthub sync spec"):
        SyncSpec.from_json(text)


def test_spec_refuses_a_short_secret_and_names_missing_nodes() -> None:
    with pytest.raises(UsageError, match="at least 16 bytes"):
        _spec(b"short")
    with pytest.raises(UsageError, match="add_nodes"):
        _spec().node("n2")


def test_labels_from_ray_nodes() -> None:
    node = {"NodeID": "abcdef0123456789ffff", "Labels": {"ray.io/availability-zone": "us-1a",
                                                         "region": "us"}}
    assert labels_of(node) == Labels("us", "us-1a", "abcdef0123456789")
    assert labels_of({"NodeID": "x"}) == Labels("", "", "x")


def test_a_tokenizerless_engine_drops_only_vllms_no_tokenizer_warnings() -> None:
    import logging

    from weighthub.integrations.ray.rollout import _DropTokenizerless

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("vllm.renderers.base", logging.WARNING, "base.py", 1, msg, None, None)

    drop = _DropTokenizerless()
    assert not drop.filter(record("Chat template warmup failed"))
    assert not drop.filter(record("Using None for EOS token id because tokenizer is not initialized"))
    assert drop.filter(record("Chat template %s is not valid"))  # anything else passes
