"""What the kits need from a test runner, without depending on one: raises, run."""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class _Caught:
    """What `raises` caught: `.value` is the exception."""

    value: BaseException


@contextmanager
def raises(kind: type[BaseException] | tuple[type[BaseException], ...],
           match: str | None = None) -> Iterator[_Caught]:
    """Assert that the block raises `kind` (and that `match` is found in its message)."""
    caught = _Caught()
    try:
        yield caught
    except kind as exc:
        caught.value = exc
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(f"{type(exc).__name__}({str(exc)!r}) does not match "
                                 f"{match!r}") from exc
        return
    raise AssertionError(f"no {kind} raised")


def run_kit(kit: Any) -> dict[str, str]:
    """Run every `test_*` method of a kit instance without pytest: name → 'passed' or 'failed:
    traceback'. For places pytest cannot reach (an engine's worker process)."""
    out = {}
    for name in sorted(n for n in dir(kit) if n.startswith("test_")):
        try:
            getattr(kit, name)()
            out[name] = "passed"
        except Exception as exc:
            out[name] = "failed: " + "".join(traceback.format_exception(exc))[-4000:]
    return out
