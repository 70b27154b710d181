"""Hub processes for tests: start `weighthub serve hub` on loopback, read its address, kill it.

`HubProcess.start` runs `python -m weighthub.cluster.hub` (the same code as `weighthub serve hub`
without the CLI's torch imports, so it starts in about a second; `cli=True` runs the real
console command) and waits for the "listening on host:port" line. `stop()` sends SIGTERM and
waits; `kill()` is kill -9.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from deadlines import PROCESS_S

from weighthub.net.auth import AUTH_HEADER, body_digest, sign

START_TIMEOUT_S = PROCESS_S
_LISTENING = re.compile(r"listening on (\S+:\d+)")


def write_secret(path: Path) -> bytes:
    secret = secrets.token_hex(32).encode()
    path.write_bytes(secret + b"\n")
    return secret


class HubProcess:
    """A hub subprocess on 127.0.0.1 (see module docstring)."""

    def __init__(self, proc: subprocess.Popen[str], address: str, db: Path):
        self.proc = proc
        self.address = address
        self.db = db

    @classmethod
    def start(cls, db: Path, secret_file: Path, *, lease_ttl: float = 10.0, retain: int = 8,
              fanout: int = 4, port: int = 0, cli: bool = False) -> HubProcess:
        entry = ["-m", "weighthub.cli", "serve", "hub"] if cli else ["-m", "weighthub.cluster.hub"]
        cmd = [sys.executable, *entry, "--db", str(db), "--secret-file", str(secret_file),
               "--host", "127.0.0.1", "--port", str(port), "--lease-ttl", str(lease_ttl),
               "--retain", str(retain), "--fanout", str(fanout)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2] / "src"), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)
        threading.Thread(target=pump, daemon=True).start()
        try:
            while True:
                line = lines.get(timeout=START_TIMEOUT_S)
                if line is None:
                    err = proc.stderr.read() if proc.stderr else ""
                    raise RuntimeError(f"hub exited with {proc.wait()} before listening: {err}")
                m = _LISTENING.search(line)
                if m:
                    return cls(proc, m.group(1), db)
        except BaseException:
            proc.kill()
            proc.wait()
            raise

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """kill -9 (no clean shutdown)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def raw_request(address: str, method: str, path: str, body: bytes = b"", *,
                token: str | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One HTTP request with exactly this token (None: no auth header); returns (status, JSON doc)."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        h = dict(headers or {})
        if token is not None:
            h[AUTH_HEADER] = token
        conn.request(method, path, body=body or None, headers=h)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def signed_request(address: str, secret: bytes, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
    token = sign(secret, method, path, body_digest(body) if body else "")
    return raw_request(address, method, path, body, token=token)
