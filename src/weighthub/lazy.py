"""Lazy re-exports: a package names what a heavy submodule defines without importing it.

`weighthub.codec` and `weighthub.format` re-export names whose modules pull in numba (seconds
per process); the CLI's `--help` and `inspect` must not pay that (tests/integration/test_cli.py
checks), so those names are resolved on first use through a module `__getattr__` (PEP 562).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], submodule: str,
                 names: frozenset[str]) -> Callable[[str], Any]:
    """A module `__getattr__` for the package whose globals are `namespace`: `names` come from
    its `submodule`, imported on the first lookup and then cached in the package's globals."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(f"{package}.{submodule}"), name)
            namespace[name] = value  # later lookups find it without coming here
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
