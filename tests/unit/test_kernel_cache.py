"""The disk cache of the kernels is keyed on all of their sources (weighthub.kernel_cache): an
edit of one kernel module recompiles the kernels of the others, which carry its helpers
compiled in."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from numba.core import caching

from weighthub import kernel_cache
from weighthub.codec import ans_kernels, kernels
from weighthub.digest import kernels as digest_kernels
from weighthub.kernel_cache import KERNEL_MODULES, PACKAGE, sources_stamp


def test_the_list_of_kernel_modules_is_whole() -> None:
    """Every module that compiles kernels, or intrinsics that kernels compile in, is in the
    stamp (one left out would keep a stale cache of its callers)."""
    defining = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                      if re.search(r"^@(njit|intrinsic)\b", p.read_text(), re.MULTILINE))
    assert defining == sorted(KERNEL_MODULES)


def test_every_kernel_is_stamped_with_the_digest_of_all_kernel_sources() -> None:
    assert kernel_cache.INSTALLED
    stamp = sources_stamp()
    for kernel in (kernels.scan_blocks, ans_kernels.ans_decode_ranks, digest_kernels.sum_run):
        locator = kernel._cache._impl._locator
        assert type(locator).__name__.startswith("WeighthubStamped")
        assert locator.get_source_stamp() == stamp


def test_the_stamp_changes_with_any_kernel_source(tmp_path: Path) -> None:
    for name in KERNEL_MODULES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PACKAGE / name, tmp_path / name)
    assert sources_stamp(tmp_path) == sources_stamp()
    for name in KERNEL_MODULES:
        original = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(original + b"# edited\n")
        assert sources_stamp(tmp_path) != sources_stamp(), name
        (tmp_path / name).write_bytes(original)
    assert sources_stamp(tmp_path) == sources_stamp()


def test_functions_outside_the_package_keep_numbas_own_stamps() -> None:
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    stamped = [c for c in impl._locator_classes if c.__name__.startswith("WeighthubStamped")]
    assert stamped
    for locator in stamped:
        assert locator.from_function(test_functions_outside_the_package_keep_numbas_own_stamps,
                                     __file__) is None
