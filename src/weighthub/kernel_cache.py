"""numba's `njit`, with the disk cache of weighthub's kernels keyed on all of their sources.

numba stamps a cached kernel with the mtime and size of the file that defines it, and nothing
else; but a kernel carries the helpers it calls from other modules compiled into it (numba's
`inline="always"`, or LLVM linking the callee in). After an edit of `codec/ans.py` alone (a
`git pull` in an editable install), the cached kernels of `codec/ans_kernels.py` would go on
running the old helpers. Here every kernel of the package is stamped instead with one digest
over the sources of every module that defines kernels (KERNEL_MODULES), so an edit of any of
them recompiles them all, as a fresh install does.

Kernel modules import `njit` from here rather than from numba: importing this module installs
the stamping (once per process) before their first decorator runs. On a numba without the
hook point (its cache internals are not public API) the kernels keep numba's own stamps.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from numba import njit
from numba.core import caching

PACKAGE = Path(__file__).resolve().parent
# every module that defines kernels or the intrinsics compiled into them
# (tests/unit/test_kernel_cache.py checks the list is whole)
KERNEL_MODULES = ("codec/ans.py", "codec/ans_kernels.py", "codec/ctx_kernels.py",
                  "codec/kernels.py", "codec/place.py", "codec/place_vectors.py",
                  "codec/prepared.py", "codec/prepared_many.py", "codec/rangecoder.py",
                  "codec/ranks.py", "codec/small_kernels.py",
                  "digest/kernels.py", "digest/mix.py", "format/table_kernel.py")


def sources_stamp(root: Path = PACKAGE, modules: tuple[str, ...] = KERNEL_MODULES) -> str:
    """SHA-256 over the named sources' paths and bytes: what every kernel's cache entry is
    stamped with."""
    h = hashlib.sha256()
    for name in modules:
        h.update(name.encode() + b"\0")
        h.update((root / name).read_bytes())
    return h.hexdigest()


def _stamped(base: type, stamp: str) -> type:
    """A subclass of numba's locator `base` that stamps the package's kernels with `stamp`
    and declines every other function (numba then tries `base` itself, next in its list)."""

    class Stamped(base):
        def get_source_stamp(self) -> Any:
            return stamp

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Any:
            try:
                Path(py_file).resolve().relative_to(PACKAGE)
            except (ValueError, OSError):
                return None
            return super().from_function(py_func, py_file)

    Stamped.__name__ = Stamped.__qualname__ = f"WeighthubStamped{base.__name__.lstrip('_')}"
    return Stamped


def _install() -> bool:
    """Put a stamped locator before each of numba's source-file locators. True if installed."""
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    mixin = getattr(caching, "_SourceFileBackedLocatorMixin", None)
    locators = getattr(impl, "_locator_classes", None)
    if mixin is None or not isinstance(locators, list):
        return False
    if any(c.__name__.startswith("WeighthubStamped") for c in locators):
        return True  # this module imported again under another name
    stamp = sources_stamp()
    for base in [c for c in locators if issubclass(c, mixin)]:
        locators.insert(locators.index(base), _stamped(base, stamp))
    return True


INSTALLED = _install()

__all__ = ["INSTALLED", "KERNEL_MODULES", "PACKAGE", "njit", "sources_stamp"]
