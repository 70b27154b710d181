"""A TCP server that accepts connections and never answers: the peer, hub or S3 endpoint that
hangs. Tests check that every wait on it ends within its timeout."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A socket on 127.0.0.1 that accepts connections, reads nothing back, and never replies."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError):
                held.append(srv.accept()[0])
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        done.set()
        t.join(5)
        for s in held:
            s.close()
        srv.close()
