"""The glibc environment for refit processes (`integrations.ray.heap.REFIT_MALLOC_ENV`) is one
glibc honours, and the README's `export` line for processes outside Ray says the same."""

from __future__ import annotations

import re
from pathlib import Path

from weighthub.integrations.ray.heap import REFIT_MALLOC_ENV

ROOT = Path(__file__).resolve().parents[2]


def test_values_are_ones_glibc_takes() -> None:
    env = {k: int(v) for k, v in REFIT_MALLOC_ENV.items()}
    assert env["MALLOC_ARENA_MAX"] >= 1
    # glibc ignores an mmap threshold above its maximum (32 MiB on 64-bit): the default stays
    assert 0 < env["MALLOC_MMAP_THRESHOLD_"] <= 32 << 20
    assert env["MALLOC_TRIM_THRESHOLD_"] > env["MALLOC_MMAP_THRESHOLD_"]


def test_readme_export_matches() -> None:
    text = " ".join((ROOT / "README.md").read_text().split())
    line = re.search(r"`export (MALLOC_[^`]+)`", text)
    assert line is not None, "the README's export line for REFIT_MALLOC_ENV is gone"
    assert dict(kv.split("=", 1) for kv in line.group(1).split()) == REFIT_MALLOC_ENV
