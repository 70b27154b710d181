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
                                      (weighthub.net.hub); prints its address, stops on SIGTERM
    weighthub serve node STORE OUT    a rollout worker's daemon: follows the hub's versions into
                                      OUT, serves and relays what it holds (weighthub.net.node)

STORE is a directory path, a file:// URI or s3://BUCKET/PREFIX (credentials and endpoint from
the standard AWS_* variables, or --endpoint-url). Exit codes: 0 ok, 1 verify mismatch, 2 usage error,
3 any other failure. Errors the user can act on print one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import catalog
from .bench import command as bench_command
from .errors import UsageError, WeighthubError
from .net import hubcore, node
from .publish import ENCODE_PROFILES, Publisher
from .receive import Receiver
from .store import Store, open_store
from .store.staging import StagingStore
from .targets import SafetensorsTarget, load_checkpoint
from .tensors import bits, digest_bits, specs_of

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3


def _emit(args: argparse.Namespace, doc: dict[str, Any], line: str) -> None:
    print(json.dumps(doc, sort_keys=True) if getattr(args, "json", False) else line)


def _fraction(changed: int, numel: int) -> float:
    return changed / numel if numel else 0.0


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def cmd_publish(args: argparse.Namespace) -> int:
    state = load_checkpoint(args.ckpt)  # read before opening the store: a bad CKPT writes nothing
    store = _open(args)
    pub = Publisher(store, anchor_every=args.anchor_every, skip_every=args.skip_every,
                    retain=args.retain, policy=ENCODE_PROFILES[args.encode])
    r = pub.publish(state)
    doc = {"version": r.version, "base": r.base, "dense_bytes": r.dense_bytes,
           "payload_bytes": r.payload_bytes, "changed_fraction": r.changed_fraction,
           "seconds": r.seconds, "chunks": r.chunks,
           # where the publish's time went (PublishResult): busy seconds summed over threads
           "stream_seconds": r.stream_seconds, "encode_seconds": r.encode_seconds,
           "upload_seconds": r.upload_seconds, "overlap": r.overlap}
    kind = "full" if r.base is None else f"delta from {r.base}"
    _emit(args, doc, f"published version {r.version} ({kind}) to {store.url}: "
                     f"{_size(r.payload_bytes)} of {_size(r.dense_bytes)} dense, "
                     f"{r.changed_fraction:.4%} changed, {r.chunks} chunks, {r.seconds:.2f}s")
    return EXIT_OK


def cmd_pull(args: argparse.Namespace) -> int:
    store: Store = _existing_store(args)
    if args.stage_dir:
        # receivers on one host share fetched chunks: each is fetched from the store once
        store = StagingStore(store, args.stage_dir)
    # verify_base: a file edited behind weighthub's back must not get a delta applied on top
    receiver = Receiver(store, SafetensorsTarget(args.out), verify_base=True)
    r = receiver.sync(args.version)
    doc = {"version": r.version, "from_version": r.from_version, "route": list(r.route),
           "bytes_fetched": r.bytes_fetched, "stage_seconds": r.stage_seconds,
           "apply_seconds": r.apply_seconds, "verify_seconds": r.verify_seconds,
           "pause_seconds": r.pause_seconds, "seconds": r.seconds}
    if r.from_version == r.version:
        line = f"{args.out} already holds version {r.version}"
    else:
        start = "nothing" if r.from_version is None else f"version {r.from_version}"
        line = (f"pulled {args.out} from {start} to version {r.version}: "
                f"{_size(r.bytes_fetched)} fetched via {len(r.route)} step(s), "
                f"{r.seconds:.2f}s (pause {r.pause_seconds:.2f}s)")
    _emit(args, doc, line)
    return EXIT_OK


def _open(args: argparse.Namespace) -> Store:
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    return open_store(args.store, **options)


def _existing_store(args: argparse.Namespace) -> Store:
    """The store for read-only commands: a mistyped path must not be created as an empty store."""
    url = args.store
    path = url[len("file://"):] if url.startswith("file://") else url
    if "://" not in path and not Path(path).expanduser().is_dir():
        raise UsageError(f"store {url} does not exist (or is not a directory)")
    return _open(args)


def _version_or_latest(store: Store, version: int | None) -> int:
    if version is not None:
        return version
    latest = catalog.latest_version(store)
    if latest is None:
        raise UsageError(f"store {store.url} holds no committed version")
    return latest


def cmd_verify(args: argparse.Namespace) -> int:
    state = load_checkpoint(args.ckpt)
    store = _existing_store(args)
    v = _version_or_latest(store, args.version)
    m = catalog.primary_manifest(store, v)
    expected = {t.name: t for t in m.tensors}
    have = {s.name: s for s in specs_of(state)}
    differ = sorted(set(expected) ^ set(have))  # missing or unexpected names
    for name in sorted(set(expected) & set(have)):
        e, s = expected[name], have[name]
        if (e.dtype, list(e.shape)) != (s.dtype.name, list(s.shape)) \
                or digest_bits(bits(state[name])).hex() != e.digest:
            differ.append(name)
    if differ:
        shown = ", ".join(differ[:20]) + (" …" if len(differ) > 20 else "")
        print(f"{args.ckpt} differs from version {v} in {len(differ)} tensor(s): {shown}")
        return EXIT_MISMATCH
    print(f"{args.ckpt} is bit-identical to version {v} ({len(expected)} tensors)")
    return EXIT_OK


