"""Conformance kits, shipped so that every backend (ours and third parties') runs one suite.

    StoreTests          a Store (weighthub.store): objects, create-only commits, ranges,
                        listings, deletes, atomic puts, key rules, timeout arguments, errors
    StoreTimeoutTests   + a stalled call ends in StoreTimeout within its timeout
    SourceTests         a ChunkSource (weighthub.sources): exact bytes, misses, threads
    SourceTimeoutTests  + a stalled fetch ends within its timeout
    CacheTests          + a ChunkCache serves what it keeps
    TargetTests   a Target (weighthub.targets): open/commit/abort, held/specs/peek, exact
                  restores by bit pattern, disjoint views

Each kit is a plain class whose `test_*` methods use `assert`, as zarr's `StoreTests` is: a
backend's test module subclasses it as `TestMyStore(StoreTests)` and implements the factory
(`make_store`, `make_source`, `make_target`); pytest collects the subclass. A backend runs
the kit of each ability it has, so no check is ever skipped. The kits never import pytest
(weighthub does not depend on it), and a kit can also run where pytest cannot collect, e.g.
inside an engine's worker process (`run_kit`).
"""

from ._check import raises, run_kit
from .sources import CacheTests, SourceTests, SourceTimeoutTests
from .stores import StoreTests, StoreTimeoutTests
from .targets import TargetTests

__all__ = ["CacheTests", "SourceTests", "SourceTimeoutTests", "StoreTests", "StoreTimeoutTests",
           "TargetTests", "raises", "run_kit"]
