"""Lazy re-exports: a package names what a heavy submodule defines without importing it.

`weighthub.codec`, `weighthub.digest` and `weighthub.format` re-export names whose modules pull
in numba (seconds per process); the CLI's `--help` and `inspect` must not pay that
(tests/integration/test_cli.py checks), so those names are resolved on first use through a
module `__getattr__` (PEP 562).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(namespace: dict[str, Any],
                 sources: Mapping[str, frozenset[str]]) -> Callable[[str], Any]:
    """A module `__getattr__` for the package whose globals are `namespace`: the names in
    `sources[submodule]` come from that submodule, imported on the first lookup of one of them
    and then cached in the package's globals."""
    package = namespace["__name__"]
    where = {name: sub for sub, names in sources.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
            namespace[name] = value  # later lookups find it without coming here
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
