#!/usr/bin/env python
"""Long fuzz runs of weighthub's parsers, outside pytest (nightly-style), with crashers saved.

The targets and the contract are the CI fuzz tests' own (tests/fuzz/targets.py, contract.py):
any bytes either parse or raise from weighthub's error tree, within a deadline and a memory
bound. Two engines:

  hypothesis (default)  the structure-aware strategies of tests/fuzz/strategies.py (real frames,
                        manifests, requests, tokens, edited), random seeds, for --minutes per
                        target. Every distinct violation (exception type and where it was
                        raised) is kept, minimized byte by byte, and with --save written to
                        tests/fuzz/corpus/<target>/crash-*.bin, where test_fuzz_corpus.py
                        replays it from then on.
  atheris (--atheris)   coverage-guided libFuzzer over one target's raw bytes, seeded with its
                        corpus directory; atheris is not a weighthub dependency:
                            python -m pip install atheris      (Linux/macOS wheels; building
                                                                from source needs clang)
                        then e.g. `python scripts/fuzz_nightly.py --atheris chunk_resum
                        --minutes 60`. Crashes land in ./crash-*; copy them into the corpus.

Examples:
    python scripts/fuzz_nightly.py --minutes 5 --save
    python scripts/fuzz_nightly.py --targets manifest,wire_request --minutes 30 --seed 7
"""

from __future__ import annotations

import argparse
import hashlib
import re
import struct
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from fuzz.contract import ContractViolation  # noqa: E402  (needs the path above)
from fuzz.targets import TARGETS, check  # noqa: E402

CORPUS = REPO / "tests" / "fuzz" / "corpus"
BATCH = 500  # examples per hypothesis run; runs repeat with new seeds until the time is up


