"""`TargetTests`: the behaviour every Target must have (the lifecycle in `targets/base.py`).

The kit drives a target as the receiver does: open → write bits → commit, or open → write →
write the old bits back (the receiver's undo log) → abort. It checks that views match the tensor
table, that commit records what is held and makes the bits visible, that an abort leaves the
exact bit patterns (NaN payloads, -0, infinities, subnormals included) and the held version of
before, and that views of distinct tensors never share memory (tied aliases aside).

Subclass it and implement `make_target()`; override `model_specs()` when the target has a fixed
model (a module, an engine), and `held_for()` when commit needs a real version (an engine that
reads the version's manifest at commit).

Views may be host numpy words or torch word views on a device (`tensors.Words`: what the
device backend applies into); the kit reads and writes either through the same helpers.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np

from ..targets.base import Held, Target, unique_views
from ..tensors import DTYPE_BY_NAME, TensorSpec, Words

# A tensor table with the awkward parts: a 2-D bf16 weight that is not a whole number of 128×128
# blocks (fp8 targets quantize it), fp32 and fp16 tensors, odd shapes, an integer buffer.
KIT_SPECS = [
    TensorSpec("embed.weight", DTYPE_BY_NAME["BF16"], (130, 200)),
    TensorSpec("layers.0.mlp.weight", DTYPE_BY_NAME["F16"], (3, 5, 7)),
    TensorSpec("layers.0.norm.weight", DTYPE_BY_NAME["F32"], (64,)),
    TensorSpec("layers.0.steps", DTYPE_BY_NAME["I64"], (4,)),
]
# bit patterns a float path would lose: a NaN payload, -0, +inf, the smallest subnormal, all ones
SPECIAL = {1: [0x7F, 0x80, 0x78, 0x01, 0xFF],
           2: [0x7FC1, 0x8000, 0x7F80, 0x0001, 0xFFFF],
           4: [0x7FC00001, 0x80000000, 0x7F800000, 0x00000001, 0xFFFFFFFF],
           8: [0x7FF8000000000001, 0x8000000000000000, 0x7FF0000000000000, 1, 2**64 - 1]}


class TargetTests:
    """Behaviour every Target must have. Subclasses implement `make_target`."""

    def make_target(self) -> Target:
        """A fresh target (called once per check): empty, or holding a committed version."""
        raise NotImplementedError("a TargetTests subclass implements make_target()")

    def model_specs(self) -> list[TensorSpec]:
        """The tensor table to open an empty target with (a non-empty one has its own)."""
        return list(KIT_SPECS)

    def held_for(self, bits: dict[str, np.ndarray], version: int) -> Held:
        """What to commit once `bits` (by name) are written: default, a made-up version."""
        return Held("memory://weighthub-kit", "kit-model", version, f"root-{version:04d}")

    def pattern(self, spec: TensorSpec, seed: int) -> np.ndarray:
        """Bits to write into `spec`'s view: random words with the SPECIAL ones first."""
        uint = np.dtype(f"u{spec.dtype.width}")
        rng = np.random.default_rng(seed)
        words = rng.integers(0, np.iinfo(uint).max, size=spec.numel, dtype=uint, endpoint=True)
        special = np.array(SPECIAL[spec.dtype.width], dtype=uint)[: spec.numel]
        words[: len(special)] = special
        return words

    # -- helpers -----------------------------------------------------------------------------------
    def _specs(self, target: Target) -> list[TensorSpec]:
        return target.specs() or self.model_specs()

    def _write(self, target: Target, views: Mapping[str, Words], seed: int
               ) -> dict[str, np.ndarray]:
        """Write a pattern through the first name of each memory (aliases follow); return the
        bits every name should then read."""
        specs = {s.name: s for s in self._specs(target)}
        first = unique_views(views)
        written: dict[str, np.ndarray] = {}
        for name, owner in first.items():
            if owner == name:
                bits = self.pattern(specs[name], seed + len(written))
                write_words(views[name], bits)
                written[name] = bits
        return {name: written[owner] for name, owner in first.items()}

    def _assert_bits(self, target: Target, want: dict[str, np.ndarray], when: str) -> None:
        got = target.peek()
        assert set(got) == set(want), f"{when}: peek names {sorted(got)} != {sorted(want)}"
        for name, bits in want.items():
            have = host_words(got[name]).view(bits.dtype)
            if not np.array_equal(have, bits):
                diff = int(np.count_nonzero(have != bits))
                raise AssertionError(f"{when}: {name!r} differs in {diff} of {bits.size} words")

    def commit_version(self, target: Target, seed: int, version: int
                       ) -> tuple[Held, dict[str, np.ndarray]]:
        """One transaction that commits: open, write a pattern, commit `held_for` of it.
        Returns (what was committed, the bits every name should now read)."""
        views = target.open(self._specs(target))
        want = self._write(target, views, seed)
        held = self.held_for(want, version)
        target.commit(held)
        return held, want

    # -- checks ----------------------------------------------------------------------------------
    def test_is_a_target(self) -> None:
        target = self.make_target()
        for method in ("held", "specs", "peek", "open", "commit", "abort"):
            assert callable(getattr(target, method, None)), method
        held = target.held()
        assert held is None or isinstance(held, Held)
        specs = target.specs()
        assert specs is None or all(isinstance(s, TensorSpec) for s in specs)
        if held is not None:
            assert specs, "a target that holds a version has its tensor table"

    def test_open_views_match_specs(self) -> None:
        target = self.make_target()
        specs = self._specs(target)
        views = target.open(specs)
        try:
            assert set(views) == {s.name for s in specs}, sorted(views)
            for s in specs:
                v = views[s.name]
                if isinstance(v, np.ndarray):
                    assert v.dtype.kind == "u" and v.dtype.itemsize == s.dtype.width, (s.name,
                                                                                     v.dtype)
                    assert v.size == s.numel, (s.name, v.size, s.numel)
                    assert v.flags.writeable, f"{s.name}: the view must be writable in place"
                else:  # torch words: integer, flat, contiguous (the device backend writes them)
                    assert not v.dtype.is_floating_point and v.element_size() == s.dtype.width, (
                        s.name, v.dtype)
                    assert v.dim() == 1 and v.is_contiguous(), (s.name, tuple(v.shape))
                    assert v.numel() == s.numel, (s.name, v.numel(), s.numel)
        finally:
            target.abort()

    def test_commit_records_held_and_bits(self) -> None:
        target = self.make_target()
        specs = self._specs(target)
        held, want = self.commit_version(target, seed=11, version=41)
        assert target.held() == held
        self._assert_bits(target, want, "after commit")
        got = target.specs()
        assert got is not None
        assert [(s.name, s.dtype, s.shape) for s in sorted(got, key=lambda s: s.name)] == \
            [(s.name, s.dtype, s.shape) for s in sorted(specs, key=lambda s: s.name)]
        held2, want2 = self.commit_version(target, seed=12, version=42)  # the next transaction
        assert target.held() == held2
        self._assert_bits(target, want2, "after the second commit")

    def test_abort_restores_exact_bits(self) -> None:
        target = self.make_target()
        held, before = self.commit_version(target, seed=21, version=51)
        views = target.open(self._specs(target))
        self._write(target, views, seed=22)  # the apply
        for name, owner in unique_views(views).items():  # the receiver's undo log, replayed
            if owner == name:
                write_words(views[name], before[name])
        target.abort()
        assert target.held() == held, "abort must keep the committed version"
        self._assert_bits(target, before, "after abort")
        held2, after = self.commit_version(target, seed=23, version=52)  # usable again
        assert target.held() == held2
        self._assert_bits(target, after, "after a commit following an abort")

    def test_abort_of_a_first_transaction(self) -> None:
        target = self.make_target()
        held, specs = target.held(), target.specs()
        views = target.open(self._specs(target))
        if held is None and specs is None:  # materialized by open: abort discards it
            self._write(target, views, seed=31)
        target.abort()
        assert target.held() == held
        if specs is None:
            assert target.specs() is None, "abort must discard what open() materialized"
        self.commit_version(target, seed=32, version=61)

    def test_views_are_disjoint(self) -> None:
        target = self.make_target()
        views = target.open(self._specs(target))
        try:
            first = unique_views(views)
            owners = sorted({o for o in first.values()})
            spans = sorted((*extent, n) for n in owners
                           if (extent := _extent(views[n]))[2] > extent[1])
            for (d0, _s0, e0, a), (d1, s1, _e1, b) in itertools.pairwise(spans):
                assert d0 != d1 or e0 <= s1, f"views {a!r} and {b!r} overlap"
            for name in owners:  # and a write through one view changes no other tensor
                snapshot = {n: host_words(views[n]).copy() for n in owners if n != name}
                flip_first(views[name])
                for n, bits in snapshot.items():
                    assert np.array_equal(host_words(views[n]), bits), \
                        f"writing {name!r} changed {n!r}"
                flip_first(views[name])
        finally:
            target.abort()

    def test_peek_matches_specs(self) -> None:
        target = self.make_target()
        self.commit_version(target, seed=41, version=71)
        specs = target.specs()
        assert specs is not None
        peek = target.peek()
        assert set(peek) == {s.name for s in specs}
        for s in specs:
            have = host_words(peek[s.name])
            assert have.size == s.numel and have.dtype.itemsize == s.dtype.width


