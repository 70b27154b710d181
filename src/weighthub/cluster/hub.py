"""`weighthub serve hub`: the hub's HTTP API (aiohttp) over `hubcore.Hub`.

Every request carries an `auth` token (header `X-Weighthub-Auth`) signed over the method, the raw
path with its query and the SHA-256 of the body; replayed tokens are refused. Bodies are JSON
objects of at most MAX_BODY bytes; every request is answered within REQUEST_TIMEOUT_S. Errors
come back as `{"error": "<weighthub error class>", "message": "..."}` with a status code:
400 bad request, 401 auth, 404 unknown version/plan/endpoint, 409 conflict, 413 too big,
503 timed out (`hubclient` raises the same error classes).

    GET  /v1/latest                      latest committed version and its record
    GET  /v1/versions                    every committed version (released ones flagged)
    POST /v1/versions                    announce a commit {version, manifest_key, store_url,
                                         model_id, root, publisher?, manifest_sha256?};
                                         releases past --retain
    POST /v1/release                     {version}: holders may drop it (never the latest)
    GET  /v1/holders                     live holders
    PUT  /v1/holders                     register / heartbeat {id, address, labels, versions,
                                         serving, load, subscribe, dense} -> {lease_ttl,
                                         latest, release}; `serving`: versions whose dense
                                         bits it can serve now (kept in memory only)
    POST /v1/holders/leave               {id}
    GET  /v1/sources?version=&key=[&asker=&region=&zone=&host=&dense=1]   ranked sources, store
                                         last (dense=1: only holders whose
                                         `serving` includes the version)
    POST /v1/plans                       {version, publisher?, degree?}: the publisher creates
                                         the refit's relay plan, anyone reads it
    GET  /v1/plans/{version}             read a plan
    POST /v1/plans/{version}/failed      {failed: [ids]}: replan around failed nodes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ..errors import (
    AuthError,
    FormatError,
    LimitError,
    ModelMismatch,
    UsageError,
    VersionError,
    VersionNotFound,
    WeighthubError,
)
from ..net.auth import AUTH_HEADER, ReplayGuard, body_digest, load_secret, verify
from .hubcore import Hub, HubConfig, add_arguments, config_from_args

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20
MAX_DEPTH = 16  # nesting levels of a request body
REQUEST_TIMEOUT_S = 10.0
_STATUS: tuple[tuple[type[WeighthubError], int], ...] = (
    (AuthError, 401), (LimitError, 413), (FormatError, 400), (UsageError, 400),
    (VersionNotFound, 404), (ModelMismatch, 409), (VersionError, 409))

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _reply(doc: dict[str, Any], status: int = 200) -> web.Response:
    return web.json_response(doc, status=status, dumps=lambda d: json.dumps(d, sort_keys=True))


def _error(exc: WeighthubError) -> web.Response:
    status = next((s for cls, s in _STATUS if isinstance(exc, cls)), 500)
    return _reply({"error": type(exc).__name__, "message": str(exc)}, status)


async def _body(request: web.Request) -> bytes:
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise LimitError(f"request body of {request.content_length} bytes is over the hub's "
                         f"limit of {MAX_BODY}")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise LimitError(f"request body is over the hub's limit of {MAX_BODY} bytes") from exc


def parse_body(body: bytes) -> Any:
    """A request body as JSON ({} when empty): strict RFC 8259 JSON, UTF-8, at most MAX_DEPTH deep.

    Raises UsageError for anything else (400): invalid or non-UTF-8 bytes, NaN/Infinity, an
    integer of more than 4300 digits, a string with a lone surrogate escape ("\\udcff": not
    storable as UTF-8), or nesting deeper than MAX_DEPTH (the hub's documents nest 2 deep;
    json recurses per level, so a deep body is refused here, not with a RecursionError inside).
    """
    if not body:
        return {}
    try:
        doc = json.loads(body, parse_constant=_refuse_constant)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise UsageError(f"request body is not JSON ({exc})") from exc
    except RecursionError:
        raise UsageError(f"request body is JSON nested too deeply (at most {MAX_DEPTH} "
                         "levels)") from None
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:  # iteratively: the depth is the sender's choice
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                raise UsageError(f"request body is JSON nested too deeply (at most {MAX_DEPTH} "
                                 "levels)")
            values = [*item, *item.values()] if isinstance(item, dict) else item
            stack += [(v, depth + 1) for v in values]
        elif isinstance(item, str) and not _utf8(item):
            raise UsageError("request body is not JSON the hub can store: a string holds a lone "
                             "surrogate escape (\\ud800-\\udfff), which is not UTF-8")
    return doc


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _version(text: str, what: str) -> int:
    """A version number from a path or query: ASCII digits only (isdigit() alone takes "²",
    which int() refuses, and "١", which it reads as 1), at most 19 of them (int64)."""
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        raise UsageError(f"{what} must be a non-negative integer, got {text!r}")
    return int(text)


def _middleware(secret: bytes, guard: ReplayGuard) -> Any:
    @web.middleware
    async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                body = await _body(request)
                verify(secret, request.headers.get(AUTH_HEADER), request.method, request.raw_path,
                       body_digest(body) if body else "", replay=guard)
                request["doc"] = parse_body(body)
                return await handler(request)
        except WeighthubError as exc:
            return _error(exc)
        except web.HTTPException as exc:  # unknown endpoint or method
            return _reply({"error": "UsageError", "message": f"{request.method} {request.path}: "
                           f"{exc.reason} (see weighthub.cluster.hub for the API)"}, exc.status)
        except TimeoutError:
            return _reply({"error": "PeerUnavailable",
                           "message": f"hub request timed out after {REQUEST_TIMEOUT_S:g}s"}, 503)
    return edge


def build_app(hub: Hub, secret: bytes) -> web.Application:
    """The aiohttp application: routes over `hub`, behind auth, size and time limits."""
    app = web.Application(middlewares=[_middleware(secret, ReplayGuard())], client_max_size=MAX_BODY)

    def version_of(request: web.Request) -> int:
        return _version(request.match_info["version"], "version")

    async def sources(request: web.Request) -> web.Response:
        q = request.query
        doc = {"version": _version(q.get("version", ""), "query 'version'"), "key": q.get("key"),
               "asker": q.get("asker"),
               "labels": {k: q[k] for k in ("region", "zone", "host") if k in q},
               "dense": q.get("dense") == "1"}
        return _reply(hub.sources(doc))

    async def get_plan(request: web.Request) -> web.Response:
        return _reply(hub.get_plan(version_of(request)))

    async def failed(request: web.Request) -> web.Response:
        return _reply(await hub.report_failed(version_of(request), request["doc"]))

    def doc_route(op: Callable[[Any], Awaitable[dict[str, Any]]]) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            return _reply(await op(request["doc"]))
        return handle

    def read_route(op: Callable[[], dict[str, Any]]) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            return _reply(op())
        return handle

    app.add_routes([
        web.get("/v1/latest", read_route(hub.latest)),
        web.get("/v1/versions", read_route(hub.list_versions)),
        web.post("/v1/versions", doc_route(hub.announce)),
        web.post("/v1/release", doc_route(hub.release)),
        web.get("/v1/holders", read_route(hub.list_holders)),
        web.put("/v1/holders", doc_route(hub.register)),
        web.post("/v1/holders/leave", doc_route(hub.leave)),
        web.get("/v1/sources", sources),
        web.post("/v1/plans", doc_route(hub.plan)),
        web.get("/v1/plans/{version}", get_plan),
        web.post("/v1/plans/{version}/failed", failed),
    ])
    return app


async def serve(config: HubConfig, secret: bytes, host: str, port: int, *,
                ready: Callable[[str], None], stop: asyncio.Event) -> None:
    """Run the hub until `stop` is set; call `ready("host:port")` once it listens (port 0: real port)."""
    hub = Hub(config)
    runner: web.AppRunner | None = None
    sweeper: asyncio.Task[None] | None = None
    try:
        await hub.open()
        runner = web.AppRunner(build_app(hub, secret), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise UsageError(f"the hub cannot listen on {host}:{port} ({exc.strerror}); "
                             "pick another --port or --host") from exc
        bound_host, bound_port = runner.addresses[0][:2]
        sweeper = asyncio.create_task(_sweep(hub))
        ready(f"{bound_host}:{bound_port}")
        await stop.wait()
    finally:  # whatever failed, nothing is left running: sweeper, sockets, the DB thread
        if sweeper is not None:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
        if runner is not None:
            await runner.cleanup()
        await hub.close()


async def _sweep(hub: Hub) -> None:
    while True:
        await asyncio.sleep(hub.config.lease_ttl / 2)
        try:
            await hub.sweep()
        except Exception:  # a failed sweep is retried next period; the hub keeps serving
            log.exception("hub: lease sweep failed")


def run(config: HubConfig, secret: bytes, host: str, port: int) -> None:
    """Blocking entry point of `weighthub serve hub`: prints the bound address, stops on SIGTERM/SIGINT."""
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        def ready(address: str) -> None:
            print(f"weighthub hub listening on {address} (db {config.db}, lease TTL "
                  f"{config.lease_ttl:g}s, retain {config.retain or 'all'}, fan-out {config.degree})",
                  flush=True)
        await serve(config, secret, host, port, ready=ready, stop=stop)
        print("weighthub hub stopped", file=sys.stderr, flush=True)

    asyncio.run(main())


def run_from_args(args: argparse.Namespace) -> None:
    """`weighthub serve hub ARGS` (options from `hubcore.add_arguments`)."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    run(config_from_args(args), load_secret(args.secret_file), args.host, args.port)


def main(argv: list[str] | None = None) -> int:
    """`python -m weighthub.cluster.hub`: the same hub without the CLI's heavier imports (fast start)."""
    p = argparse.ArgumentParser(prog="python -m weighthub.cluster.hub", description=__doc__.split("\n")[0])
    add_arguments(p)
    try:
        run_from_args(p.parse_args(argv))
    except UsageError as exc:
        print(f"weighthub: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
