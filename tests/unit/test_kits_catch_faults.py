"""The conformance kits fail backends that break the contract (a kit that passes everything
proves nothing), and `run_kit` runs a kit without pytest (as inside an engine's worker)."""

from __future__ import annotations

from weighthub.sources import ChunkId, ChunkSource
from weighthub.store import MemoryStore, Store
from weighthub.targets import Held, StateDictTarget, Target
from weighthub.testing import SourceTests, StoreTests, TargetTests, run_kit


class _NoCreateOnly(MemoryStore):
    """Treats a create-only write as a plain one: two publishers could both commit."""

    def put(self, key, data, *, create_only=False, timeout=None):  # type: ignore[no-untyped-def]
        super().put(key, data, timeout=timeout)


class _BrokenStoreKit(StoreTests):
    def make_store(self) -> Store:
        return _NoCreateOnly("broken")


class _Padding:
    """Pads every chunk to a multiple of 8 bytes, and answers a miss with empty bytes."""

    name = "padding source"

    def __init__(self, chunks: dict[ChunkId, bytes]) -> None:
        self.chunks = chunks

    def get_chunk(self, ref: ChunkId, *, timeout: float) -> bytes:
        data = self.chunks.get(ref, b"")
        return data + bytes(-len(data) % 8)


class _BrokenSourceKit(SourceTests):
    def make_source(self, chunks: dict[ChunkId, bytes]) -> ChunkSource:
        return _Padding(chunks)


class _LeakyTarget(StateDictTarget):
    """Keeps what open() materialized after an abort, and forgets one tensor's committed bits."""

    def abort(self) -> None:
        self._materialized.clear()

    def commit(self, held: Held) -> None:
        super().commit(held)
        first = next(iter(self.state.values()))
        first.view(-1)[:1] = 0  # type: ignore[call-overload]


class _BrokenTargetKit(TargetTests):
    def make_target(self) -> Target:
        return _LeakyTarget({})


def _failed(results: dict[str, str]) -> set[str]:
    return {name for name, outcome in results.items() if outcome.startswith("failed")}


def test_store_kit_fails_a_store_without_create_only() -> None:
    failed = _failed(run_kit(_BrokenStoreKit()))
    assert {"test_create_only", "test_concurrent_create_only_threads"} <= failed
    assert "test_put_get" not in failed


def test_source_kit_fails_a_source_that_pads_or_invents() -> None:
    failed = _failed(run_kit(_BrokenSourceKit()))
    assert {"test_exact_bytes", "test_missing_chunk_is_object_not_found",
            "test_errors_are_from_the_tree"} <= failed


def test_target_kit_fails_a_leaky_target() -> None:
    failed = _failed(run_kit(_BrokenTargetKit()))
    assert {"test_abort_of_a_first_transaction", "test_commit_records_held_and_bits",
            "test_abort_restores_exact_bits"} <= failed


def test_run_kit_reports_every_check() -> None:
    class Good(TargetTests):
        def make_target(self) -> Target:
            return StateDictTarget({})

    results = run_kit(Good())
    assert results and all(r == "passed" for r in results.values()), results
