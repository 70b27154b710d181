"""Golden bytes of the publisher: what a Publisher stores for a fixed trajectory is pinned.

The digests below were recorded from the publisher as it stood before `publish.py` and
`publish_sharded.py` became the `publish/` package (one pipeline, the single process being the
world-size-1 case of the sharded publisher). Every stored object counts: manifests (primary,
anchors, skip deltas) and chunk frames, after a restarted publisher adopted the store, and after
retention deleted old versions. Only the random chunk-directory tokens, the publisher id and the
`created` time are masked (tests/store_golden.py); every other byte must stay as it was.
Those goldens pin `EncodePolicy(ctx=False)`, the `compact` profile before the context coding
(issue #16); GOLDEN_CTX pins `compact` with the range-coded context coding (`ctx`). Both write
chunk frame version 1 (`frame_version=1`, what writers emitted when they were recorded);
GOLDEN_V2 pins that `compact` in frame version 2 (varint segment records), whose manifests and
segment streams are those of GOLDEN_CTX; GOLDEN_ANS pins today's default, `compact` coded with
ans in frame version 2, which holds the same tensor digests.

Each runs on both scan backends: the host kernels, and the device code (`backend="torch"`: the
torch ops a CUDA trainer runs, here on CPU tensors), which must store the very same bytes
(design invariant 8); "torch-host-baseline" keeps that publisher's baseline in host memory.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from store_golden import digest_by_version, masked_objects
from weighthub import catalog
from weighthub.codec import EncodePolicy
from weighthub.publish import ENCODE_PROFILES, Publisher
from weighthub.store.memory import MemoryStore

SPAN = 4096  # the minimum chunk span: several chunks per tensor and version

# (name, shape, dtype): float families, an fp8, integers, a 0-d scalar, an empty tensor
MODEL: list[tuple[str, tuple[int, ...], torch.dtype]] = [
    ("a.weight", (64, 96), torch.bfloat16),
    ("b.bias", (300,), torch.float16),
    ("c.weight", (40, 50), torch.float32),
    ("d.steps", (17,), torch.int64),
    ("e.scale", (), torch.float32),
    ("f.empty", (0, 4), torch.bfloat16),
    ("g.fp8", (33, 31), torch.float8_e4m3fn),
]

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def trajectory(steps: int) -> list[dict[str, torch.Tensor]]:
    """Random weights, then sparse ±1-ulp steps, odd words (NaN payload, -0.0), a rewrite of a
    block at step 3 (dense / overwrite segments) and an unchanged state at step 7."""
    g = torch.Generator().manual_seed(20261201)
    state = {}
    for name, shape, dt in MODEL:
        if dt.is_floating_point:
            state[name] = torch.randn(shape, generator=g).to(dt)
        else:
            state[name] = torch.randint(-1000, 1000, shape, generator=g, dtype=dt)
    out = [{n: t.clone() for n, t in state.items()}]
    for step in range(1, steps):
        if step == 7:
            out.append({n: t.clone() for n, t in state.items()})
            continue
        for name, t in state.items():
            if t.numel() == 0:
                continue
            words = t.view(_INT[t.element_size()]).reshape(-1)
            hit = torch.rand(words.numel(), generator=g) < 0.03
            hit[int(torch.randint(0, words.numel(), (1,), generator=g))] = True
            words[hit] += torch.randint(0, 2, (int(hit.sum()),), generator=g,
                                        dtype=words.dtype) * 2 - 1
            if step == 3 and words.numel() > 64:
                words[10:60] = torch.randint(-100, 100, (50,), generator=g, dtype=words.dtype)
            if name == "a.weight":
                words[7 * step] = -0x7F81  # a NaN payload
                words[7 * step + 1] = -0x8000  # -0.0
        out.append({n: t.clone() for n, t in state.items()})
    return out


V1 = EncodePolicy(ctx=False, frame_version=1)  # `compact` as the goldens were recorded
RANGE = replace(ENCODE_PROFILES["compact"], coder="range")  # `compact` before the ans coding
CTX_V1 = replace(RANGE, frame_version=1)


BACKENDS = {"host": {}, "torch": {"backend": "torch"},
            "torch-host-baseline": {"backend": "torch", "host_baseline": True}}
backends = pytest.mark.parametrize("backend", sorted(BACKENDS))


def _publish_trajectory(policy: EncodePolicy = V1, backend: str = "host") -> MemoryStore:
    states = trajectory(10)
    store = MemoryStore()
    opts = dict(anchor_every=3, skip_every=2, delta_span_bytes=SPAN, full_span_bytes=SPAN,
                policy=policy, **BACKENDS[backend])
    pub = Publisher(store, workers=2, **opts)
    for state in states[:8]:
        pub.publish(state)
    # a publisher restarting adopts the store's head and goes on with deltas
    again = Publisher(store, workers=3, **opts)
    for state in states[8:]:
        again.publish(state)
    return store


GOLDEN = {
    "v000000000000": "7:ec9798238369f970577b3a70e9a471f8",
    "v000000000001": "7:e9416b3d6a80e5b19bb8aea0408a56a4",
    "v000000000002": "14:14acee500c636211244d90a0daa989c3",
    "v000000000003": "14:c3cb4c73fc9d1aaadf02d57f978c071c",
    "v000000000004": "14:6c762f0aab184f4b937cfeae0bf69b68",
    "v000000000005": "7:4e2f778e9218945ceffcc88b3d1a97b9",
    "v000000000006": "21:119126fe15d5c4e7b21f049c09145dd7",
    "v000000000007": "7:bdb756154334735c102b1561133349b9",
    "v000000000008": "7:518c49abc788982ee235b08f546794ca",
    "v000000000009": "14:6aa21ed136b640b73297d611eab27225",
}

GOLDEN_RETAIN = {
    "v000000000004": "11:86225e83f8e5f306080a3d496cd53153",
    "v000000000005": "7:4e2f778e9218945ceffcc88b3d1a97b9",
    "v000000000006": "18:fc49f8b3fecf89737aab6e20ffd52857",
}


@backends
def test_publisher_output_is_byte_identical_to_the_golden_digests(backend: str) -> None:
    objects = masked_objects(_publish_trajectory(backend=backend))
    got = digest_by_version(objects)
    print("\n".join(f"{k} {v}" for k, v in objects.items()))
    print(got)
    assert got == GOLDEN


GOLDEN_CTX = {
    "v000000000000": "7:ec9798238369f970577b3a70e9a471f8",
    "v000000000001": "7:479b773b4e215f29caf705659e7a74ac",
    "v000000000002": "14:3772b43e00b9a86d9b34fb59efdb4795",
    "v000000000003": "14:9e46edfd377de1af12306c1249b04442",
    "v000000000004": "14:6b5ba4076531d4420f94911325f2ca16",
    "v000000000005": "7:ca112864bb40aa05ce6b56a9b51f710a",
    "v000000000006": "21:f7210ffcbe65e05864eaa32600cb5b84",
    "v000000000007": "7:bdb756154334735c102b1561133349b9",
    "v000000000008": "7:2d1eb28b43e686959c7881642233ed4e",
    "v000000000009": "14:304e8758f72abc14ceafffb084a4aad4",
}


@backends
def test_context_coded_output_is_byte_identical_to_its_golden_digests(backend: str) -> None:
    store = _publish_trajectory(CTX_V1, backend)
    got = digest_by_version(masked_objects(store))
    print(got)
    ops = {o for v in range(1, 10) for t in catalog.primary_manifest(store, v).tensors for o in t.ops}
    assert {"xor/ctx/ctx", "add/ctx/ctx"} & ops, ops
    assert got == GOLDEN_CTX


GOLDEN_V2 = {
    "v000000000000": "7:7a27515cba68460da2e005ab625ff768",
    "v000000000001": "7:525c91ab9e4537738cfc11709eb01051",
    "v000000000002": "14:86c763d465dda1fb8e9221183c051607",
    "v000000000003": "14:f2ee1e432cd2fb42c2a6137d04141619",
    "v000000000004": "14:e2174043af0f76a48829dffc10397123",
    "v000000000005": "7:79fb65b8192ef4496bac310493eed9b1",
    "v000000000006": "21:5c9ac66303bbce59902d66b99dd8a82a",
    "v000000000007": "7:4d8d9369b16feb47ed8b3465cfbed3b3",
    "v000000000008": "7:fc64c73e19e49ed5b291c81c5442134a",
    "v000000000009": "14:8342763894460b23c7cf32dd01bad846",
}


@backends
def test_default_output_in_frame_version_2_is_byte_identical_to_its_golden_digests(
        backend: str) -> None:
    v2 = _publish_trajectory(RANGE, backend)
    got = digest_by_version(masked_objects(v2))
    print(got)
    assert got == GOLDEN_V2
    # the same segments as in version 1, in fewer bytes
    v1 = _publish_trajectory(CTX_V1, backend)
    for version in range(10):
        m1, m2 = (catalog.primary_manifest(s, version) for s in (v1, v2))
        assert [t.digest for t in m1.tensors] == [t.digest for t in m2.tensors]
        assert m2.payload_bytes < m1.payload_bytes or m2.changed == 0, (version, m1, m2)


GOLDEN_ANS = {
    "v000000000000": "7:7a27515cba68460da2e005ab625ff768",
    "v000000000001": "7:1c49c65c75ce697f5c5de46aad50cb23",
    "v000000000002": "14:2881fd6682fa6d2a1397074bdf9b3465",
    "v000000000003": "14:ccc00063c8460a32c40d039fad4dcb06",
    "v000000000004": "14:b0454f984c86f7037752c87583409237",
    "v000000000005": "7:805258bb101eafde15a6473f7d91f810",
    "v000000000006": "21:eb2b259e41d61fc12d9afb47c5722ee1",
    "v000000000007": "7:4d8d9369b16feb47ed8b3465cfbed3b3",
    "v000000000008": "7:615fa7b6b9513ff0ab89fed281e21ed1",
    "v000000000009": "14:dc885dcbee24f456152622a9d2f03dc4",
}


@backends
def test_default_output_is_byte_identical_to_its_golden_digests(backend: str) -> None:
    store = _publish_trajectory(ENCODE_PROFILES["compact"], backend)
    got = digest_by_version(masked_objects(store))
    print(got)
    ops = {o for v in range(1, 10) for t in catalog.primary_manifest(store, v).tensors for o in t.ops}
    assert {"xor/ans/ans", "add/ans/ans"} & ops, ops
    assert got == GOLDEN_ANS
    # the same versions as the range coder's, bit for bit
    ranged = _publish_trajectory(RANGE, backend)
    for version in range(10):
        ma, mr = (catalog.primary_manifest(s, version) for s in (store, ranged))
        assert [t.digest for t in ma.tensors] == [t.digest for t in mr.tensors]


@backends
def test_retention_leaves_the_golden_objects(backend: str) -> None:
    states = trajectory(7)
    store = MemoryStore()
    pub = Publisher(store, anchor_every=2, retain=3, skip_every=3, delta_span_bytes=SPAN,
                    full_span_bytes=2 * SPAN, workers=1, policy=V1, **BACKENDS[backend])
    for state in states:
        pub.publish(state)
    objects = masked_objects(store)
    got = digest_by_version(objects)
    print("\n".join(f"{k} {v}" for k, v in objects.items()))
    print(got)
    assert got == GOLDEN_RETAIN
