"""The RL demo's shaped-link mode without a cluster: its options reach the driver unchanged, bad
input is refused before any namespace exists, the link counter counts, the summary carries the
link's bytes. The run itself: tests/integration/test_rl_link.py."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from weighthub.cli import build_parser, main
from weighthub.errors import UsageError
from weighthub.integrations.ray.example import format_row, header, link_counter, summary
from weighthub.integrations.ray.loop import RLConfig
from weighthub.integrations.ray.shaped import _driver_argv


def _demo_args(*extra: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["demo", "--rl", *extra])


def test_the_driver_gets_every_option_of_the_run() -> None:
    args = _demo_args("--steps", "3", "--engines", "3", "--prompts", "6", "--samples", "3",
                      "--max-tokens", "12", "--lr", "3e-06", "--lag", "1", "--encode", "compact",
                      "--seed", "7", "--no-baseline", "--early-decode", "--plain-cpu-weights",
                      "--probe-rounds", "5", "--link-mbit", "200")
    argv = _driver_argv(args, "10.213.0.1:6379", "s3://policy/rl", "wh0a", Path("/tmp/x.json"))
    assert argv[1:3] == ["-m", "weighthub.cli"]
    inner = build_parser().parse_args(argv[3:])
    for key in ("steps", "engines", "prompts", "samples", "max_tokens", "lr", "lag", "encode",
                "seed", "no_baseline", "early_decode", "plain_cpu_weights", "probe_rounds", "rl"):
        assert getattr(inner, key) == getattr(args, key), key
    assert (inner.address, inner.store, inner.rollout_nodes, inner.link_dev, inner.json,
            inner.link_mbit, inner.nodes) == ("10.213.0.1:6379", "s3://policy/rl", "others", "wh0a",
                                              "/tmp/x.json", None, 2)


@pytest.mark.parametrize(("extra", "message"), [
    (["--link-mbit", "0"], "--link-mbit must be > 0"),
    (["--link-mbit", "-5"], "--link-mbit must be > 0"),
    (["--link-mbit", "100", "--address", "10.0.0.1:6379"], "drop --address"),
    (["--link-mbit", "100", "--nodes", "3"], "two Ray nodes"),
])
def test_bad_link_options_exit_2_before_building_anything(
        extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--rl", *extra]) == 2
    assert message in capsys.readouterr().err


def test_rollout_nodes_must_be_all_or_others() -> None:
    assert RLConfig(rollout_nodes="others").rollout_nodes == "others"
    with pytest.raises(UsageError, match="rollout_nodes must be 'all' or 'others'"):
        RLConfig(rollout_nodes="trainer")


def test_probe_rounds_are_counted_not_negative() -> None:
    assert RLConfig(probe_rounds=0).probe_rounds == 0  # 0: no probe
    with pytest.raises(UsageError, match="probe rounds ≥ 0"):
        RLConfig(probe_rounds=-1)


def test_link_counter_counts_both_directions_of_a_device() -> None:
    count = link_counter("lo")
    before = count()
    with socket.create_server(("127.0.0.1", 0)) as srv:
        def sink() -> None:
            conn, _ = srv.accept()
            with conn:
                while conn.recv(1 << 16):
                    pass
        t = threading.Thread(target=sink)
        t.start()
        with socket.create_connection(srv.getsockname()) as c:
            c.sendall(bytes(1 << 20))
        t.join(timeout=10)
    # loopback: each byte leaves (tx) and arrives (rx) on the same device
    assert count() - before >= 2 * (1 << 20)
    with pytest.raises(UsageError, match="no such network device"):
        link_counter("wh-no-such-dev")


def test_rows_and_summary_carry_the_links_bytes() -> None:
    rows = [{"step": i, "reward": 0.5, "drift": 0.01, "version": i + 1, "changed": 0.02,
             "refit_s": 1.0, "pause_s": 0.1, "engine_bytes": 8e6, "baseline_s": 4.0,
             "baseline_bytes": 5.4e8, "refit_wire_bytes": 4.5e6 + i, "baseline_wire_bytes": 2.7e8,
             "attested": [("engine0@n", i, "abcdef012345")]} for i in range(3)]
    s = summary(rows)
    assert s["refit_wire_bytes"] == 4.5e6 + 1.5 and s["baseline_wire_bytes"] == 2.7e8
    assert s["speedup"] == 4.0 and s["pause_share"] == pytest.approx(0.1)
    line = format_row(rows[1], wire=True)
    assert "   4.50    270.0" in line and header(True).index("wh wire") < header(True).index("attested")
    assert "wire" not in header(False) and "270.0" not in format_row(rows[1])


@pytest.mark.parametrize(("hub", "expect"), [("127.0.0.1:4000", "127.0.0.1"), ("[::1]:4000", "127.0.0.1"),
                                             ("10.213.0.1:4000", "127.0.0.1")])
def test_the_publisher_listens_where_the_group_can_reach_it(hub: str, expect: str) -> None:
    """Loopback groups stay on loopback; outside Ray there is no node IP to take."""
    from weighthub.integrations.ray.spec import SyncSpec
    from weighthub.integrations.ray.sync import WeightSync

    sync = WeightSync(SyncSpec("g", "/tmp/store", hub, bytes(32), {}))
    assert sync._reachable_host() == expect


def test_settle_waits_for_a_quiet_link_and_gives_up() -> None:
    from weighthub.integrations.ray.loop import settle

    sent = iter([0, 1 << 20, 2 << 20, (2 << 20) + 100, (2 << 20) + 200])
    assert settle(lambda: next(sent), interval_s=0.01) >= 0.03  # two busy intervals, one quiet
    busy = iter(range(0, 1 << 40, 1 << 20))
    waited = settle(lambda: next(busy), interval_s=0.01, timeout_s=0.05)
    assert 0.05 <= waited < 1.0
