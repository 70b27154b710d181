"""Loopback throughput of ONE stream of large chunks, per transport: the measurement behind `wire`.

Three candidates, each a server process (spawned, so it has its own interpreter and GIL) that
streams `count` bodies of `size` bytes to one client in this process, which receives them into a
preallocated buffer:

    http-aiohttp   aiohttp server Response(body=...) / aiohttp client, chunks copied into the buffer
    tcp-streams    asyncio streams: writer.write(memoryview)+drain / reader.readexactly
    tcp-sock       asyncio sock API on a raw non-blocking socket: sock_sendall(memoryview) /
                   sock_recv_into(the preallocated buffer): no copy on either side in Python

`measure(...)` returns GB/s per transport (best of `repeat` runs, payload bytes only).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

_LEN = struct.Struct("!Q")
TRANSPORTS = ("http-aiohttp", "tcp-streams", "tcp-sock", "weighthub")
_KEY = "v000000000001/bench/c0.whc"
_SECRET = b"bench-transport-secret-0123456789"


@dataclass(frozen=True, slots=True)
class TransportResult:
    transport: str
    size: int
    count: int
    gbps: float  # payload GB/s (1e9 bytes), best run


# ----------------------------------------------------------------------------- servers (child)

async def _serve_http(sock: socket.socket, size: int) -> None:
    from aiohttp import web

    body = bytes(size)

    async def handler(_request: web.Request) -> web.Response:
        return web.Response(body=body)

    app = web.Application()
    app.router.add_get("/c", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    await asyncio.Event().wait()


async def _serve_streams(sock: socket.socket, size: int) -> None:
    body = memoryview(bytes(size))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            except asyncio.IncompleteReadError:
                break
            for _ in range(n):
                writer.write(_LEN.pack(size))
                writer.write(body)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, sock=sock)
    await server.serve_forever()


async def _serve_sock(sock: socket.socket, size: int) -> None:
    loop = asyncio.get_running_loop()
    body = memoryview(bytes(size))
    sock.setblocking(False)
    while True:
        conn, _ = await loop.sock_accept(sock)
        conn.setblocking(False)
        head = bytearray(_LEN.size)
        while True:
            got = 0
            while got < len(head):
                k = await loop.sock_recv_into(conn, memoryview(head)[got:])
                if k == 0:
                    break
                got += k
            if got < len(head):
                break
            (n,) = _LEN.unpack(head)
            for _ in range(n):
                await loop.sock_sendall(conn, _LEN.pack(size))
                await loop.sock_sendall(conn, body)
        conn.close()


async def _serve_weighthub(port: int, size: int) -> None:
    from ..net.server import ChunkServer
    from ..store.memory import MemoryStore

    store = MemoryStore()
    store.put(_KEY, bytes(size))
    with ChunkServer(store, _SECRET, port=port) as server:
        server.serve(1)
        await asyncio.Event().wait()


def _child(transport: str, where: socket.socket | int, size: int) -> None:
    if isinstance(where, int):  # the ChunkServer binds its own listener
        asyncio.run(_serve_weighthub(where, size))
        return
    serve = {"http-aiohttp": _serve_http, "tcp-streams": _serve_streams, "tcp-sock": _serve_sock}
    asyncio.run(serve[transport](where, size))


# ----------------------------------------------------------------------------- clients (parent)

async def _recv_http(port: int, size: int, count: int, buf: memoryview) -> None:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for _ in range(count):
            async with session.get(f"http://127.0.0.1:{port}/c") as resp:
                got = 0
                async for data in resp.content.iter_chunked(1 << 20):
                    buf[got:got + len(data)] = data
                    got += len(data)
                if got != size:
                    raise RuntimeError(f"http: got {got} of {size} bytes")


async def _recv_streams(port: int, size: int, count: int, buf: memoryview) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
    writer.write(_LEN.pack(count))
    for _ in range(count):
        (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        buf[:n] = await reader.readexactly(n)
    writer.close()


async def _recv_sock(port: int, size: int, count: int, buf: memoryview) -> None:
    loop = asyncio.get_running_loop()
    conn = socket.socket()
    conn.setblocking(False)
    await loop.sock_connect(conn, ("127.0.0.1", port))
    await loop.sock_sendall(conn, _LEN.pack(count))
    head = bytearray(_LEN.size)
    try:
        for _ in range(count):
            for view in (memoryview(head), None):
                if view is None:
                    (n,) = _LEN.unpack(head)
                    view = buf[:n]
                got = 0
                while got < len(view):
                    k = await loop.sock_recv_into(conn, view[got:])
                    if k == 0:
                        raise RuntimeError("tcp-sock: server closed early")
                    got += k
    finally:
        conn.close()


async def _recv_weighthub(port: int, size: int, count: int, buf: memoryview) -> None:
    from ..net.client import PeerClient

    client = PeerClient(f"127.0.0.1:{port}", _SECRET)
    for _ in range(count):
        if len(await asyncio.to_thread(client.get, _KEY)) != size:
            raise RuntimeError("weighthub: short body")


def measure(size: int = 32 << 20, count: int = 16, repeat: int = 3,
            transports: tuple[str, ...] = TRANSPORTS) -> list[TransportResult]:
    """Best-of-`repeat` payload GB/s of one stream of `count` bodies of `size` bytes, per transport."""
    recv = {"http-aiohttp": _recv_http, "tcp-streams": _recv_streams, "tcp-sock": _recv_sock,
            "weighthub": _recv_weighthub}
    ctx = mp.get_context("spawn")
    buf = memoryview(bytearray(size))
    results = []
    for transport in transports:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        where: socket.socket | int = port if transport == "weighthub" else listener
        if transport == "weighthub":
            listener.close()
        proc = ctx.Process(target=_child, args=(transport, where, size), daemon=True)
        proc.start()
        listener.close()
        try:
            _wait_listening(port, proc)
            asyncio.run(asyncio.wait_for(recv[transport](port, size, 1, buf), 60))  # warm-up
            best = 0.0
            for _ in range(repeat):
                t0 = time.perf_counter()
                asyncio.run(asyncio.wait_for(recv[transport](port, size, count, buf), 120))
                best = max(best, size * count / (time.perf_counter() - t0) / 1e9)
            results.append(TransportResult(transport, size, count, best))
        finally:
            proc.kill()
            proc.join(10)
    return results


def _wait_listening(port: int, proc: mp.process.BaseProcess, timeout: float = 60.0) -> None:
    """Wait until the spawned server accepts (the weighthub one binds the port itself)."""
    end = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > end or not proc.is_alive():
                raise RuntimeError(f"bench server on port {port} did not start") from None
            time.sleep(0.05)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `weighthub bench transport` (and `python -m weighthub.bench.transport`)."""
    p.add_argument("--size-mib", type=int, default=32, help="body size (MiB, default 32)")
    p.add_argument("--count", type=int, default=16, help="bodies per run (default 16)")
    p.add_argument("--repeat", type=int, default=3, help="runs per transport, best kept")
    p.add_argument("--transports", default=",".join(TRANSPORTS),
                   help=f"comma-separated subset of {','.join(TRANSPORTS)}")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")


def cmd_transport(args: argparse.Namespace) -> int:
    names = tuple(t for t in args.transports.split(",") if t)
    unknown = sorted(set(names) - set(TRANSPORTS))
    if unknown or args.size_mib < 1 or args.count < 1 or args.repeat < 1:
        raise UsageError(f"bench transport: unknown transports {unknown} (known: {list(TRANSPORTS)}) "
                         "or a size/count/repeat below 1")
    results = measure(args.size_mib << 20, args.count, args.repeat, names)
    for r in results:
        print(f"{r.transport:14s} {r.count} x {r.size >> 20} MiB, one stream: {r.gbps:.2f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weighthub.bench.transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return cmd_transport(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
