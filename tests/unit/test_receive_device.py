"""The receiver's device backend (receive/device.py), run on CPU tensors through the same torch
code a CUDA target runs (targets made with backend="torch"): every coding decoded on the host
and applied on the "device", chains, rollback through inverse deltas, full versions
materialized, mixed host/device models, and every failure leaving the exact bits of before.
The `gpu`-marked tests at the end run the same on a CUDA device where one exists.
"""

from __future__ import annotations

from dataclasses import replace

import msgspec
import numpy as np
import pytest
import torch
from test_receiver import SPAN, Tiny, _train_step, make_state, publish_chain, same_bits, snapshot, step
from test_rollback import publish_chain as rollback_chain

import weighthub.receive.apply as apply_mod
import weighthub.receive.device as device_mod
from weighthub import catalog
from weighthub.digest import digest_sub, lanes_digest
from weighthub.errors import ApplyError, BaseMismatch, ChecksumError, FormatError, IntegrityError
from weighthub.format import encode_manifest
from weighthub.publish import ENCODE_PROFILES, Publisher
from weighthub.receive import Receiver
from weighthub.store import MemoryStore, Store
from weighthub.targets import ModuleTarget, StateDictTarget
from weighthub.targets.base import views_of
from weighthub.tensors import bits


@pytest.fixture
def store() -> Store:
    return MemoryStore("device")


def _codings(store: Store, upto: int) -> set[str]:
    return {o for v in range(1, upto + 1)
            for t in catalog.primary_manifest(store, v).tensors for o in t.ops}


def _training(n: int) -> list[dict[str, torch.Tensor]]:
    """bf16 casts of fp32 masters taking small random steps, as a trainer publishes them: a
    word's chance to change depends on its exponent (what `groups` and `ctx` exploit), plus
    the awkward tensors of test_receiver's state."""
    g = torch.Generator().manual_seed(3)
    master = torch.randn(300_000, generator=g) * 0.02
    odd = make_state()
    out = []
    for v in range(n):
        if v:
            master += 2e-4 * torch.randn(master.shape, generator=g)
            odd = step(odd, v)
        out.append({"w": master.to(torch.bfloat16), **odd})
    return out


POLICIES = {**ENCODE_PROFILES, "compact-range": replace(ENCODE_PROFILES["compact"], coder="range")}


@pytest.mark.parametrize("profile", sorted(POLICIES))
def test_every_coding_applies_bit_exact_on_the_device_path(store: Store, profile: str) -> None:
    """ans (compact), ctx (compact with the range coder), exponent groups (grouped), gaps and
    bitmaps (fast, and dense-ish steps), overwrite and dense segments: the torch target ends
    with the trainer's bits every version, and its incremental digests are those of the host
    path."""
    pub = Publisher(store, policy=POLICIES[profile], delta_span_bytes=1 << 20)
    states = _training(5)
    states.append(step(states[-1], 9, frac=0.4))  # dense-ish: bitmaps, overwrites
    for state in states:
        pub.publish(state)
    device_target, host_target = StateDictTarget({}, backend="torch"), StateDictTarget({})
    on_device, on_host = Receiver(store, device_target), Receiver(store, host_target)
    for v in range(len(states)):
        on_device.sync(v)
        on_host.sync(v)
        assert same_bits(device_target.state, states[v]), v
        assert on_device._committed == on_host._committed, v  # (root, tensor digests)
    want = {"compact": "/ans/", "compact-range": "/ctx/", "grouped": "/groups/",
            "fast": "/bitmap/"}[profile]
    assert any(want in c for c in _codings(store, len(states) - 1)), _codings(store, 5)


