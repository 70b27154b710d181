"""Every install hint in the package and the README names extras that pyproject.toml defines.

A hint naming an extra that does not exist (`weighthub[hub]` once) sends users to a pip error.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# `weighthub[s3]` in messages, `'.[demo,test]'` (an editable install of the checkout) in the README
HINT = re.compile(r"(?:(?<![\w.])weighthub|'\.)\[([a-z][a-z0-9_,-]*)\]")


def test_every_suggested_extra_exists() -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    hints = {(path.relative_to(ROOT).as_posix(), name)
             for path in [*(ROOT / "src").rglob("*.py"), ROOT / "README.md"]
             for names in HINT.findall(path.read_text()) for name in names.split(",")}
    assert {"net", "s3", "demo"} <= {name for _, name in hints}  # the scan finds what it guards
    assert [h for h in sorted(hints) if h[1] not in extras] == []
