"""Publisher → store → receiver, end to end on small models: bit-exact, all or nothing.

After every failure the target must hold exactly the bits it held before (compared through
integer views of every tensor) and still report its previous version.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import msgspec
import numpy as np
import pytest
import torch

import weighthub.receive.apply as apply_mod
from weighthub import catalog
from weighthub.codec.prepared import staged_sums
from weighthub.digest import tensor_digest
from weighthub.errors import (
    ApplyError,
    BaseMismatch,
    ChecksumError,
    IntegrityError,
    ModelMismatch,
    NoSyncPath,
    ObjectExists,
    ObjectNotFound,
    PlacementError,
    StoreUnavailable,
    UsageError,
    VersionNotFound,
)
from weighthub.format import encode_manifest
from weighthub.publish import Publisher
from weighthub.receive import Receiver
from weighthub.store import LocalStore, MemoryStore, Store
from weighthub.targets import Held, ModuleTarget, StateDictTarget
from weighthub.targets.base import unique_views
from weighthub.tensors import bits

SPAN = 16 << 10  # small chunks, so one version has several chunks and segments


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 160, generator=g).to(torch.bfloat16),  # 40960
        "layers.0.mlp.weight": torch.randn(160, 160, generator=g).to(torch.bfloat16),  # 25600
        "layers.0.norm.weight": torch.randn(20_000, generator=g),  # f32
        "layers.0.mlp.bias": torch.randn(10_000, generator=g),  # f32
        "step_counts": torch.randint(-(2**40), 2**40, (3000,), generator=g),  # i64
        "special": torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")] * 20),
    }


def step(state: dict[str, torch.Tensor], seed: int, frac: float = 0.02) -> dict[str, torch.Tensor]:
    """A new state: a few percent of words move (mostly ±1 ulp), with odd bit patterns mixed in."""
    rng = np.random.default_rng(seed)
    out = {n: t.clone() for n, t in state.items()}
    for t in out.values():
        b = bits(t)
        idx = rng.choice(b.size, max(1, int(frac * b.size)), replace=False)
        one = b.dtype.type(1)
        b[idx[::2]] += one
        b[idx[1::2]] -= one
        b[idx[:3]] ^= b.dtype.type(1 << (8 * b.itemsize - 1))  # flip signs (±0, NaN payloads)
    return out


def snapshot(state) -> dict[str, np.ndarray]:
    return {n: t.copy() if isinstance(t, np.ndarray) else bits(t).copy() for n, t in dict(state).items()}


def same_bits(a, b) -> bool:
    sa, sb = snapshot(a), snapshot(b)
    return sa.keys() == sb.keys() and all(
        sa[n].dtype == sb[n].dtype and np.array_equal(sa[n], sb[n]) for n in sa)


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path) -> Store:
    return MemoryStore("receiver") if request.param == "memory" else LocalStore(tmp_path / "store")


def publisher(store: Store, **kw) -> Publisher:
    kw.setdefault("delta_span_bytes", SPAN)
    kw.setdefault("full_span_bytes", SPAN)
    return Publisher(store, **kw)


def publish_chain(store: Store, n: int, **kw) -> tuple[Publisher, list[dict[str, torch.Tensor]]]:
    pub = publisher(store, **kw)
    states = [make_state()]
    pub.publish(states[0])
    for v in range(1, n):
        states.append(step(states[-1], v))
        assert pub.publish(states[-1]).version == v
    return pub, states


# --- bit-exact sync --------------------------------------------------------------------------


def test_state_dict_sync_over_versions(store: Store) -> None:
    pub = publisher(store)
    state = make_state()
    target = StateDictTarget({})
    rx = Receiver(store, target)
    assert pub.publish(state).base is None
    rx.sync()
    assert rx.version == 0 and same_bits(target.state, state)
    for v in range(1, 6):
        state = step(state, v)
        res = pub.publish(state)
        assert (res.version, res.base) == (v, v - 1)
        assert 0 < res.changed < res.numel // 10
        if v % 2:  # sync every other version: chains of two deltas too
            continue
        out = rx.sync()
        assert out.version == v and rx.version == v
        assert same_bits(target.state, state)
    rx.sync()
    assert rx.version == 5 and same_bits(target.state, state)
    assert rx.sync().route == ()  # already there


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(300, 64, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(64, 64, dtype=torch.float32)
        self.head = torch.nn.Linear(64, 300, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("counts", torch.arange(500, dtype=torch.int64))


def _train_step(model: Tiny, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            b = bits(t.data)
            idx = rng.choice(b.size, max(1, b.size // 50), replace=False)
            b[idx] += b.dtype.type(1)


def test_module_target_with_tied_weights_and_buffer(store: Store) -> None:
    torch.manual_seed(0)
    trainer = Tiny()
    pub = publisher(store)
    receiver_model = Tiny()
    with torch.no_grad():
        for p in receiver_model.parameters():
            p.zero_()
    rx = Receiver(store, ModuleTarget(receiver_model))
    for v in range(4):
        if v:
            _train_step(trainer, v)
        pub.publish(trainer.state_dict())
        rx.sync()
        assert rx.version == v
        assert same_bits(receiver_model.state_dict(), trainer.state_dict())
        assert receiver_model.head.weight is receiver_model.emb.weight


def test_a_module_target_keeps_its_views_until_a_tensor_is_replaced(store: Store) -> None:
    """A module target keeps its views (and the layout the pause derived from them) while its
    parameters and buffers stay the same, and rebuilds them when one is replaced, as a new
    Parameter, a new buffer or new storage under the same Parameter (`.data`): every sync
    still lands in the tensors the module holds, ties included."""
    torch.manual_seed(0)
    trainer = Tiny()
    pub = publisher(store)
    model = Tiny()
    target = ModuleTarget(model)
    rx = Receiver(store, target)
    replace = [
        lambda: setattr(model.proj, "weight", torch.nn.Parameter(model.proj.weight.clone())),
        lambda: setattr(model, "counts", model.counts.clone()),
        lambda: setattr(model.emb.weight, "data", model.emb.weight.data.clone()),
    ]
    kept = None
    for v in range(2 + 2 * len(replace)):
        if v:
            _train_step(trainer, v)
        pub.publish(trainer.state_dict())
        changed = v >= 2 and v % 2 == 0
        if changed:
            replace[v // 2 - 1]()
        rx.sync()
        assert same_bits(model.state_dict(), trainer.state_dict()), v
        assert model.head.weight is model.emb.weight
        views = target.peek()
        if kept is not None:
            assert (views is not kept) == changed, v
        kept = views
    assert len(kept.layouts) == 1  # the alias map, derived once for the views kept


def test_tied_receiver_detects_untied_trainer() -> None:
    """The receiver applies through one alias of tied weights; the other's digest is still checked."""
    store = MemoryStore("untied")
    pub = publisher(store)
    model = Tiny()
    rx = Receiver(store, ModuleTarget(model))
    state = {n: t.clone() for n, t in model.state_dict().items()}  # untied copies, equal bits
    pub.publish(state)
    rx.sync()
    before = snapshot(model.state_dict())
    state["emb.weight"].view(-1)[:10] += 1  # only one of the two diverges in the trainer
    pub.publish(state)
    with pytest.raises(IntegrityError, match=r"head\.weight"):
        rx.sync()
    assert rx.version == 0 and same_bits(model.state_dict(), before)


