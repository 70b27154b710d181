"""Deadlines for what the tests wait on: hang guards sized from the operation, not speed checks.

Each is a generous multiple of what the operation takes on a quiet 2-core machine, because the
same suite must pass with the machine loaded (CI shares it; two CPU-burning processes alongside
stretch a cold Python start from ~4 s to 20 s and more). A test that needs to tell "bounded"
from "waited too long" compares against the bound it is testing (a lease wait, a peer's delay),
measured where the wait happens, never against these.
"""

from __future__ import annotations

# a fresh Python process that imports torch/numba (a CLI call, a node, a receiver, the bench):
# 3-5 s quiet, 20-40 s under load
PROCESS_S = 180.0
# a whole subprocess run that does real work besides starting (bench --quick: ~60 s quiet)
LONG_PROCESS_S = 540.0