def _version_doc(store: Store, v: int, *, tensors: bool) -> dict[str, Any]:
    m = catalog.primary_manifest(store, v)
    numel = sum(t.spec().numel for t in m.tensors)
    reps = [{"key": r.key, "base": r.base, "payload_bytes": r.payload_bytes}
            for r in catalog.representations(store, v)]
    doc: dict[str, Any] = {"version": v, "base": m.base, "representations": reps,
                           "dense_bytes": m.dense_bytes, "payload_bytes": m.payload_bytes,
                           "changed_fraction": _fraction(m.changed, numel),
                           "tensors_count": len(m.tensors), "root": m.root}
    if tensors:
        doc["tensors"] = [{"name": t.name, "dtype": t.dtype, "shape": t.shape, "ops": t.ops,
                           "changed": t.changed,
                           "changed_fraction": _fraction(t.changed, t.spec().numel)}
                          for t in m.tensors]
    return doc


def cmd_inspect(args: argparse.Namespace) -> int:
    store = _existing_store(args)
    if args.version is not None:
        docs = [_version_doc(store, args.version, tensors=True)]
    else:
        docs = [_version_doc(store, v, tensors=False) for v in catalog.list_versions(store)]
    if args.json:
        print(json.dumps({"store": store.url, "versions": docs}, sort_keys=True))
        return EXIT_OK
    print(f"{store.url}: {len(docs)} version(s)" if args.version is None else store.url)
    for d in docs:
        base = "full" if d["base"] is None else f"base {d['base']}"
        reps = ",".join("full" if r["base"] is None else f"from-{r['base']}"
                        for r in d["representations"])
        print(f"  v{d['version']}: {base}; reps [{reps}]; payload {_size(d['payload_bytes'])} "
              f"of {_size(d['dense_bytes'])} dense; {d['changed_fraction']:.4%} changed")
        for t in d.get("tensors", []):
            print(f"    {t['name']} {t['dtype']}{t['shape']}: {t['changed_fraction']:.4%} changed "
                  f"[{', '.join(t['ops']) or '-'}]")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    try:  # lazily: the demo pulls in optional dependencies (transformers, a model)
        from .demo import run
    except ImportError as exc:
        raise UsageError(f"the demo is not available in this install ({exc}); "
                         "install weighthub[demo]") from exc
    return int(run.main(args) or 0)


def cmd_serve_hub(args: argparse.Namespace) -> int:
    try:  # lazily: the hub's HTTP server needs aiohttp, which the core does not
        from .net import hub
    except ImportError as exc:
        raise UsageError(f"the hub is not available in this install ({exc}); "
                         "install weighthub[hub]") from exc
    hub.run_from_args(args)
    return EXIT_OK


def cmd_serve_node(args: argparse.Namespace) -> int:
    node.run_from_args(args)
    return EXIT_OK


def _add_serve(sub: Any) -> None:
    """`weighthub serve hub` and `serve node`: long-running services."""
    serve = sub.add_parser("serve", help="run a service: the hub, or a node")
    kinds = serve.add_subparsers(dest="service", required=True, metavar="SERVICE")
    s = kinds.add_parser("hub", help="track versions, holders and leases; rank sources; plan relay trees")
    hubcore.add_arguments(s)
    s.set_defaults(func=cmd_serve_hub)
    s = kinds.add_parser("node", help="a rollout worker's daemon: follow versions into OUT, serve "
                                      "and relay what it holds")
    node.add_arguments(s)
    s.set_defaults(func=cmd_serve_node)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weighthub", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
                   help="'fast': plain-gap positions, ~1.5x faster encode and receiver staging for "
                        "~18%% more bytes (fast links); 'compact' (default): exponent-grouped positions")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_publish)

    s = sub.add_parser("pull", parents=[remote], help="bring a .safetensors file or directory to a version")
    s.add_argument("store")
    s.add_argument("out", help="a path ending in .safetensors, or a directory")
    s.add_argument("--version", type=int, help="default: the latest")
    s.add_argument("--stage-dir", default=None, metavar="DIR",
                   help="host-wide chunk cache shared by receivers on this host (e.g. /dev/shm/wh)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_pull)

    s = sub.add_parser("verify", parents=[remote],
                       help="check a checkpoint's bits against a version (exit 1 if not)")
    s.add_argument("store")
    s.add_argument("ckpt")
    s.add_argument("--version", type=int, help="default: the latest")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("inspect", parents=[remote], help="list versions, or one version's tensors")
    s.add_argument("store")
    s.add_argument("--version", type=int)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("demo", help="fine-tune MiniLM here; refit it bit-exact into receiver processes")
    s.add_argument("--steps", type=int, default=6)
    s.add_argument("--receivers", type=int, default=2)
    s.add_argument("--lr", type=float, default=1e-5)
    s.add_argument("--store", default=None, help="default: a fresh temporary directory")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", default=None, metavar="PATH", help="write a JSON summary here")
    s.add_argument("--optimizer", choices=["adamw", "logra"], default="adamw",
                   help="logra: low-rank gradient sketches for 2-D weights (weighthub.train)")
    s.add_argument("--logra-rank", type=int, default=16)
    s.set_defaults(func=cmd_demo)

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


if __name__ == "__main__":
    sys.exit(main())