def test_catch_up_from_far_behind_uses_skips_and_anchors(store: Store) -> None:
    pub = publisher(store, anchor_every=4, skip_every=2)
    states = [make_state()]
    pub.publish(states[0])
    behind = StateDictTarget({})
    rx_behind = Receiver(store, behind)
    for v in range(1, 10):
        states.append(step(states[-1], v))
        pub.publish(states[-1])
        if v == 2:
            rx_behind.sync()
    assert store.children(catalog.version_dir(8)).count(catalog.FULL) == 1
    assert f"from-{6:012d}.json" in store.children(catalog.version_dir(8))
    out = rx_behind.sync(9)
    assert same_bits(behind.state, states[9])
    assert out.from_version == 2 and len(out.route) < 7
    assert any("from-" in key or key.endswith(catalog.FULL) for key in out.route)
    # a newcomer materializes from the newest anchor and chains forward
    fresh = StateDictTarget({})
    out = Receiver(store, fresh).sync()
    assert out.route == (f"{catalog.version_dir(8)}/{catalog.FULL}",
                         f"{catalog.version_dir(9)}/{catalog.PRIMARY}")
    assert same_bits(fresh.state, states[9])
    # and any older version can be materialized too
    old = StateDictTarget({})
    Receiver(store, old).sync(5)
    assert same_bits(old.state, states[5])
    with pytest.raises(VersionNotFound):
        Receiver(store, StateDictTarget({})).sync(10)