def host_words(view: Words) -> np.ndarray:
    """A view's words as flat unsigned host words (a copy for torch words on a device)."""
    if isinstance(view, np.ndarray):
        return np.ascontiguousarray(view).reshape(-1)
    arr = view.detach().reshape(-1).cpu().numpy()
    return arr.view(f"u{arr.dtype.itemsize}")


def write_words(view: Words, bits: np.ndarray) -> None:
    """view[:] = bits (flat unsigned words of the view's width), in place, where it lives."""
    if isinstance(view, np.ndarray):
        view.reshape(-1)[...] = bits.view(view.dtype)
        return
    import torch

    signed = bits.view("u1" if bits.dtype.itemsize == 1 else f"i{bits.dtype.itemsize}")
    view.reshape(-1).copy_(torch.from_numpy(np.ascontiguousarray(signed)))


def flip_first(view: Words) -> None:
    """Flip the lowest bit of a view's first word, in place."""
    if isinstance(view, np.ndarray):
        view.reshape(-1)[:1] ^= view.dtype.type(1)
    else:
        view.reshape(-1)[:1] ^= 1


def _extent(view: Words) -> tuple[str, int, int]:
    """(address space, first byte, past the last byte) of a contiguous view."""
    if isinstance(view, np.ndarray):
        return "cpu", view.ctypes.data, view.ctypes.data + view.nbytes
    start = view.data_ptr()
    return str(view.device), start, start + view.numel() * view.element_size()
