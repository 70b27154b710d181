"""Decoding a version's chunks before its manifest exists (`receive.early`, `Receiver.decode_early`).

A directory stands for a node daemon's relay cache: the version's chunk files are copied into it
(as the relay would put them) before or after the decoder starts. Staging must take what was
decoded for exactly the bytes the manifest names, and end bit-identical to a staging without it;
anything else (other bytes, other held bits, a corrupt file) is decoded as before.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from weighthub import catalog
from weighthub.format.manifest import chunk_checksum
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.receive.early import EarlyChunks
from weighthub.store import LocalStore
from weighthub.targets import StateDictTarget

SPAN = 16 << 10  # small chunks: several per version


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    s = {"a": torch.randn(300, 64, generator=g).to(torch.bfloat16),
         "b": torch.randn(4096, generator=g), "c": torch.randn(50_000, generator=g).to(torch.bfloat16)}
    out = [s]
    for _ in range(n - 1):
        s = {k: v.clone() for k, v in s.items()}
        for v in s.values():
            flat = v.view(-1)
            flat[::29] = flat[::29] * 1.01 + 1e-3
        out.append(s)
    return out


def _bits(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in state.items()}


@pytest.fixture
def published(tmp_path: Path) -> tuple[LocalStore, list[dict[str, torch.Tensor]]]:
    store = LocalStore(tmp_path / "store")
    states = _states(3)
    pub = Publisher(store, delta_span_bytes=SPAN)
    for s in states:
        pub.publish(s)
    return store, states


def _relay(store: LocalStore, cache: Path, version: int, *, corrupt: int | None = None) -> list[Path]:
    """Copy `version`'s chunk files into `cache` under their keys (the relay's layout), the
    `corrupt`-th with a byte flipped."""
    src = store.root / catalog.version_dir(version)
    out = []
    for i, f in enumerate(sorted(src.glob(f"*/c*{catalog.CHUNK_SUFFIX}"))):
        dst = cache / f.relative_to(store.root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        data = bytearray(f.read_bytes())
        if i == corrupt:
            data[len(data) // 2] ^= 0xFF
        tmp = dst.with_name(".tmp-" + dst.name)  # in place by rename, as a LocalStore puts
        tmp.write_bytes(bytes(data))
        tmp.replace(dst)
        out.append(dst)
    return out


def _receiver(store: LocalStore, states: list[dict[str, torch.Tensor]]) -> Receiver:
    rx = Receiver(store, StateDictTarget({k: torch.zeros_like(v) for k, v in states[0].items()}))
    rx.sync(0)
    return rx


def _wait_decoded(rx: Receiver, count: int) -> None:
    deadline = time.monotonic() + 30
    while rx._early is not None and len(rx._early.chunks) < count:
        assert time.monotonic() < deadline, "the early decoder did not decode the relayed chunks"
        time.sleep(0.01)


def test_staging_takes_the_chunks_decoded_early_and_ends_bit_identical(published, tmp_path) -> None:
    store, states = published
    cache = tmp_path / "cache"
    rx = _receiver(store, states)
    assert rx.decode_early(1, cache)  # started before any chunk arrived
    files = _relay(store, cache, 1)
    assert len(files) >= 3
    _wait_decoded(rx, len(files))
    staged = rx.stage(1)
    assert rx.early_used == len(files) and rx._early is None  # every chunk; the decoder stopped
    rx.apply(staged)
    assert _bits(rx.target.state) == _bits(states[1])  # type: ignore[attr-defined]
    # the next version without it: decoded by staging alone, to the same bits
    rx.sync(2)
    assert rx.early_used == 0 and _bits(rx.target.state) == _bits(states[2])  # type: ignore[attr-defined]


def test_a_corrupt_relayed_file_is_decoded_by_staging_from_the_store(published, tmp_path) -> None:
    store, states = published
    cache = tmp_path / "cache"
    files = _relay(store, cache, 1, corrupt=1)
    rx = _receiver(store, states)
    assert rx.decode_early(1, cache)
    _wait_decoded(rx, len(files) - 1)
    time.sleep(0.05)  # it has looked at the corrupt one too (and left it)
    rx.apply(rx.stage(1))
    assert rx.early_used == len(files) - 1
    assert _bits(rx.target.state) == _bits(states[1])  # type: ignore[attr-defined]


def test_decodings_for_other_bits_or_versions_are_not_taken(published, tmp_path) -> None:
    store, states = published
    cache = tmp_path / "cache"
    _relay(store, cache, 1)
    _relay(store, cache, 2)
    rx = _receiver(store, states)
    assert not rx.decode_early(0, cache)  # nothing older than what it holds: nothing started
    assert rx.decode_early(2, cache)  # a delta from v0 to v2 never comes (v2's is from v1)
    rx.sync(1)  # an apply stops it: it read the bits the apply changed
    assert rx._early is None and rx.early_used == 0
    assert rx.decode_early(2, cache)
    _wait_decoded(rx, 1)
    rx.sync(2)
    assert rx.early_used > 0 and _bits(rx.target.state) == _bits(states[2])  # type: ignore[attr-defined]


def test_a_memo_is_only_for_its_held_root_table_and_check() -> None:
    from weighthub.targets.base import Held
    from weighthub.tensors import TensorSpec, dtype_named

    specs = [TensorSpec("a", dtype_named("BF16"), (4,))]
    memo = EarlyChunks("r" * 64, specs, incremental=True)
    held = Held("s", "m", 3, "r" * 64)
    assert memo.fits(held, specs, True)
    assert not memo.fits(None, specs, True)
    assert not memo.fits(Held("s", "m", 3, "x" * 64), specs, True)
    assert not memo.fits(held, [TensorSpec("a", dtype_named("BF16"), (2, 2))], True)
    assert not memo.fits(held, specs, False)
    assert memo.get(chunk_checksum(b"x")) is None and memo.used == 0


def test_stopping_without_staging_leaves_nothing_running(published, tmp_path) -> None:
    store, states = published
    rx = _receiver(store, states)
    assert rx.decode_early(1, tmp_path / "never-created")
    decoder = rx._early
    assert decoder is not None
    rx.apply(rx.stage(1))  # staged from the store: the directory never appeared
    assert rx.early_used == 0 and not decoder._thread.is_alive()
    shutil.rmtree(tmp_path / "never-created", ignore_errors=True)


def test_a_decoder_whose_version_never_comes_stops_by_itself(published, tmp_path) -> None:
    from weighthub.receive.early import EarlyDecoder

    store, states = published
    rx = _receiver(store, states)
    held = rx.target.held()
    assert held is not None
    decoder = EarlyDecoder(tmp_path / "cache", 1, held, [], rx.target.peek(), incremental=True,
                           lifetime_s=0.05)
    decoder._thread.join(timeout=5)
    assert not decoder._thread.is_alive() and len(decoder.stop()) == 0