# --- transactional failures ------------------------------------------------------------------


@pytest.fixture
def at_v1(store: Store):
    """Versions 0..2 committed; a state-dict receiver holding v1."""
    pub, states = publish_chain(store, 3)
    target = StateDictTarget({})
    rx = Receiver(store, target)
    rx.sync(1)
    assert same_bits(target.state, states[1])
    return store, pub, states, target, rx


def _assert_unchanged(target: StateDictTarget, rx: Receiver, states, version: int = 1) -> None:
    assert rx.version == version
    assert same_bits(target.state, states[version])


def _chunk_keys(store: Store, v: int) -> list[str]:
    return [c.key for c in catalog.primary_manifest(store, v).chunks]


def _rewrite_manifest(store: Store, v: int, **fields) -> None:
    m = catalog.primary_manifest(store, v)
    key = catalog.rep_key(v, m.base, primary=True)
    store.put(key, encode_manifest(msgspec.structs.replace(m, **fields)))


def test_corrupt_chunk_is_refused(at_v1) -> None:
    store, _pub, states, target, rx = at_v1
    key = _chunk_keys(store, 2)[0]
    blob = bytearray(store.get(key))
    blob[len(blob) // 2] ^= 0x01
    store.put(key, bytes(blob))
    with pytest.raises(ChecksumError, match=key):
        rx.sync(2)
    _assert_unchanged(target, rx, states)
    store.put(key, bytes(blob[:-1]))  # truncated
    with pytest.raises(ChecksumError, match="bytes, manifest says"):
        rx.sync(2)
    _assert_unchanged(target, rx, states)


def test_deleted_chunk(at_v1) -> None:
    store, _pub, states, target, rx = at_v1
    store.delete(_chunk_keys(store, 2)[-1])
    with pytest.raises(ObjectNotFound, match="missing"):
        rx.sync(2)
    _assert_unchanged(target, rx, states)


def test_digest_mismatch_rolls_back(at_v1) -> None:
    store, _pub, states, target, rx = at_v1
    m = catalog.primary_manifest(store, 2)
    tensors = list(m.tensors)
    i = next(i for i, t in enumerate(tensors) if t.changed)
    tensors[i] = msgspec.structs.replace(tensors[i], digest="0" * 32)
    _rewrite_manifest(store, 2, tensors=tensors)
    with pytest.raises(IntegrityError, match=tensors[i].name):
        rx.sync(2)
    _assert_unchanged(target, rx, states)


def test_newcomer_failure_leaves_nothing(store: Store) -> None:
    pub = publisher(store)
    state = make_state()
    pub.publish(state)
    m = catalog.primary_manifest(store, 0)
    tensors = [msgspec.structs.replace(m.tensors[0], digest="f" * 32), *m.tensors[1:]]
    _rewrite_manifest(store, 0, tensors=tensors)
    target = StateDictTarget({})
    with pytest.raises(IntegrityError):
        Receiver(store, target).sync()
    assert target.state == {} and target.held() is None


@pytest.mark.parametrize("fail_after", [0, 1, 5, 12])
def test_exception_midway_through_apply(at_v1, monkeypatch: pytest.MonkeyPatch, fail_after: int) -> None:
    _store, _pub, states, target, rx = at_v1
    real = apply_mod.apply_segment
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        if calls["n"] >= fail_after:
            raise RuntimeError("device lost")
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(apply_mod, "apply_segment", flaky)
    with pytest.raises(ApplyError, match="rolled back") as info:
        rx.sync(2)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert calls["n"] == fail_after  # it really failed midway, after that many segments
    _assert_unchanged(target, rx, states)
    monkeypatch.setattr(apply_mod, "apply_segment", real)
    rx.sync(2)  # the next attempt succeeds
    _assert_unchanged(target, rx, states, 2)


def test_failure_in_the_second_delta_of_a_chain(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    _pub, states = publish_chain(store, 3)
    target = StateDictTarget({})
    rx = Receiver(store, target)
    rx.sync(0)
    real = apply_mod.apply_segment
    seen: list[str] = []

    def counting(seg, dst, dtype, undo, where, **kw):
        seen.append(where)
        if catalog.version_dir(2) in where:
            raise RuntimeError("fails inside v2")
        return real(seg, dst, dtype, undo, where, **kw)

    monkeypatch.setattr(apply_mod, "apply_segment", counting)
    with pytest.raises(ApplyError):
        rx.sync(2)
    n_first = sum(catalog.version_dir(1) in w for w in seen)
    assert n_first > 0  # v1 was applied in full before v2 failed
    _assert_unchanged(target, rx, states, 0)


def test_base_mismatch(at_v1) -> None:
    store, _pub, states, target, rx = at_v1
    _rewrite_manifest(store, 2, base_root="e" * 32)
    with pytest.raises(BaseMismatch, match="refusing to apply"):
        rx.sync(2)
    _assert_unchanged(target, rx, states)


def test_held_root_that_is_not_the_base(at_v1) -> None:
    store, _pub, states, target, _rx = at_v1
    held = target.held()
    liar = StateDictTarget({n: t.clone() for n, t in target.state.items()},
                           Held(held.store, held.model, held.version, "d" * 32))
    with pytest.raises(BaseMismatch):
        Receiver(store, liar).sync(2)
    assert same_bits(liar.state, states[1])


def test_verify_base_catches_edits_behind_its_back(at_v1) -> None:
    store, _pub, _states, target, _rx = at_v1
    bits(target.state["layers.0.mlp.bias"])[7] ^= 1
    edited = snapshot(target.state)
    rx = Receiver(store, target, verify_base=True)
    with pytest.raises(BaseMismatch, match="modified outside"):
        rx.sync(2)
    assert rx.version == 1 and same_bits(target.state, edited)


def test_receiver_model_mismatch(store: Store) -> None:
    pub = publisher(store)
    pub.publish(make_state())
    wrong = make_state()
    wrong["layers.0.mlp.bias"] = torch.zeros(10_001)
    target = StateDictTarget(wrong)
    before = snapshot(wrong)
    with pytest.raises(ModelMismatch, match=r"layers\.0\.mlp\.bias"):
        Receiver(store, target).sync()
    assert same_bits(target.state, before) and target.held() is None


# --- publisher -------------------------------------------------------------------------------


class FlakyStore:
    """Wraps a store; the nth chunk put (counting from 1) raises StoreUnavailable once."""

    def __init__(self, inner: Store, fail_on: int) -> None:
        self.inner = inner
        self.url = inner.url
        self.fail_on = fail_on
        self.chunk_puts = 0
        self.armed = False

    def put(self, key, data, *, create_only=False):
        if key.endswith(".whc") and self.armed:
            self.chunk_puts += 1
            if self.chunk_puts == self.fail_on:
                self.armed = False
                raise StoreUnavailable(f"injected failure writing {key}")
        return self.inner.put(key, data, create_only=create_only)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_failed_publish_leaves_no_version(store: Store) -> None:
    flaky = FlakyStore(store, fail_on=3)
    pub = publisher(flaky)
    s0 = make_state()
    pub.publish(s0)
    rx_target = StateDictTarget({})
    rx = Receiver(store, rx_target)
    rx.sync()
    s1 = step(s0, 1)
    flaky.armed = True
    with pytest.raises(StoreUnavailable, match="injected"):
        pub.publish(s1)
    assert catalog.list_versions(store) == [0] and pub.version == 0
    s2 = step(s1, 2)
    res = pub.publish(s2)
    assert (res.version, res.base) == (1, 0)  # a delta from the last committed: both steps
    rx.sync()
    assert rx.version == 1 and same_bits(rx_target.state, s2)


def test_publishers_racing_for_a_version(store: Store) -> None:
    a, b = publisher(store), publisher(store)
    s0 = make_state()
    a.publish(s0)
    assert b.version == 0  # b adopts the store's latest
    sa, sb = step(s0, 1), step(s0, 2)
    results: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def run(name: str, pub: Publisher, state) -> None:
        barrier.wait()
        try:
            results[name] = pub.publish(state).version
        except ObjectExists as exc:
            results[name] = exc

    threads = [threading.Thread(target=run, args=("a", a, sa)),
               threading.Thread(target=run, args=("b", b, sb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    winners = [k for k, r in results.items() if r == 1]
    losers = [k for k, r in results.items() if isinstance(r, ObjectExists)]
    assert len(winners) == 1 and len(losers) == 1, results
    won_state = {"a": sa, "b": sb}[winners[0]]
    assert catalog.list_versions(store) == [0, 1]
    target = StateDictTarget({})
    Receiver(store, target).sync(1)
    assert same_bits(target.state, won_state)  # the committed version is intact
    # the loser retries on top of the winner
    loser = {"a": a, "b": b}[losers[0]]
    s2 = step(won_state, 3)
    assert loser.publish(s2).version == 2
    Receiver(store, target).sync()
    assert same_bits(target.state, s2)


def test_publisher_model_mismatch(store: Store) -> None:
    pub = publisher(store)
    s0 = make_state()
    pub.publish(s0)
    renamed = dict(s0)
    renamed["embed.w"] = renamed.pop("embed.weight")
    with pytest.raises(ModelMismatch, match=r"missing from the published state: \['embed\.weight'\]; "
                                            r"not in the model: \['embed\.w'\]"):
        pub.publish(renamed)
    reshaped = dict(s0)
    reshaped["step_counts"] = s0["step_counts"][:-1]
    with pytest.raises(ModelMismatch, match=r"'step_counts': shape \[2999\], the model has \[3000\]"):
        pub.publish(reshaped)
    assert catalog.list_versions(store) == [0]


def test_publisher_restart_continues_with_deltas(store: Store) -> None:
    _pub, states = publish_chain(store, 2)
    again = publisher(store)
    assert again.version == 1
    s2 = step(states[1], 9)
    res = again.publish(s2)
    assert (res.version, res.base) == (2, 1)
    fresh = StateDictTarget({})
    Receiver(store, fresh).sync()
    assert same_bits(fresh.state, s2)


def test_retention_keeps_newest_anchor(store: Store) -> None:
    pub = publisher(store, retain=4, anchor_every=4)
    states = [make_state()]
    pub.publish(states[0])
    old_target = StateDictTarget({})
    old_rx = Receiver(store, old_target)
    old_rx.sync()
    for v in range(1, 11):
        states.append(step(states[-1], v))
        pub.publish(states[-1])
    versions = catalog.list_versions(store)
    assert versions == [7, 8, 9, 10]  # the window of 4, and the anchor at 8 inside it
    assert store.children("") == [catalog.version_dir(v) for v in versions]  # nothing left behind
    fresh = StateDictTarget({})
    out = Receiver(store, fresh).sync()
    assert out.route[0].endswith(catalog.FULL)
    assert same_bits(fresh.state, states[10])
    old_rx.sync()  # from a deleted version: through the anchor
    assert old_rx.version == 10 and same_bits(old_target.state, states[10])
    with pytest.raises(VersionNotFound):
        Receiver(store, StateDictTarget({})).sync(3)


def test_retention_between_anchors_keeps_the_anchor(store: Store) -> None:
    pub = publisher(store, retain=4, anchor_every=4)
    states = [make_state()]
    pub.publish(states[0])
    for v in range(1, 7):
        states.append(step(states[-1], v))
        pub.publish(states[-1])
    assert catalog.list_versions(store) == [3, 4, 5, 6]
    fresh = StateDictTarget({})
    Receiver(store, fresh).sync()
    assert same_bits(fresh.state, states[6])


def test_no_sync_path_without_anchor(store: Store) -> None:
    _pub, _states = publish_chain(store, 3, anchor_every=0)
    catalog_key = catalog.rep_key(0, None, primary=True)
    store.delete(catalog_key)  # version 0 no longer exists: nothing to start from
    with pytest.raises(NoSyncPath):
        Receiver(store, StateDictTarget({})).sync()


# --- linear digests: O(changed) upkeep in publisher and receiver -------------------------------


def test_publisher_digests_equal_full_digests_every_version(store: Store) -> None:
    pub = publisher(store, anchor_every=3, skip_every=2)
    state = make_state()
    for v in range(7):
        if v:
            state = step(state, v)
            big = bits(state["layers.0.mlp.bias"])  # one tensor changes entirely: a dense segment
            big[:] = np.random.default_rng(v).integers(0, 2**32, big.size, dtype=np.uint32)
        res = pub.publish(state)
        for m in [r for r in catalog.representations(store, v)]:
            manifest = catalog.read_manifest(store, m.key)
            assert {e.name: e.digest for e in manifest.tensors} == {
                n: tensor_digest(t).hex() for n, t in state.items()}
        assert res.stream_seconds > 0 and res.encode_seconds > 0 and res.upload_seconds > 0
        assert res.overlap > 0 and res.seconds >= res.stream_seconds


def test_incremental_and_full_verify_agree_and_time_the_pause(store: Store) -> None:
    _pub, states = publish_chain(store, 4)
    a, b = StateDictTarget({}), StateDictTarget({})
    ra, rb = Receiver(store, a), Receiver(store, b, verify="full")
    for v in (0, 1, 3):
        out = ra.sync(v)
        rb.sync(v)
        assert same_bits(a.state, states[v]) and same_bits(b.state, states[v])
        assert out.pause_seconds >= out.apply_seconds + out.verify_seconds > 0
        assert out.seconds >= out.stage_seconds + out.pause_seconds
    with pytest.raises(UsageError, match="verify='sometimes'"):
        Receiver(store, a, verify="sometimes")  # type: ignore[arg-type]


def test_incremental_verify_sees_a_wrong_word_written(at_v1, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels fold what they write into the digest: a wrong word written is a mismatch."""
    _store, _pub, states, target, rx = at_v1
    real = apply_mod.apply_segment
    hits = {"n": 0}

    def off_by_one(seg, dst, dtype, undo, where, **kw):
        if hits["n"] == 0 and seg.count:  # one value one bit off: a decoding bug's output
            hits["n"] += 1
            prep = kw.get("prepared")
            if prep is not None:  # decoded while staging: its first word to write is wrong,
                new = prep.new.copy()  # and its sums and seal agree with that (a staging bug)
                new[0] ^= 1
                lanes = np.zeros(4, np.uint64)
                sealed = staged_sums(prep.pos, prep.old, new, prep.first, lanes)
                kw["prepared"] = replace(prep, new=new, old_lanes=lanes[:2], new_lanes=lanes[2:],
                                         seal=int(sealed))
            vals = seg.val_bytes.copy()
            vals[0] ^= 1  # bit 0 of a varint's first byte or of a raw word: still well formed
            seg = replace(seg, val_bytes=vals)
        return real(seg, dst, dtype, undo, where, **kw)

    monkeypatch.setattr(apply_mod, "apply_segment", off_by_one)
    with pytest.raises(IntegrityError, match="differ from the manifest's digests"):
        rx.sync(2)
    assert hits["n"] == 1
    _assert_unchanged(target, rx, states)


def test_a_write_behind_the_kernels_back_needs_full_verify(at_v1,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The trade-off of folding digests in the kernels: memory changed after the kernel wrote is
    not re-read by incremental verification; verify="full" re-reads it and rolls back."""
    store, _pub, states, target, _rx = at_v1
    real = apply_mod.apply_segment

    def clobber(seg, dst, dtype, undo, where, **kw):
        entry = real(seg, dst, dtype, undo, where, **kw)
        if entry is not None and entry.positions is not None and entry.done:
            dst[entry.positions[0]] ^= dst.dtype.type(1)  # a stray write after the kernel's
        return entry

    monkeypatch.setattr(apply_mod, "apply_segment", clobber)
    with pytest.raises(IntegrityError, match="differ from the manifest's digests"):
        Receiver(store, target, verify="full").sync(2)
    _assert_unchanged(target, Receiver(store, target), states)


def test_views_that_partly_share_memory_are_refused(store: Store) -> None:
    """Incremental verification trusts what the kernels wrote; tensors partly sharing memory
    would change each other behind it, so such a target is refused before anything is written."""
    _pub, states = publish_chain(store, 2)
    n, m = states[0]["layers.0.mlp.bias"].numel(), states[0]["special"].numel()
    for overlap in (m // 2, 0):
        big = torch.zeros(n + m - overlap)  # mlp.bias and special (both f32) in one buffer
        state = {k: t.clone() for k, t in states[0].items()}
        state["layers.0.mlp.bias"], state["special"] = big[:n], big[n - overlap:]
        target = StateDictTarget(state)
        before = snapshot(state)
        if overlap:
            with pytest.raises(PlacementError, match=r"'layers\.0\.mlp\.bias' and 'special' partly"):
                Receiver(store, target).sync(1)
            assert same_bits(target.state, before) and target.held() is None
        else:
            Receiver(store, target).sync(1)
            assert same_bits(target.state, states[1])
    # views whose byte extents interleave but share no byte pass; exact aliases (tied) pass
    buf = np.zeros((8, 6), np.uint16)
    ok = {"even": buf[:, 0::2], "odd": buf[:, 1::2], "tied": buf[:, 0::2], "own": np.zeros(4)}
    apply_mod.check_disjoint(ok, unique_views(ok))
    bad = {"even": buf[:, 0::2], "cols": buf[:, 2:4]}
    with pytest.raises(PlacementError, match="partly share memory"):
        apply_mod.check_disjoint(bad, unique_views(bad))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_non_contiguous_tensor_is_refused_before_anything_is_written(store: Store,
                                                                        backend: str) -> None:
    """A strided tensor's flat words are a copy: an update would land there, not in the tensor
    (a host target once committed a version with such a tensor left as it was). Refused when
    the target is made, and when its state gains one later, with nothing written."""
    _pub, states = publish_chain(store, 2)

    def column_major(t: torch.Tensor) -> torch.Tensor:  # the same values, transposed strides
        return t.t().contiguous().t()

    held = {k: t.clone() for k, t in states[0].items()}
    held["embed.weight"] = column_major(held["embed.weight"])
    with pytest.raises(UsageError, match=r"tensor 'embed\.weight' is not contiguous \(shape "
                                         r"\(256, 160\), strides \(1, 256\)\)"):
        StateDictTarget(held, backend=backend)
    target = StateDictTarget({k: t.clone() for k, t in states[0].items()}, backend=backend)
    Receiver(store, target).sync(0)
    target.state["layers.0.mlp.weight"] = column_major(target.state["layers.0.mlp.weight"])
    before = snapshot(target.state)
    with pytest.raises(UsageError, match=r"'layers\.0\.mlp\.weight' is not contiguous"):
        Receiver(store, target).sync(1)
    held_now = target.held()
    assert same_bits(target.state, before) and held_now is not None and held_now.version == 0


def test_kept_views_follow_every_tensor_the_state_is_given(store: Store) -> None:
    """A state dict target keeps its views (and the layout the pause derived from them) while
    its tensors stay the same, and rebuilds them when one is replaced, as an object or under
    the same object (`.data`): every sync still lands in the tensors the state holds."""
    _pub, states = publish_chain(store, 4)
    target = StateDictTarget({})
    rx = Receiver(store, target)
    rx.sync(0)
    kept = target.peek()
    rx.sync(1)
    assert target.peek() is kept and same_bits(target.state, states[1])
    assert len(kept.layouts) == 1  # the alias map, derived once
    moved = target.state["layers.0.mlp.weight"].clone()
    target.state["layers.0.mlp.weight"] = moved  # another object, another storage
    rx.sync(2)
    assert target.peek() is not kept and same_bits(target.state, states[2])
    assert target.state["layers.0.mlp.weight"] is moved
    kept = target.peek()
    embed = target.state["embed.weight"]
    embed.data = embed.data.clone()  # the same object on another storage
    rx.sync(3)
    assert target.peek() is not kept and same_bits(target.state, states[3])


def test_a_failed_first_sync_drops_its_kept_views(store: Store,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A target filled by a failed first sync gives its tensors back, views included."""
    publish_chain(store, 1)
    target = StateDictTarget({})

    def fail(*_a: object, **_k: object) -> None:
        raise IntegrityError("injected")

    monkeypatch.setattr("weighthub.receive.engine.check_step", fail)
    with pytest.raises(IntegrityError, match="injected"):
        Receiver(store, target).sync(0)
    assert target.state == {} and target._kept._kept is None


def test_held_digests_without_the_receiver_cache(at_v1) -> None:
    """A new receiver finds the held digests in the held manifest, or digests the held bits."""
    store, _pub, states, target, _rx = at_v1
    assert Receiver(store, target).sync(2).version == 2  # from the manifest of v1
    assert same_bits(target.state, states[2])
    pub = Publisher(store, delta_span_bytes=SPAN, retain=0)
    states.append(step(states[2], 3))
    pub.publish(states[3])
    store.delete(catalog.rep_key(2, 1, primary=True))  # v2's manifest gone: digest the held bits
    assert Receiver(store, target).sync(3).version == 3
    assert same_bits(target.state, states[3])


def test_tampered_held_bits_are_caught_before_the_pause(at_v1) -> None:
    store, _pub, _states, target, _rx = at_v1
    store.delete(catalog.rep_key(1, 0, primary=True))  # no manifest of v1: the held bits are read
    bits(target.state["embed.weight"])[3] ^= 1
    edited = snapshot(target.state)
    with pytest.raises(BaseMismatch, match="modified outside"):
        Receiver(store, target).sync(2)
    assert same_bits(target.state, edited)


def test_fresh_target_full_then_delta_with_a_dense_segment(store: Store) -> None:
    pub = publisher(store)
    state = make_state()
    pub.publish(state)
    state = step(state, 1)
    b = bits(state["layers.0.mlp.bias"])
    b[:] = np.random.default_rng(9).integers(0, 2**32, b.size, dtype=np.uint32)
    pub.publish(state)
    assert any(o.startswith("dense") for e in catalog.primary_manifest(store, 1).tensors
               for o in e.ops)
    target = StateDictTarget({})
    out = Receiver(store, target).sync(1)
    assert len(out.route) == 2 and same_bits(target.state, state)


# --- two phases: stage while serving, apply in the pause -------------------------------------


def test_stage_touches_nothing_then_apply_is_bit_exact(at_v1) -> None:
    store, _pub, states, target, rx = at_v1
    staged = rx.stage(2)
    assert (staged.version, staged.from_version, staged.bytes_fetched > 0) == (2, 1, True)
    _assert_unchanged(target, rx, states)  # staging touched nothing
    res = rx.apply(staged)
    assert (res.version, res.from_version, res.route) == (2, 1, staged.route)
    assert res.stage_seconds == staged.stage_seconds and res.pause_seconds > 0
    _assert_unchanged(target, rx, states, 2)
    assert rx.apply(rx.stage(2)).route == ()  # already there
    fresh = StateDictTarget({})  # a newcomer: the full representation, staged then applied
    newcomer = Receiver(store, fresh)
    staged = newcomer.stage()
    assert fresh.held() is None and fresh.state == {}
    newcomer.apply(staged)
    assert newcomer.version == 2 and same_bits(fresh.state, states[2])


def test_stale_staged_version_is_refused(at_v1) -> None:
    _store, pub, states, target, rx = at_v1
    states.append(step(states[-1], 3))
    assert pub.publish(states[-1]).version == 3
    staged = rx.stage(3)  # against v1
    rx.sync(2)  # the target moves on
    with pytest.raises(BaseMismatch, match=r"staged against version 1 .* now holds version 2"):
        rx.apply(staged)
    _assert_unchanged(target, rx, states, 2)
    with pytest.raises(UsageError, match="staged from"):  # another store's receiver
        Receiver(MemoryStore("other"), target).apply(rx.stage(3))
    _assert_unchanged(target, rx, states, 2)
    rx.apply(rx.stage(3))
    _assert_unchanged(target, rx, states, 3)


def test_failed_apply_of_a_staged_version_rolls_back(at_v1, monkeypatch: pytest.MonkeyPatch) -> None:
    _store, _pub, states, target, rx = at_v1
    staged = rx.stage(2)
    real = apply_mod.apply_segment
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        if calls["n"] >= 3:
            raise RuntimeError("device lost")
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(apply_mod, "apply_segment", flaky)
    with pytest.raises(ApplyError, match="rolled back"):
        rx.apply(staged)
    assert calls["n"] == 3
    _assert_unchanged(target, rx, states)
    monkeypatch.setattr(apply_mod, "apply_segment", real)
    rx.apply(staged)  # still staged against what the target holds: it applies
    _assert_unchanged(target, rx, states, 2)