def test_the_device_path_really_applies_in_torch(store: Store, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    """The torch target goes through receive/device.py, never the host kernels."""
    publish_chain(store, 3)
    host_calls: list[str] = []
    real = apply_mod.apply_segment
    monkeypatch.setattr(apply_mod, "apply_segment",
                        lambda *a, **k: host_calls.append("host") or real(*a, **k))
    device_calls: list[int] = []
    real_device = device_mod.apply_segment
    monkeypatch.setattr(device_mod, "apply_segment",
                        lambda d, *a, **k: device_calls.append(d.tensor) or real_device(d, *a, **k))
    Receiver(store, StateDictTarget({}, backend="torch")).sync(2)
    assert device_calls and not host_calls


def test_a_chain_decodes_later_steps_against_the_words_of_the_step_before(store: Store) -> None:
    """Only the route's first delta is decoded while staging; a chain's later ctx deltas are
    placed against the words the earlier ones just wrote (anchors off: a chain is the route)."""
    _pub, states = publish_chain(store, 5, anchor_every=0)
    target = StateDictTarget({}, backend="torch")
    rx = Receiver(store, target)
    rx.sync(0)
    out = rx.sync(4)
    assert len(out.route) == 4 and same_bits(target.state, states[4])


def test_rollback_through_inverse_deltas_on_the_device(store: Store) -> None:
    _pub, states = rollback_chain(store, 4)
    target = StateDictTarget({}, backend="torch")
    rx = Receiver(store, target)
    rx.sync(3)
    out = rx.sync(1)
    assert out.backward and same_bits(target.state, states[1])


def test_module_with_tied_weights_on_the_device_path(store: Store) -> None:
    torch.manual_seed(0)
    trainer, model = Tiny(), Tiny()
    pub = Publisher(store, delta_span_bytes=SPAN, full_span_bytes=SPAN, backend="torch")
    rx = Receiver(store, ModuleTarget(model, backend="torch"))
    for v in range(4):
        if v:
            _train_step(trainer, v)
        pub.publish(trainer.state_dict())
        rx.sync()
        assert same_bits(model.state_dict(), trainer.state_dict()), v
    assert model.head.weight is model.emb.weight


class _Mixed(StateDictTarget):
    """A model with some tensors "on the device" (torch words) and the rest on the host."""

    def _views(self) -> dict:
        views = views_of(self.state, "auto")
        for name in sorted(self.state)[::2]:
            views[name] = views_of({name: self.state[name]}, "torch")[name]
        return views

    def peek(self) -> dict:
        return self._views()

    def open(self, specs):
        super().open(specs)
        return self._views()


def test_a_model_mixing_host_and_device_tensors(store: Store) -> None:
    _pub, states = publish_chain(store, 4)
    target = _Mixed({})
    rx = Receiver(store, target)
    for v in range(4):
        rx.sync(v)
        assert same_bits(target.state, states[v]), v
    kinds = {type(v).__name__ for v in target.peek().values()}
    assert kinds == {"ndarray", "Tensor"}


@pytest.mark.parametrize("mode", ["full", "base"])
def test_full_verification_and_verify_base_digest_on_the_device(store: Store, mode: str) -> None:
    """verify="full" and verify_base re-digest the target's words where they live."""
    _pub, states = publish_chain(store, 3)
    target = StateDictTarget({}, backend="torch")
    kw = {"verify": "full"} if mode == "full" else {"verify_base": True}
    rx = Receiver(store, target, **kw)
    for v in range(3):
        rx.sync(v)
        assert same_bits(target.state, states[v]), v


# --- every failure leaves the exact bits of before ---------------------------------------------


@pytest.fixture
def at_v1(store: Store):
    _pub, states = publish_chain(store, 3)
    target = StateDictTarget({}, backend="torch")
    rx = Receiver(store, target)
    rx.sync(1)
    return store, states, target, rx


def _unchanged(target: StateDictTarget, rx: Receiver, states, version: int = 1) -> None:
    assert rx.version == version
    assert same_bits(target.state, states[version])


@pytest.mark.parametrize("fail_after", [0, 1, 7])
def test_a_device_error_midway_through_the_apply_rolls_back(at_v1, monkeypatch: pytest.MonkeyPatch,
                                                            fail_after: int) -> None:
    """A CUDA error or out-of-memory raised by the device op after some segments were written."""
    _store, states, target, rx = at_v1
    real = device_mod.D.combine
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        if calls["n"] >= fail_after:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(device_mod.D, "combine", flaky)
    with pytest.raises(ApplyError, match="rolled back") as info:
        rx.sync(2)
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)
    assert calls["n"] == fail_after
    _unchanged(target, rx, states)
    monkeypatch.setattr(device_mod.D, "combine", real)
    rx.sync(2)
    _unchanged(target, rx, states, 2)


