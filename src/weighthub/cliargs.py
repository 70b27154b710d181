"""argparse pieces of the command line (weighthub.cli): argument types, lazily filled subcommands.

Kept apart from the commands so that building the parser (`weighthub --help`, every argument
error) imports nothing heavy: the modules behind a subcommand's options are imported only
when that subcommand is parsed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any


def version_number(text: str) -> int:
    """argparse type of `--version N`: a committed version, numbered from 0."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a version number (0, 1, 2, …)") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v}: versions are numbered from 0; omit --version for "
                                         "the latest")
    return v


class LazyParser(argparse.ArgumentParser):
    """A subcommand whose options come from a module too heavy to import on every run.

    `add_arguments` (which imports that module) runs when this subcommand's arguments are
    parsed or its help is shown, not when the parser is built: `weighthub --help` and the
    other commands never pay for it. Pass as `parser_class` to `add_subparsers`, then
    `add_arguments=` to each `add_parser`.
    """

    def __init__(self, *args: Any,
                 add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._add_arguments = add_arguments

    def populate(self) -> LazyParser:
        """Add the deferred arguments now (once)."""
        if self._add_arguments is not None:
            add, self._add_arguments = self._add_arguments, None
            add(self)
        return self

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        self.populate()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.populate()
        return super().format_usage()

    def format_help(self) -> str:
        self.populate()
        return super().format_help()
