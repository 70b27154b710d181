"""integrations.ray.heap: a full collection after freeze_startup_heap skips the start-up heap."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_full_collection_after_the_freeze_walks_only_later_objects() -> None:
    # in a child process: freezing pytest's own heap would outlive this test
    code = textwrap.dedent("""
        import gc, time
        from weighthub.integrations.ray import freeze_startup_heap
        startup = [[i] for i in range(300_000)]  # long-lived containers, as a model's heap
        t0 = time.perf_counter(); gc.collect(); before = time.perf_counter() - t0
        frozen = freeze_startup_heap()
        later = [[i] for i in range(1_000)]
        assert frozen >= 300_000, frozen
        assert len(gc.get_objects()) < 20_000, len(gc.get_objects())  # what a collection walks
        t0 = time.perf_counter(); gc.collect(); after = time.perf_counter() - t0
        print(f"full collection {before * 1e3:.1f} ms before, {after * 1e3:.1f} ms after")
        assert startup[-1] == [299_999] and later[-1] == [999]  # frozen objects stay usable
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "full collection" in done.stdout
