"""Replay the corpus: every past crasher and seed in corpus/<target>/ must hold the contract.

A crasher is saved (minimized) by scripts/fuzz_nightly.py, or by hand from a failing fuzz test,
as corpus/<target>/crash-<what>.bin; it stays here as a regression test after its fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .targets import TARGETS, check

CORPUS = Path(__file__).parent / "corpus"
FILES = sorted(p for p in CORPUS.glob("*/*") if p.is_file() and not p.name.startswith("."))


def test_every_corpus_directory_names_a_target() -> None:
    assert {p.parent.name for p in FILES} <= set(TARGETS)


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.name}" for p in FILES])
def test_corpus_input_holds_the_contract(path: Path) -> None:
    check(path.parent.name, path.read_bytes())
