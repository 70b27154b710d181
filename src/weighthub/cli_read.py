"""The read-only commands of the command line: `weighthub verify` and `weighthub inspect`.

Neither writes anything. `inspect` reads only manifests (no torch, no numba: it starts fast);
`verify` loads the checkpoint and compares its bits by digest, never by float value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import catalog
from .errors import UsageError
from .store import Store, open_store

EXIT_OK, EXIT_MISMATCH = 0, 1


def fraction(changed: int, numel: int) -> float:
    return changed / numel if numel else 0.0


def size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def open_store_of(args: argparse.Namespace) -> Store:
    """The store the command names (STORE and --endpoint-url)."""
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    return open_store(args.store, **options)


def existing_store(args: argparse.Namespace) -> Store:
    """The store for read-only commands: a mistyped path must not be created as an empty store."""
    url = args.store
    path = url[len("file://"):] if url.startswith("file://") else url
    if "://" not in path and not Path(path).expanduser().is_dir():
        raise UsageError(f"store {url} does not exist (or is not a directory)")
    return open_store_of(args)


def _version_or_latest(store: Store, version: int | None) -> int:
    if version is not None:
        return version
    latest = catalog.latest_version(store)
    if latest is None:
        raise UsageError(f"store {store.url} holds no committed version")
    return latest


def cmd_verify(args: argparse.Namespace) -> int:
    from .digest import digest_bits
    from .targets import load_checkpoint
    from .tensors import bits, model_diff, specs_of

    state = load_checkpoint(args.ckpt)
    store = existing_store(args)
    v = _version_or_latest(store, args.version)
    m = catalog.primary_manifest(store, v)
    diff = model_diff(m.specs(), specs_of(state))
    unlike = {e.name for e, _got in diff.changed}  # another dtype or shape: bits not compared
    other_bits = [t.name for t in m.tensors if t.name in state and t.name not in unlike
                  and digest_bits(bits(state[t.name])).hex() != t.digest]
    if diff or other_bits:
        problems = diff.phrases("the checkpoint", f"version {v}", limit=_SHOWN)
        if other_bits:
            more = " …" if len(other_bits) > _SHOWN else ""
            problems.append(f"other bits: {other_bits[:_SHOWN]}{more}")
        count = len(diff.missing) + len(diff.unexpected) + len(diff.changed) + len(other_bits)
        print(f"{args.ckpt} differs from version {v} in {count} tensor(s): " + "; ".join(problems))
        return EXIT_MISMATCH
    print(f"{args.ckpt} is bit-identical to version {v} ({len(m.tensors)} tensors)")
    return EXIT_OK


_SHOWN = 20  # tensor names listed per kind of difference


def _version_doc(store: Store, v: int, *, tensors: bool) -> dict[str, Any]:
    m = catalog.primary_manifest(store, v)
    numel = sum(t.spec().numel for t in m.tensors)
    reps = [{"key": r.key, "base": r.base, "payload_bytes": r.payload_bytes}
            for r in catalog.representations(store, v)]
    doc: dict[str, Any] = {"version": v, "base": m.base, "representations": reps,
                           "dense_bytes": m.dense_bytes, "payload_bytes": m.payload_bytes,
                           "changed_fraction": fraction(m.changed, numel),
                           "tensors_count": len(m.tensors), "root": m.root}
    if tensors:
        doc["tensors"] = [{"name": t.name, "dtype": t.dtype, "shape": t.shape, "ops": t.ops,
                           "changed": t.changed,
                           "changed_fraction": fraction(t.changed, t.spec().numel)}
                          for t in m.tensors]
    return doc


def cmd_inspect(args: argparse.Namespace) -> int:
    store = existing_store(args)
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
        print(f"  v{d['version']}: {base}; reps [{reps}]; payload {size(d['payload_bytes'])} "
              f"of {size(d['dense_bytes'])} dense; {d['changed_fraction']:.4%} changed")
        for t in d.get("tensors", []):
            print(f"    {t['name']} {t['dtype']}{t['shape']}: {t['changed_fraction']:.4%} changed "
                  f"[{', '.join(t['ops']) or '-'}]")
    return EXIT_OK
