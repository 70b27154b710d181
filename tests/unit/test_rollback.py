"""Rolling back through inverse deltas: the codec's inverse apply, the planner's backward routes,
and the receiver's inverse transaction (bound to the held version, verified against the older
version's digests, rolled back exactly to the held one on any failure).

Bits are compared through unsigned integer views and digests only, never float tolerance.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import weighthub.receive.apply as apply_mod
from reference_codec import make_pair, ref_segment, u8
from weighthub import catalog
from weighthub.codec import (
    EncodePolicy,
    Op,
    Positions,
    Segment,
    UndoLog,
    Values,
    apply_segment,
    coding_invertible,
    encode_segment,
    kernels,
)
from weighthub.codec.segment import gap_positions
from weighthub.digest import digest_add, digest_affine, digest_sub, lanes_digest
from weighthub.errors import ApplyError, BaseMismatch, ChecksumError, FormatError, IntegrityError
from weighthub.format import Manifest, TensorEntry, encode_manifest
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import LocalStore, MemoryStore, Store
from weighthub.targets import SafetensorsTarget, StateDictTarget, load_checkpoint
from weighthub.tensors import DTYPES, DType, bits

SPAN = 16 << 10  # small chunks: several chunks and segments per version

# --- codec: inverse apply, property-tested --------------------------------------------------


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a, b)


INVERTIBLE = [(Op.XOR, Values.VARINT), (Op.XOR, Values.RAW), (Op.ADD, Values.ZIGZAG),
              (Op.ADD, Values.RAW)]


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3000),
       density=st.sampled_from([0.0, 1e-3, 0.05, 0.5, 1.0]),
       positions=st.sampled_from([Positions.GAPS, Positions.BITMAP]),
       coding=st.sampled_from(INVERTIBLE), start=st.integers(0, 1000))
def test_inverse_apply_restores_the_old_bits_and_digest(dtype: DType, seed: int, n: int,
                                                        density: float, positions: Positions,
                                                        coding: tuple[Op, Values],
                                                        start: int) -> None:
    old, new = make_pair(dtype, seed, n, density)
    seg = ref_segment(old, new, dtype, positions, coding[1], start, op=coding[0])
    assert seg.invertible
    fwd = old.copy()
    apply_segment(seg, fwd, dtype, UndoLog(), "fwd")
    assert same(fwd, new)
    dst = new.copy()
    undo = UndoLog()
    dnew, dold = np.zeros(2, np.uint64), np.zeros(2, np.uint64)
    apply_segment(seg, dst, dtype, undo, "inv", dnew=dnew, dold=dold, inverse=True)
    assert same(dst, old)
    # the digest change folded in while undoing leads from new's digest to old's (spec §4)
    change = digest_sub(lanes_digest(dnew), lanes_digest(dold))
    assert digest_add(digest_affine(new, start, (1,)), change) == digest_affine(old, start, (1,))
    undo.rollback()  # rolling back the inverse apply gives the new bits again, exactly
    assert same(dst, new)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.name in ("BF16", "F32", "I64", "F8_E5M2")],
                         ids=lambda d: d.name)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 2000))
def test_inverse_chain_of_encoded_deltas(dtype: DType, seed: int, n: int) -> None:
    """Deltas the encoder chose (xor or add, never grouped) undo newest first to the start."""
    v0, v1 = make_pair(dtype, seed, n, 0.05)
    _, v2 = make_pair(dtype, seed + 1, n, 0.05)
    v2 = np.where(np.random.default_rng(seed).random(n) < 0.05, v2, v1).astype(dtype.uint)
    policy = EncodePolicy(groups=False)
    segs = [encode_segment(a, b, dtype, tensor=0, start=0, policy=policy)
            for a, b in ((v0, v1), (v1, v2))]
    dst = v2.copy()
    for seg in reversed(segs):
        if seg is not None and seg.invertible:
            apply_segment(seg, dst, dtype, UndoLog(), "chain", inverse=True)
        elif seg is not None:  # overwrite or dense: not undoable from the new bits
            return
    assert same(dst, v0)


@pytest.mark.parametrize("op, positions, values", [
    (Op.OVERWRITE, Positions.GAPS, Values.RAW), (Op.XOR, Positions.GROUPS, Values.VARINT),
    (Op.ADD, Positions.GROUPS, Values.ZIGZAG), (Op.DENSE, Positions.ALL, Values.RAW)])
def test_non_invertible_segments_are_refused_untouched(op: Op, positions: Positions,
                                                       values: Values) -> None:
    dtype = next(d for d in DTYPES if d.name == "BF16")
    dst = np.arange(64, dtype=np.uint16)
    seg = Segment(0, 0, 64, op, positions, values, 1, u8(b"\x05"), u8(b"\x01\x00" * 64))
    assert not seg.invertible
    undo = UndoLog()
    with pytest.raises(FormatError, match="cannot be applied inversely"):
        apply_segment(seg, dst, dtype, undo, "inv", inverse=True)
    assert same(dst, np.arange(64, dtype=np.uint16)) and not undo.entries


# --- planner: which deltas invert -------------------------------------------------------------


def _manifest(tensors: list[TensorEntry], base: int | None = 0) -> Manifest:
    return Manifest(format=2, kind="weighthub.manifest", model="0" * 32, version=1, base=base,
                    base_root=None if base is None else "1" * 32, root="2" * 32, tensors=tensors,
                    chunks=[], dense_bytes=0, payload_bytes=0, changed=0)


def _entry(name: str, changed: int, ops: list[str]) -> TensorEntry:
    return TensorEntry(name, "BF16", [4], "3" * 32, changed, ops)


@pytest.mark.parametrize("entries, ok", [
    ([("a", 3, ["xor/gaps/varint"]), ("b", 2, ["add/bitmap/zigzag", "add/gaps/zigzag"])], True),
    ([("a", 3, ["xor/gaps/varint"]), ("b", 0, [])], True),  # b has no segments
    ([("a", 3, ["xor/gaps/varint", "overwrite/gaps/raw"])], False),
    ([("a", 4, ["dense/all/raw"])], False),
    ([("a", 3, ["xor/groups/varint"])], False),  # grouped positions need the base's bits
    ([("a", 3, [])], False),  # changed, ops not recorded: taken as not invertible
    ([("a", 3, ["rot13/gaps/varint"])], False),
    ([("a", 3, ["xor"])], False),
])
def test_invertible_is_read_from_the_manifests_ops(entries, ok: bool) -> None:
    assert catalog.invertible(_manifest([_entry(*e) for e in entries])) is ok


def test_a_full_representation_is_not_invertible() -> None:
    assert not catalog.invertible(_manifest([_entry("a", 4, ["dense/all/raw"])], base=None))


# --- end to end ---------------------------------------------------------------------------------


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 160, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(20_000, generator=g),  # f32
        "step_counts": torch.randint(-(2**40), 2**40, (3000,), generator=g),  # i64
        "special": torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")] * 20),
    }


def step(state: dict[str, torch.Tensor], seed: int, frac: float = 0.02) -> dict[str, torch.Tensor]:
    """A new state: a few percent of words move ±1 ulp (wrapping), signs of large float tensors
    flip (±0, NaN payloads). Coded as add or xor everywhere (a sign flip in a tensor with only
    a couple of changes would be coded as overwrite: a raw word is smaller than its difference)."""
    rng = np.random.default_rng(seed)
    out = {n: t.clone() for n, t in state.items()}
    for t in out.values():
        b = bits(t)
        idx = rng.choice(b.size, max(1, int(frac * b.size)), replace=False)
        one = b.dtype.type(1)
        b[idx[::2]] += one
        b[idx[1::2]] -= one
        if t.is_floating_point() and b.size > 1000:
            b[idx[:3]] ^= b.dtype.type(1 << (8 * b.itemsize - 1))
    return out


def snapshot(state) -> dict[str, np.ndarray]:
    return {n: t.copy() if isinstance(t, np.ndarray) else bits(t).copy() for n, t in dict(state).items()}


def same_bits(a, b) -> bool:
    sa, sb = snapshot(a), snapshot(b)
    return sa.keys() == sb.keys() and all(same(sa[n], sb[n]) for n in sa)


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path) -> Store:
    return MemoryStore("rollback") if request.param == "memory" else LocalStore(tmp_path / "store")


def publish_chain(store: Store, n: int, *, overwrite_at: tuple[int, ...] = (), **kw
                  ) -> tuple[Publisher, list[dict[str, torch.Tensor]]]:
    """Versions 0..n-1; those in `overwrite_at` coded with overwrite only (not invertible)."""
    kw.setdefault("delta_span_bytes", SPAN)
    kw.setdefault("full_span_bytes", SPAN)
    pub = Publisher(store, **kw)
    states = [make_state()]
    pub.publish(states[0])
    for v in range(1, n):
        states.append(step(states[-1], v))
        # ctx off: inverse deltas need codings a holder of the new words can decode, and the
        # default context coding ranks changes by the old exponents (as `groups` does)
        pub.policy = EncodePolicy(mask_ops=v not in overwrite_at, ctx=False)
        assert pub.publish(states[-1]).version == v
        ops = {o for t in catalog.primary_manifest(store, v).tensors for o in t.ops}
        assert any(not coding_invertible(o) for o in ops) == (v in overwrite_at), ops
    return pub, states


def inverse_route(*versions: int) -> tuple[str, ...]:
    return tuple(catalog.rep_key(v, v - 1, primary=True) + catalog.INVERSE for v in versions)


def payload(store: Store, v: int, *, full: bool = False) -> int:
    return next(r.payload_bytes for r in catalog.representations(store, v)
                if (r.base is None) == full)


def at(store: Store, version: int, **kw) -> tuple[StateDictTarget, Receiver]:
    target = StateDictTarget({})
    rx = Receiver(store, target, **kw)
    rx.sync(version)
    return target, rx


class CountingStore:
    """A store that counts the chunk bytes read through it."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.chunk_bytes = 0

    def get(self, key: str, *, timeout: float | None = None, max_bytes: int | None = None) -> bytes:
        data = self.inner.get(key, timeout=timeout, max_bytes=max_bytes)
        if key.endswith(".whc"):
            self.chunk_bytes += len(data)
        return data

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.mark.parametrize("options", [{}, {"verify": "full"}, {"verify_base": True}],
                         ids=["incremental", "full", "verify_base"])