def fuzz_hypothesis(name: str, seconds: float, seed: int) -> dict[str, bytes]:
    """Signature -> smallest input that showed it, for one target over `seconds`."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    from fuzz.strategies import strategies

    found: dict[str, bytes] = {}
    strategy = strategies()[name]
    end = time.monotonic() + seconds
    runs = examples = 0

    @settings(max_examples=BATCH, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(data: bytes) -> None:
        nonlocal examples
        examples += 1
        try:
            check(name, data)
        except ContractViolation as v:
            if v.signature not in found or len(data) < len(found[v.signature]):
                if v.signature not in found:
                    print(f"  {name}: NEW {v}", flush=True)
                found[v.signature] = data

    while time.monotonic() < end:
        try:
            with_seed(seed + runs)(one)()
        except Exception as exc:  # the strategy itself failed (an encoder refused what it built)
            print(f"  {name}: strategy failed, stopping this target: {type(exc).__name__}: {exc}",
                  flush=True)
            break
        runs += 1
    print(f"{name}: {examples} examples in {runs} runs, {len(found)} distinct violations",
          flush=True)
    return found


def signature_of(name: str, data: bytes, *, deep: bool = False) -> str | None:
    """The violation `data` shows, if any. deep: with twice the recursion limit, so that an
    input minimized for a RecursionError still nests too deeply for a deeper caller's stack
    (pytest's) and for a different limit."""
    limit = sys.getrecursionlimit()
    if deep:
        sys.setrecursionlimit(2 * limit)
    try:
        check(name, data)
    except ContractViolation as v:
        return v.signature
    finally:
        sys.setrecursionlimit(limit)
    return None


def _fix_prefix(data: bytes) -> bytes:
    """A wire frame whose header length is what follows its 8-byte prefix."""
    return data[:4] + struct.pack("!I", max(0, len(data) - 8)) if len(data) <= 8 else \
        data[:4] + struct.pack("!I", len(data) - 8) + data[8:]


def _fix_length(data: bytes) -> bytes:
    """A safetensors file whose 8-byte header length covers the rest (no tensor data)."""
    return struct.pack("<Q", max(0, len(data) - 8)) + data[8:]


def _single_segments(data: bytes) -> list[bytes]:
    """A segments-target input as one input per segment, uncompressed (cuttable byte by byte)."""
    from fuzz.targets import MAX_BODY, resum64
    from weighthub.errors import WeighthubError
    from weighthub.format.chunk import decode_chunk, encode_chunk

    try:
        frame = decode_chunk(resum64(data[2:]), where="minimize", max_body=MAX_BODY)
    except WeighthubError:
        return []
    return [data[:2] + encode_chunk([s], compress=False) for s in frame.segments]


# Smaller inputs built from the input's structure, tried before cutting bytes.
CANDIDATES = {"segments": _single_segments}

# Length fields re-derived after each cut, or almost no cut would keep the frame readable.
FIXUPS = {"wire_request": _fix_prefix, "wire_response": _fix_prefix,
          "safetensors_header": _fix_length}


def minimize(name: str, data: bytes, signature: str, budget_s: float = 60.0) -> tuple[str, bytes]:
    """Remove byte ranges while the same violation remains (ddmin-like, halving the cut).

    Checksummed targets are minimized through their `*_resum` twin (the cut would break the
    trailer); the result is then saved under that twin. Framed targets re-derive their length
    field after each cut (FIXUPS).
    """
    deep = "RecursionError" in signature
    fix = FIXUPS.get(name, lambda b: b)
    if fix(data) != data and signature_of(name, fix(data), deep=deep) == signature:
        data = fix(data)
    elif fix(data) != data:
        fix = lambda b: b  # noqa: E731  (the input's length field is part of the bug)
    if f"{name}_resum" in TARGETS:
        twin = f"{name}_resum"
        twin_sig = signature_of(twin, data, deep=deep)
        if twin_sig is not None:
            name, signature = twin, twin_sig
    for candidate in sorted(CANDIDATES.get(name, lambda b: [])(data), key=len):
        if len(candidate) < len(data) and signature_of(name, candidate, deep=deep) == signature:
            data = candidate
            break
    end = time.monotonic() + budget_s
    cut = max(1, len(data) // 2)
    while cut >= 1 and time.monotonic() < end:
        i, shrunk = 0, False
        while i < len(data) and time.monotonic() < end:
            trial = fix(data[:i] + data[i + cut:])
            if trial != data and signature_of(name, trial, deep=deep) == signature:
                data, shrunk = trial, True
            else:
                i += cut
        if not shrunk:
            cut //= 2
    return name, data


def save(name: str, data: bytes, signature: str) -> Path | None:
    folder = CORPUS / name
    folder.mkdir(parents=True, exist_ok=True)
    if any(p.read_bytes() == data for p in folder.iterdir() if p.is_file()):
        return None
    slug = re.sub(r"[^a-z0-9]+", "-", signature.split(" at ")[0].lower()).strip("-")[:40]
    path = folder / f"crash-{slug}-{hashlib.sha256(data).hexdigest()[:8]}.bin"
    path.write_bytes(data)
    return path


def run_atheris(name: str, seconds: float) -> None:
    try:
        import atheris
    except ImportError:
        sys.exit("atheris is not installed: `python -m pip install atheris` (not a weighthub "
                 "dependency), or run without --atheris for the hypothesis engine")
    # the targets imported the parsers already: instrument every loaded function (atheris
    # >= 2.1) for coverage feedback
    atheris.instrument_all()
    seeds = CORPUS / name
    seeds.mkdir(parents=True, exist_ok=True)

    def one_input(data: bytes) -> None:
        check(name, data)  # a ContractViolation is a crash to libFuzzer

    atheris.Setup([sys.argv[0], str(seeds), f"-max_total_time={int(seconds)}"], one_input)
    atheris.Fuzz()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="", help=f"comma-separated, of {sorted(TARGETS)}")
    p.add_argument("--minutes", type=float, default=10.0, help="per target")
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--save", action="store_true", help="write minimized crashers to the corpus")
    p.add_argument("--atheris", metavar="TARGET", help="coverage-guided run of one target")
    args = p.parse_args()
    if args.atheris:
        run_atheris(args.atheris, args.minutes * 60)
        return 0
    from fuzz.strategies import strategies

    known = strategies()
    names = args.targets.split(",") if args.targets else sorted(known)
    if unknown := [n for n in names if n not in known]:
        p.error(f"no hypothesis strategy for {unknown}: choose from {sorted(known)} (the "
                "*_resum twins are for byte-level fuzzing: --atheris TARGET)")
    print(f"seed {args.seed}; targets {names}; {args.minutes:g} min each", flush=True)
    total = 0
    for name in names:
        for sig, data in fuzz_hypothesis(name, args.minutes * 60, args.seed).items():
            total += 1
            target, small = minimize(name, data, sig)
            path = save(target, small, sig) if args.save else None
            print(f"CRASHER {target}: {sig} ({len(data)} -> {len(small)} bytes)"
                  + (f" saved {path.relative_to(REPO)}" if path else ""), flush=True)
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
