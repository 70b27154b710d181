"""A receiver process for test_target_crash.py: one pull into a safetensors target, optionally
stopped at a named point of its transaction (for the test to kill it there, or to let it go on).

    python target_child.py STORE OUT VERSION [--cli] [--mode M] [--lock-timeout S]
                           [--pause POINT] [--go FILE] [--say-opening] [--after FILE]

--cli runs `weighthub pull` (`cli.main`) instead of a `Receiver` over `SafetensorsTarget(OUT,
mode=M, lock_timeout=S)`. --say-opening prints {"opening": true} as it calls
SafetensorsTarget.open (before any lock is taken). --after: start the pull (imports done) once
FILE exists, so that a test can start processes early and order their pulls. At POINT the
child prints {"paused": POINT} and then waits for FILE to exist (bounded), or forever without
--go (the test kills it). Points:

    opened        SafetensorsTarget.open returned (the transaction holds the target)
    journaled     the crash journal is durable (in place: the first step's batch; atomic: the
                  renames'), no data byte written yet
    mid-apply     in place: three segments of the first step written into the file
    applied       every step applied and verified, the commit not begun
    renamed       an atomic commit's (or a materialization's) renames done, not yet claimed
    claimed       the new version's sidecar is durable, the journal not yet removed

Prints {"pulled": VERSION, "from": V} or {"error": "Type: message"} (with --cli: the pull's
own output, then {"exit": CODE}), one JSON line each.
Points that do not exist in the code under test (an older weighthub) are never reached.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

GO_WAIT_S = 120.0


_say_lock = threading.Lock()


def say(doc: dict[str, Any]) -> None:
    # one write under a lock: print() writes the line and its newline apart, so two threads
    # stopping at once would interleave them into lines the test cannot parse
    line = json.dumps(doc) + "\n"
    with _say_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def install_pause(point: str, go: str | None) -> None:
    import weighthub.targets.safetensors_file as sf

    def stop() -> None:
        say({"paused": point})
        end = time.monotonic() + (GO_WAIT_S if go else 3600.0)
        while time.monotonic() < end and not (go and Path(go).exists()):
            time.sleep(0.02)

    def after(owner: Any, name: str, when: Any = lambda *a, **k: True) -> None:
        inner = getattr(owner, name, None)
        if inner is None:
            return  # not in this version of weighthub

        def wrapped(*a: Any, **k: Any) -> Any:
            out = inner(*a, **k)
            if when(*a, **k):
                stop()
            return out
        setattr(owner, name, wrapped)

    if point == "opened":
        after(sf.SafetensorsTarget, "open")
    elif point == "journaled":
        after(sf, "write_journal")
        after(sf, "append_batch")
    elif point == "applied" and hasattr(sf.SafetensorsTarget, "journal_step"):
        commit = sf.SafetensorsTarget.commit

        def stopped(self: Any, held: Any) -> None:
            stop()
            commit(self, held)
        sf.SafetensorsTarget.commit = stopped  # type: ignore[method-assign]
    elif point == "renamed":
        after(sf, "fsync_dir")
    elif point == "claimed":
        from weighthub.targets import sidecar
        after(sidecar, "write_sidecar", lambda dest, side: side.state == "committed")
    elif point == "mid-apply" and hasattr(sf.SafetensorsTarget, "journal_step"):
        import weighthub.receive.apply as apply_module

        whole, count = apply_module.apply_segment, [0]

        def segment(*a: Any, **k: Any) -> Any:
            out = whole(*a, **k)
            count[0] += 1
            if count[0] == 3:
                stop()
            return out
        apply_module.apply_segment = segment
    elif point not in ("", "applied", "mid-apply"):
        raise SystemExit(f"unknown pause point {point!r}")


def say_opening() -> None:
    import weighthub.targets.safetensors_file as sf

    inner = sf.SafetensorsTarget.open

    def opening(self: Any, specs: Any) -> Any:
        say({"opening": True})
        return inner(self, specs)
    sf.SafetensorsTarget.open = opening  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("out")
    ap.add_argument("version", type=int)
    ap.add_argument("--cli", action="store_true")
    ap.add_argument("--mode", default="in-place")
    ap.add_argument("--lock-timeout", type=float, default=None)
    ap.add_argument("--pause", default="")
    ap.add_argument("--go", default=None)
    ap.add_argument("--say-opening", action="store_true")
    ap.add_argument("--after", default=None)
    args = ap.parse_args(argv)
    if args.say_opening:
        say_opening()
    install_pause(args.pause, args.go)
    import weighthub.cli
    import weighthub.receive  # noqa: F401 (imported before waiting: the slow part of a start)

    end = time.monotonic() + GO_WAIT_S
    while args.after and not Path(args.after).exists() and time.monotonic() < end:
        time.sleep(0.02)
    if args.cli:
        from weighthub import cli

        code = cli.main(["pull", args.store, args.out, "--version", str(args.version), "--json"])
        say({"exit": code})
        return
    from weighthub.errors import WeighthubError
    from weighthub.receive import Receiver
    from weighthub.store import LocalStore
    from weighthub.targets.safetensors_file import SafetensorsTarget

    options: dict[str, Any] = {}  # only those given: an older weighthub has neither
    if args.mode != "in-place":
        options["mode"] = args.mode
    if args.lock_timeout is not None:
        options["lock_timeout"] = args.lock_timeout
    target = SafetensorsTarget(args.out, **options)
    try:
        r = Receiver(LocalStore(args.store, create=False), target, verify_base=True).sync(args.version)
    except WeighthubError as exc:
        say({"error": f"{type(exc).__name__}: {exc}"})
        return
    say({"pulled": r.version, "from": r.from_version})


if __name__ == "__main__":
    main(sys.argv[1:])