def test_rollback_through_inverse_deltas_is_bit_exact(store: Store, options: dict) -> None:
    _pub, states = publish_chain(store, 5)
    counting = CountingStore(store)
    target = StateDictTarget({})
    rx = Receiver(counting, target, **options)  # type: ignore[arg-type]
    rx.sync(4)
    counting.chunk_bytes = 0
    out = rx.sync(1)
    assert out.route == inverse_route(4, 3, 2) and out.backward
    assert (out.version, out.from_version) == (1, 4)
    # only the deltas cross the wire, fewer bytes than the anchor and the delta after it
    deltas = sum(payload(store, v) for v in (2, 3, 4))
    assert counting.chunk_bytes == out.bytes_fetched == deltas
    assert deltas < payload(store, 0, full=True) + payload(store, 1)
    fresh, _ = at(store, 1)
    assert same_bits(target.state, states[1]) and same_bits(target.state, fresh.state)
    assert target.held() == fresh.held() and rx.version == 1
    # and forward again, from the rolled-back bits (their digests are the receiver's cache)
    out = rx.sync(4)
    assert not out.backward and same_bits(target.state, states[4])
    assert rx.sync(3).route == inverse_route(4)
    assert same_bits(target.state, states[3])


def test_stage_then_apply_a_backward_route(store: Store) -> None:
    _pub, states = publish_chain(store, 4)
    target, rx = at(store, 3)
    staged = rx.stage(1)
    assert staged.backward and staged.route == inverse_route(3, 2)
    assert same_bits(target.state, states[3])  # staging touched nothing
    assert rx.apply(staged).route == staged.route
    assert same_bits(target.state, states[1])