def test_a_corrupt_chunk_is_refused_before_the_device_is_touched(at_v1) -> None:
    store, states, target, rx = at_v1
    key = catalog.primary_manifest(store, 2).chunks[0].key
    raw = bytearray(store.get(key))
    raw[len(raw) // 2] ^= 0x40
    store.put(key, bytes(raw))
    with pytest.raises(ChecksumError):
        rx.sync(2)
    _unchanged(target, rx, states)


def test_a_wrong_word_written_on_the_device_is_an_integrity_error(at_v1,
                                                                  monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """The digest is folded from the words the device computed: one value off is caught."""
    _store, states, target, rx = at_v1
    real = device_mod.D.combine
    hits = {"n": 0}

    def off_by_one(old, z, op, width_bits):
        out = real(old, z, op, width_bits)
        if hits["n"] == 0 and out.numel():
            hits["n"] += 1
            out = out.clone()
            out[0] ^= 1
        return out

    monkeypatch.setattr(device_mod.D, "combine", off_by_one)
    with pytest.raises(IntegrityError, match="differ from the manifest's digests"):
        rx.sync(2)
    _unchanged(target, rx, states)


def test_a_base_edited_outside_weighthub_never_commits(at_v1) -> None:
    """ctx positions are placed against the held words: edited ones place them wrongly (or
    out of range); the digests refuse the result and the edited bits stay as they were."""
    _store, _states, target, rx = at_v1
    for t in target.state.values():
        b = bits(t)
        b[: max(1, b.size // 3)] ^= b.dtype.type(1 << (8 * b.itemsize - 2))  # exponents move
    edited = snapshot(target.state)
    with pytest.raises((IntegrityError, FormatError)):
        rx.sync(2)
    assert same_bits(target.state, edited) and rx.version == 1
    # decoded against the edited words while staging (as on the host): refused there, or by
    # verify_base's check of the held root in the pause
    with pytest.raises((BaseMismatch, FormatError)):
        Receiver(rx.store, target, verify_base=True).sync(2)
    assert same_bits(target.state, edited)


def test_a_delta_whose_base_is_not_the_targets_is_refused(at_v1) -> None:
    store, states, target, rx = at_v1
    m = catalog.primary_manifest(store, 2)
    store.put(catalog.rep_key(2, 1, primary=True),
              encode_manifest(msgspec.structs.replace(m, base_root="e" * 32)))
    with pytest.raises(BaseMismatch, match="refusing to apply"):
        rx.sync(2)
    _unchanged(target, rx, states)


def test_a_hostile_rank_past_its_group_is_refused(at_v1, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ctx stream whose ranks run past the base's group (place_ranks finds no such element)."""
    _store, states, target, rx = at_v1
    real = device_mod.D.place_ranks
    monkeypatch.setattr(device_mod.D, "place_ranks", lambda *a, **k: None)
    with pytest.raises(FormatError, match="group rank is past"):
        rx.sync(2)
    monkeypatch.setattr(device_mod.D, "place_ranks", real)
    _unchanged(target, rx, states)


def test_a_failed_first_sync_leaves_an_empty_target_empty(store: Store) -> None:
    _pub, _states = publish_chain(store, 1)
    key = catalog.primary_manifest(store, 0).chunks[-1].key
    raw = bytearray(store.get(key))
    raw[-20] ^= 1
    store.put(key, bytes(raw))
    target = StateDictTarget({}, backend="torch")
    with pytest.raises(ChecksumError):
        Receiver(store, target).sync(0)
    assert target.state == {} and target.held() is None


def test_decode_refuses_what_the_host_refuses(store: Store) -> None:
    """Hostile streams through the device decoder: the same FormatErrors as the host kernels."""
    from weighthub.codec import Op, Positions, Segment, Values
    from weighthub.tensors import DTYPE_BY_NAME

    bf16 = DTYPE_BY_NAME["BF16"]
    base = torch.zeros(100, dtype=torch.int16)
    cases = {
        "past the range": Segment(0, 0, 100, Op.XOR, Positions.GAPS, Values.VARINT, 1,
                                  np.array([120], np.uint8), np.array([1], np.uint8)),
        "trailing": Segment(0, 0, 100, Op.XOR, Positions.GAPS, Values.VARINT, 1,
                            np.array([3, 4], np.uint8), np.array([1], np.uint8)),
        "overrun": Segment(0, 0, 100, Op.XOR, Positions.GAPS, Values.VARINT, 2,
                           np.array([3], np.uint8), np.array([1], np.uint8)),
        "count": Segment(0, 0, 100, Op.XOR, Positions.GAPS, Values.VARINT, 101,
                         np.zeros(101, np.uint8), np.zeros(101, np.uint8)),
        "dense size": Segment(0, 0, 100, Op.DENSE, Positions.ALL, Values.RAW, 100,
                              np.zeros(0, np.uint8), np.zeros(10, np.uint8)),
        "coding": Segment(0, 0, 100, Op.OVERWRITE, Positions.GAPS, Values.VARINT, 1,
                          np.array([3], np.uint8), np.array([1], np.uint8)),
        "ctx garbage": Segment(0, 0, 100, Op.XOR, Positions.CTX, Values.CTX, 3,
                               np.array([0, 255, 255, 255, 255, 1], np.uint8),
                               np.array([0, 1, 2, 3, 4, 5], np.uint8)),
        "ans garbage": Segment(0, 0, 100, Op.XOR, Positions.ANS, Values.ANS, 3,
                               np.array([0, 0, 1, 0, 7, 9, 1, 0, 5, 5], np.uint8),
                               np.array([0, 0, 1, 0, 0, 0, 1, 0], np.uint8)),
    }
    for what, seg in cases.items():
        with pytest.raises(FormatError):
            device_mod.decode_segment(seg, base, bf16, f"case {what}")


# --- on a CUDA device ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("profile", sorted(ENCODE_PROFILES))
def test_publish_and_receive_on_cuda(profile: str) -> None:
    """A trainer state on the GPU, published from the device, synced into a target on the
    device: bit-exact against the same states published by the host path."""
    store, host_store = MemoryStore("cuda"), MemoryStore("host")
    states = [make_state()]
    for v in range(1, 4):
        states.append(step(states[-1], v))
    pub = Publisher(store, policy=ENCODE_PROFILES[profile])
    host_pub = Publisher(host_store, policy=ENCODE_PROFILES[profile], backend="host")
    target = StateDictTarget({}, device="cuda")
    rx = Receiver(store, target)
    for v, state in enumerate(states):
        on_gpu = {n: t.cuda() for n, t in state.items()}
        assert pub.publish(on_gpu).payload_bytes == host_pub.publish(on_gpu).payload_bytes
        rx.sync(v)
        assert all(t.is_cuda for t in target.state.values())
        assert same_bits({n: t.cpu() for n, t in target.state.items()}, state), v


@pytest.mark.parametrize("name", ["F8_E4M3", "BF16", "F32", "F64"])
@pytest.mark.parametrize("op", ["xor", "add", "overwrite"])
def test_wide_values_narrowed_for_the_upload_apply_as_the_host_kernels(name: str, op: str) -> None:
    """Values are uploaded in their low B + 1 bits (int32 for B ≤ 16): any varint a stream may
    carry, 64-bit ones included, still gives the host kernels' words."""
    from weighthub.codec import Op, Positions, Segment, UndoLog, Values, apply_segment
    from weighthub.codec.kernels import encode_gaps, encode_varints
    from weighthub.tensors import DTYPE_BY_NAME

    dtype = DTYPE_BY_NAME[name]
    rng = np.random.default_rng(7)
    n, count = 5000, 700
    base = rng.integers(0, 1 << 62, n, dtype=np.uint64).astype(dtype.uint)
    pos = np.sort(rng.choice(n, count, replace=False)).astype(np.int64)
    z = rng.integers(0, 1 << 63, count, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    gaps, vals = np.empty(10 * count + 16, np.uint8), np.empty(10 * count + 16, np.uint8)
    glen, vlen = encode_gaps(pos, count, gaps), encode_varints(z, count, vals)
    coding = {"xor": (Op.XOR, Values.VARINT), "add": (Op.ADD, Values.ZIGZAG)}
    if op == "overwrite":  # raw words: the width's bytes each
        seg = Segment(0, 0, n, Op.OVERWRITE, Positions.GAPS, Values.RAW, count, gaps[:glen],
                      (z.astype(dtype.uint)).view(np.uint8))
    else:
        seg = Segment(0, 0, n, coding[op][0], Positions.GAPS, coding[op][1], count, gaps[:glen],
                      vals[:vlen])
    host = base.copy()
    dnew, dold = np.zeros(2, np.uint64), np.zeros(2, np.uint64)
    apply_segment(seg, host, dtype, UndoLog(), "host", dnew=dnew, dold=dold)
    words = torch.from_numpy(base.view({1: "u1", 2: "i2", 4: "i4", 8: "i8"}[dtype.width]).copy())
    dseg = device_mod.decode_segment(seg, words, dtype, "device", held=True)
    undo = UndoLog()
    lanes = device_mod.apply_segment(dseg, words, dtype, undo, inverse=False, fold=True,
                                     where="device")
    assert np.array_equal(words.numpy().view(dtype.uint), host)
    assert device_mod.lanes_to_digests([lanes]) == [digest_sub(lanes_digest(dnew),
                                                               lanes_digest(dold))]
    undo.rollback()
    assert np.array_equal(words.numpy().view(dtype.uint), base)


def test_torch_views_that_partly_share_memory_are_refused() -> None:
    """The device path folds digests from what it writes, as the host kernels do: views that
    partly overlap are refused before anything is written; exact aliases (tied) pass."""
    from weighthub.errors import PlacementError
    from weighthub.targets.base import unique_views

    buf = torch.zeros(100, dtype=torch.int16)
    ok = {"a": buf[:50], "b": buf[50:], "tied": buf[:50], "host": np.zeros(8, np.uint16)}
    apply_mod.check_disjoint(ok, unique_views(ok))
    bad = {"a": buf[:60], "b": buf[50:]}
    with pytest.raises(PlacementError, match="partly share memory"):
        apply_mod.check_disjoint(bad, unique_views(bad))
    mixed = {"a": buf[:60], "b": buf.numpy()[50:].view(np.uint16)}  # a host view of the same
    with pytest.raises(PlacementError, match="partly share memory"):
        apply_mod.check_disjoint(mixed, unique_views(mixed))
