"""Strangers that hold a chunk server's connections: a process of its own, like a real attacker
(not sharing the test's interpreter lock, so what the server faces is its own business).

    python stranger_flood.py PORT COUNT SOURCE[,SOURCE...] [PERIOD]

opens COUNT connections to 127.0.0.1:PORT from the SOURCE addresses in turn (127.0.0.0/8 is all
loopback on Linux, and a socket may bind any of it as its source): even ones silent, odd ones
trickling a request frame that never completes, one byte per PERIOD (0.25 s, far inside any idle
timeout). Every PERIOD it reopens what the server closed, as an attacker would. It prints
"ready" once all are open, and on a line "stop" (or end of input) closes every socket, prints
{"opened": n, "reopened": n} and exits. `Flood.start` runs it and `Flood.stop` ends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
from pathlib import Path

import weighthub
from weighthub.net import wire

START_S = 30.0  # hang guard: a bare interpreter plus COUNT loopback connects
_SRC = str(Path(weighthub.__file__).resolve().parents[1])  # the child imports this weighthub


class Flood:
    """The test side: runs this file as a process; `stop()` ends it and returns its counts."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    @classmethod
    def start(cls, port: int, count: int, sources: list[str], period: float = 0.25) -> Flood:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        proc = subprocess.Popen([sys.executable, __file__, str(port), str(count), ",".join(sources),
                                 str(period)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env)
        flood = cls(proc)
        assert proc.stdout is not None
        if not select.select([proc.stdout], [], [], START_S)[0] or proc.stdout.readline() != "ready\n":
            flood.kill()
            raise TimeoutError(f"the stranger flood did not start within {START_S:g} s")
        return flood

    def stop(self) -> dict[str, int]:
        try:
            out, _ = self.proc.communicate("stop\n", timeout=START_S)
        finally:
            self.kill()
        return dict(json.loads(out.strip().splitlines()[-1]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(START_S)


def _connect(source: str, port: int) -> socket.socket:
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        sock.settimeout(2)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _flood(port: int, count: int, sources: list[str], period: float) -> None:
    slots = [(sources[i % len(sources)], i % 2 == 1) for i in range(count)]
    socks: list[socket.socket | None] = [None] * count
    sent = [0] * count
    # a plausible frame: a good prefix announcing a 4 KiB header that never completes
    frame = wire.PREFIX.pack(wire.REQUEST_MAGIC, 4096) + b'{"op": "get", "key": "' + b"v" * 4000
    counts = {"opened": 0, "reopened": 0}

    def cut(i: int, sock: socket.socket) -> bool:
        """Whether the server closed (or refused) connection i; trickles its next byte if not."""
        try:
            sock.recv(65536)
            return True  # end of stream, or a refusal frame that the close follows
        except BlockingIOError:
            pass
        except OSError:
            return True
        if slots[i][1]:
            try:
                sock.send(frame[sent[i]: sent[i] + 1])
                sent[i] = (sent[i] + 1) % len(frame)
            except BlockingIOError:
                pass
            except OSError:
                return True
        return False

    def sweep() -> None:
        for i, (source, _) in enumerate(slots):
            sock = socks[i]
            if sock is not None and cut(i, sock):
                sock.close()
                sock = socks[i] = None
                counts["reopened"] += 1
            if sock is None:
                with contextlib.suppress(OSError):  # the server's queue is full: next sweep
                    socks[i], sent[i] = _connect(source, port), 0
                    counts["opened"] += 1

    done = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.readline()  # "stop", or end of input: the test went away
        done.set()
    threading.Thread(target=watch_stdin, daemon=True).start()
    sweep()
    print("ready", flush=True)
    while not done.wait(period):
        sweep()
    for sock in socks:
        if sock is not None:
            sock.close()
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    _flood(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","),
           float(sys.argv[4]) if len(sys.argv) > 4 else 0.25)