def test_safetensors_target_rolls_back_like_pull_version(tmp_path) -> None:
    store = LocalStore(tmp_path / "store")
    _pub, states = publish_chain(store, 4)
    target = SafetensorsTarget(tmp_path / "out" / "model.safetensors")
    rx = Receiver(store, target, verify_base=True)  # as `weighthub pull` runs it
    rx.sync(3)
    out = rx.sync(0)
    assert out.route == inverse_route(3, 2, 1)
    assert same_bits(target.peek(), states[0])
    held = target.held()
    assert held is not None and held.version == 0


@given(st.lists(st.integers(0, 1 << 20), max_size=300, unique=True))
def test_journal_plan_decodes_gap_positions_like_the_kernels(raw: list[int]) -> None:
    pos = np.array(sorted(raw), np.int64)
    buf = np.zeros(10 * pos.size + 1, np.uint8)
    used = kernels.encode_gaps(pos, pos.size, buf)
    got = gap_positions(buf[:used], pos.size, (1 << 20) + 1)
    assert got is not None and np.array_equal(got, pos)
    if pos.size:
        assert gap_positions(buf[:used], pos.size, int(pos[-1])) is None  # past the end
        assert gap_positions(buf[: used - 1], pos.size, 1 << 21) is None  # cut short


def test_in_place_steps_journal_what_they_change_and_a_failure_restores_the_old_version(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before each step an in-place file target journals the old words of the places the step
    may write (decoded from its chunks: O(changed), not the file), and a step that fails
    half-way is rolled back: the file is at the old version, bit-exact, claimed as such."""
    import weighthub.receive.apply as apply_module
    import weighthub.targets.safetensors_file as sf

    store = LocalStore(tmp_path / "store")
    _pub, states = publish_chain(store, 3)
    out = tmp_path / "model.safetensors"
    rx = Receiver(store, SafetensorsTarget(out), verify_base=True)
    rx.sync(0)
    journaled: list[int] = []
    append = sf.append_batch

    def journal(path, header, records=()):
        records = list(records)
        journaled.append(sum(r.old.nbytes + (0 if r.positions is None else r.positions.nbytes)
                             for r in records))
        append(path, header, records)

    monkeypatch.setattr(sf, "append_batch", journal)
    rx.sync(1)
    assert len(journaled) == 1 and 0 < journaled[0] < out.stat().st_size / 4
    assert same_bits(load_checkpoint(out), states[1])

    applied = 0
    whole = apply_module.apply_segment

    def fails_half_way(*a, **k):
        nonlocal applied
        applied += 1
        if applied > 3:
            raise OSError(5, "Input/output error", str(out))
        return whole(*a, **k)

    monkeypatch.setattr(apply_module, "apply_segment", fails_half_way)
    with pytest.raises(ApplyError, match=r"Input/output error.*rolled back to its previous version"):
        rx.sync(2)
    assert rx.target.held().version == 1 and same_bits(load_checkpoint(out), states[1])
    assert not (tmp_path / ".model.safetensors.weighthub-journal").exists()


def test_an_overwrite_delta_is_not_undone_the_route_falls_back(store: Store) -> None:
    _pub, states = publish_chain(store, 5, overwrite_at=(3,))
    assert not any(r.invertible for r in catalog.representations(store, 3))
    target, rx = at(store, 4)
    # 4 → 3 undoes v4; 3 → 2 would need v3's overwrite undone: anchor + delta instead
    out = rx.sync(1)
    assert not out.backward
    assert out.route == (catalog.rep_key(0, None, primary=True), catalog.rep_key(1, 0, primary=True))
    assert same_bits(target.state, states[1])
    rx.sync(4)
    assert rx.sync(3).route == inverse_route(4)
    assert same_bits(target.state, states[3])


def test_a_context_coded_delta_is_not_undone_the_route_falls_back(store: Store) -> None:
    """The default `compact` profile codes float deltas with ans, which is not invertible: a
    receiver going back takes an anchor and deltas forward, bit-exactly."""
    pub = Publisher(store, delta_span_bytes=SPAN, full_span_bytes=SPAN)
    states = [make_state()]
    pub.publish(states[0])
    for v in range(1, 3):
        states.append(step(states[-1], v, frac=0.05))
        pub.publish(states[-1])
    ops = {o for t in catalog.primary_manifest(store, 2).tensors for o in t.ops}
    assert any(o.endswith("/ans/ans") for o in ops), ops
    assert not any(r.invertible for r in catalog.representations(store, 2))
    target, rx = at(store, 2)
    out = rx.sync(1)
    assert not out.backward
    assert out.route == (catalog.rep_key(0, None, primary=True), catalog.rep_key(1, 0, primary=True))
    assert same_bits(target.state, states[1])


def test_an_anchor_then_an_inverse_delta(store: Store) -> None:
    """From 5 (its delta not invertible) to 3: v4's anchor, then v4's delta undone, in one
    transaction: fewer bytes than v0's anchor and three deltas forward."""
    _pub, states = publish_chain(store, 6, anchor_every=4, overwrite_at=(5,))
    target, rx = at(store, 5)
    out = rx.sync(3)
    assert out.route == (catalog.rep_key(4, None, primary=False), *inverse_route(4))
    assert same_bits(target.state, states[3]) and rx.version == 3


def test_anchor_wins_when_it_is_fewer_bytes(store: Store) -> None:
    _pub, states = publish_chain(store, 5, anchor_every=2)  # v2 and v4 also have full.json
    target, rx = at(store, 4)
    full2 = payload(store, 2, full=True)
    assert payload(store, 4) + payload(store, 3) < full2
    assert rx.sync(2).route == inverse_route(4, 3)
    assert same_bits(target.state, states[2])
    # make the deltas look costlier than the anchor: the planner takes the anchor
    rx.sync(4)
    for v in (3, 4):
        _rewrite(store, v, payload_bytes=full2)
    out = rx.sync(2)
    assert out.route == (catalog.rep_key(2, None, primary=False),) and not out.backward
    assert same_bits(target.state, states[2])
    # at equal bytes the forward route wins
    rx.sync(4)
    _rewrite(store, 4, payload_bytes=full2 // 2)
    _rewrite(store, 3, payload_bytes=full2 - full2 // 2)
    assert catalog.plan(store, 4, 2) == [r for r in catalog.representations(store, 2)
                                        if r.base is None]
    _rewrite(store, 3, payload_bytes=full2 - full2 // 2 - 1)
    assert [r.label for r in catalog.plan(store, 4, 2)] == list(inverse_route(4, 3))


def test_manifest_without_ops_is_not_inverted(store: Store) -> None:
    _pub, states = publish_chain(store, 4)
    m = catalog.primary_manifest(store, 2)
    _rewrite(store, 2, tensors=[msgspec.structs.replace(t, ops=[]) for t in m.tensors])
    target, rx = at(store, 3)
    out = rx.sync(1)
    assert not out.backward and same_bits(target.state, states[1])


# --- transactional failures of a backward route --------------------------------------------


def _rewrite(store: Store, v: int, **fields) -> None:
    m = catalog.primary_manifest(store, v)
    store.put(catalog.rep_key(v, m.base, primary=True), encode_manifest(msgspec.structs.replace(m, **fields)))


@pytest.fixture
def at_v3(store: Store):
    """Versions 0..3 committed; a receiver holding v3 that will roll back to v1."""
    _pub, states = publish_chain(store, 4)
    target, rx = at(store, 3)
    assert catalog.plan(store, 3, 1) and all(r.inverse for r in catalog.plan(store, 3, 1))
    return store, states, target, rx


def _unchanged(target: StateDictTarget, rx: Receiver, states) -> None:
    assert rx.version == 3 and same_bits(target.state, states[3])


def test_corrupt_delta_chunk_leaves_the_target_at_its_version(at_v3) -> None:
    store, states, target, rx = at_v3
    key = catalog.primary_manifest(store, 2).chunks[1].key
    blob = bytearray(store.get(key))
    blob[len(blob) // 2] ^= 0x01
    store.put(key, bytes(blob))
    with pytest.raises(ChecksumError, match=key):
        rx.sync(1)
    _unchanged(target, rx, states)


def test_digest_mismatch_after_undoing_rolls_back_to_the_held_version(at_v3) -> None:
    store, states, target, rx = at_v3
    m = catalog.primary_manifest(store, 1)  # the digests the last inverse step must arrive at
    tensors = list(m.tensors)
    tensors[0] = msgspec.structs.replace(tensors[0], digest="0" * 32)
    _rewrite(store, 1, tensors=tensors)
    with pytest.raises(IntegrityError, match=tensors[0].name):
        rx.sync(1)
    _unchanged(target, rx, states)


@pytest.mark.parametrize("fail_after", [0, 7, 20])  # 14 segments a version
def test_exception_midway_through_undoing(at_v3, monkeypatch: pytest.MonkeyPatch,
                                          fail_after: int) -> None:
    _store, states, target, rx = at_v3
    real = apply_mod.apply_segment
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        assert kwargs["inverse"]
        if calls["n"] >= fail_after:
            raise RuntimeError("device lost")
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(apply_mod, "apply_segment", flaky)
    with pytest.raises(ApplyError, match="rolled back"):
        rx.sync(1)
    assert calls["n"] == fail_after
    _unchanged(target, rx, states)
    monkeypatch.setattr(apply_mod, "apply_segment", real)
    rx.sync(1)
    assert same_bits(target.state, states[1])


def test_held_root_must_be_the_deltas_version(at_v3) -> None:
    store, states, target, rx = at_v3
    _rewrite(store, 3, root="e" * 32)  # the store now says v3 is other bits than those held
    with pytest.raises(BaseMismatch, match="applied inversely"):
        rx.sync(1)
    _unchanged(target, rx, states)


def test_base_manifest_disagreeing_with_the_delta_is_refused(at_v3) -> None:
    store, states, target, rx = at_v3
    _rewrite(store, 1, root="e" * 32)  # v2's delta names another root for its base
    with pytest.raises(BaseMismatch, match="inconsistent"):
        rx.sync(1)
    _unchanged(target, rx, states)


def test_manifest_misstating_its_ops_is_refused_before_anything_is_applied(store: Store) -> None:
    _pub, states = publish_chain(store, 4, overwrite_at=(2,))
    m = catalog.primary_manifest(store, 2)
    _rewrite(store, 2, tensors=[msgspec.structs.replace(t, ops=["xor/gaps/varint"] if t.changed else [])
                                for t in m.tensors])
    target, rx = at(store, 3)
    assert [r.label for r in catalog.plan(store, 3, 1)] == list(inverse_route(3, 2))
    with pytest.raises(FormatError, match="cannot be applied inversely"):
        rx.sync(1)
    _unchanged(target, rx, states)
