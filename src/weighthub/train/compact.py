"""Compact sync: ship a LoGRA step as (U, seed, epoch, coef) per weight instead of a bf16 delta.

A receiver that keeps fp32 master copies replays the step with the very function the trainer
used (`projection.apply_low_rank`, fixed-order elementwise fp32 ops), so its masters stay
bit-identical to the trainer's; per-tensor digests (`digest.tensor_digest`, before and after)
bind the payload to its base and prove the result. The replay is one input of the transaction
engine (`receive.transact`): it computes the new words, the engine applies them to the masters
in place, checks the digests and commits or rolls back. Receivers without fp32 masters use the
normal bf16 delta refit.

Frame (little-endian), parsed and validated before any allocation:

    b"WHLOGRA1" | u32 header_len | header (UTF-8 JSON) | body | xxh3-128 of everything before

header = {"step": int, "entries": [{"name", "kind": "sketch"|"dense", "shape": [..], "dtype":
"bfloat16"|"float32", "offset", "nbytes", "base": hex, "digest": hex, and for sketches "seed",
"epoch", "rank", "coef", "decay"}]}. Entries' bytes are consecutive in the body, in order.
Size: Σ m·r·width(U) over sketched weights + 4·numel over dense ones + a small header; compare
with the bf16 delta (`bench.logra`): it wins only where the bf16 change rate is high enough.
"""

from __future__ import annotations

import json
import math
import re
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from ..codec import Op, Positions, Segment, Values
from ..digest import DIGEST_BYTES, root_digest, tensor_digest
from ..errors import BaseMismatch, ChecksumError, FormatError, LimitError, ModelMismatch
from ..format import ChunkFrame, ChunkRef, Manifest
from ..format.manifest import KIND, MANIFEST_FORMAT, TensorEntry
from ..receive import Chunk, Step, transact
from ..targets.state_dict import StateDictTarget
from ..tensors import bits, dtype_of
from .projection import apply_low_rank, rademacher
from .record import UpdateRecord

MAGIC = b"WHLOGRA1"
MAX_HEADER = 16 << 20
MAX_NUMEL = 1 << 40
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in _DTYPES.items()}
_HEX_DIGEST = re.compile(f"[0-9a-f]{{{2 * DIGEST_BYTES}}}")
COMPACT_SOURCE = "logra-compact"  # the `store` a CompactReceiver's masters record (Held.store)


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).numpy().tobytes()


def encode_update(rec: UpdateRecord) -> bytes:
    """The frame for one recorded step (see the module docstring)."""
    entries: list[dict[str, Any]] = []
    body: list[bytes] = []
    offset = 0
    for s in rec.sketches:
        raw = _raw(s.u)
        entries.append({"name": s.name, "kind": "sketch", "shape": list(s.shape),
                        "dtype": _NAMES[s.u.dtype], "offset": offset, "nbytes": len(raw),
                        "base": s.base_digest.hex(), "digest": s.digest.hex(), "seed": s.seed,
                        "epoch": s.epoch, "rank": int(s.u.shape[1]), "coef": s.coef, "decay": s.decay})
        body.append(raw)
        offset += len(raw)
    for d in rec.dense:
        raw = _raw(d.value.float())
        entries.append({"name": d.name, "kind": "dense", "shape": list(d.value.shape),
                        "dtype": "float32", "offset": offset, "nbytes": len(raw),
                        "base": d.base_digest.hex(), "digest": d.digest.hex()})
        body.append(raw)
        offset += len(raw)
    header = json.dumps({"step": rec.step, "entries": entries}, separators=(",", ":")).encode()
    frame = MAGIC + struct.pack("<I", len(header)) + header + b"".join(body)
    return frame + xxhash.xxh3_128_digest(frame)


@dataclass(frozen=True, slots=True)
class CompactEntry:
    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    data: memoryview
    base: bytes
    digest: bytes
    seed: int = 0
    epoch: int = 0
    rank: int = 0
    coef: float = 0.0
    decay: float = 1.0


def parse_update(buf: bytes) -> tuple[int, list[CompactEntry]]:
    """(step, entries) of a frame; raises FormatError/ChecksumError/LimitError on bad bytes."""
    mv = memoryview(buf)
    if len(mv) < len(MAGIC) + 4 + 16 or bytes(mv[:8]) != MAGIC:
        raise FormatError(f"not a LoGRA compact update ({len(mv)} bytes; magic {bytes(mv[:8])!r})")
    if xxhash.xxh3_128_digest(mv[:-16]) != bytes(mv[-16:]):
        raise ChecksumError("LoGRA compact update: checksum mismatch (truncated or corrupt); refetch it")
    (hlen,) = struct.unpack_from("<I", mv, 8)
    if hlen > MAX_HEADER or 12 + hlen > len(mv) - 16:
        raise LimitError(f"LoGRA compact update: header length {hlen} exceeds the frame or limit")
    try:
        header = json.loads(bytes(mv[12:12 + hlen]))
        step, raw_entries = _int(header["step"]), header["entries"]
        if not isinstance(raw_entries, list) or not all(isinstance(e, dict) for e in raw_entries):
            raise TypeError("entries must be a list of objects")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise FormatError(f"LoGRA compact update: bad header ({exc})") from exc
    body = mv[12 + hlen:-16]
    entries, offset = [], 0
    for e in raw_entries:
        entries.append(_entry(e, body, offset))
        offset += entries[-1].data.nbytes
    if offset != len(body):
        raise FormatError(f"LoGRA compact update: entries cover {offset} of {len(body)} body bytes")
    return step, entries


def _entry(e: dict[str, Any], body: memoryview, offset: int) -> CompactEntry:
    try:
        kind, dtype = e["kind"], _DTYPES[e["dtype"]]
        shape = tuple(_int(x) for x in e["shape"])
        if kind not in ("sketch", "dense") or (kind == "sketch" and len(shape) != 2):
            raise ValueError(f"kind {kind!r} with shape {shape}")
        rank = _int(e["rank"]) if kind == "sketch" else 0
        numel = shape[0] * rank if kind == "sketch" else math.prod(shape)
        if any(x <= 0 for x in shape) or numel > MAX_NUMEL or (kind == "sketch" and not
                                                                1 <= rank <= min(shape)):
            raise ValueError(f"shape {shape} rank {rank} out of range")
        nbytes = numel * dtype.itemsize
        if _int(e["offset"]) != offset or _int(e["nbytes"]) != nbytes or offset + nbytes > len(body):
            raise ValueError(f"bytes [{e['offset']}, +{e['nbytes']}) do not match {nbytes} at {offset}")
        extra: dict[str, Any] = {}
        if kind == "sketch":
            extra = dict(seed=_int(e["seed"]), epoch=_epoch(e["epoch"]), rank=rank,
                         coef=_float(e["coef"]), decay=_float(e["decay"]))
        if not isinstance(e["name"], str):
            raise TypeError(f"name {e['name']!r} is not a string")
        # the replay hashes the name as UTF-8 (projection_key): a lone surrogate (a "\udcff"
        # escape) fails here, as a UnicodeEncodeError (a ValueError), not in the replay
        e["name"].encode()
        return CompactEntry(e["name"], kind, shape, dtype, body[offset:offset + nbytes],
                            _digest(e["base"]), _digest(e["digest"]), **extra)
    except (ValueError, KeyError, TypeError) as exc:
        name = e.get("name", "?") if isinstance(e, dict) else repr(e)
        raise FormatError(f"LoGRA compact update: bad entry {name}: {exc}") from exc


def _int(v: Any) -> int:
    if type(v) is not int:  # not 2.0, "3" or true: what a writer emits, nothing else
        raise TypeError(f"{v!r} is not an integer")
    return v


def _epoch(v: Any) -> int:
    """A refresh epoch: a u64 entry of the projection's SeedSequence (it refuses negatives)."""
    if not 0 <= _int(v) < 1 << 64:
        raise ValueError(f"epoch {v} outside 0..2^64-1")
    return int(v)


def _float(v: Any) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise TypeError(f"{v!r} is not a finite number")
    return float(v)


def _digest(v: Any) -> bytes:
    # fullmatch, not fromhex alone: fromhex skips whitespace, so "  " * 16 would pass as b""
    if not isinstance(v, str) or not _HEX_DIGEST.fullmatch(v):
        raise ValueError(f"{v!r} is not a {DIGEST_BYTES}-byte hex digest")
    return bytes.fromhex(v)


def _tensor(entry: CompactEntry, shape: tuple[int, ...]) -> torch.Tensor:
    as_int = torch.int16 if entry.dtype == torch.bfloat16 else torch.int32
    return torch.frombuffer(bytearray(entry.data), dtype=as_int).view(entry.dtype).reshape(shape)


class CompactReceiver:
    """Holds fp32 masters and applies compact updates all-or-nothing, through the engine.

    The replay (before the pause) computes each rewritten master's new fp32 words on a copy;
    the transaction engine (`receive.transact`) applies them in place to the masters (a
    `StateDictTarget`) with an undo log, checks every rewritten tensor's digest against the
    trainer's in the payload, and commits or rolls back exactly, like any other input.

    Args:
        masters: name → fp32 CPU tensor (owned by the receiver from now on; updated in place).

    Observers that must see all of one step read the masters under `lock`.
    """

    def __init__(self, masters: dict[str, torch.Tensor]) -> None:
        self.masters = masters
        self.target = StateDictTarget(masters)
        self.step: int | None = None
        self.lock = threading.Lock()  # held while the masters' bits are changing
        self._apply_lock = threading.Lock()  # one apply at a time: the replay reads the masters

    def apply(self, buf: bytes) -> dict[str, int]:
        """Verify base digests, replay every entry on copies, apply them, verify result digests,
        commit.

        Returns counts {"sketch": n, "dense": n, "bytes": len(buf)}. Raises FormatError family
        (bad bytes), ModelMismatch (unknown name/shape), BaseMismatch (masters are not the
        payload's base), IntegrityError (replayed bits differ from the trainer's): on any
        error the masters are unchanged (rolled back by the engine if they were written).
        """
        step, entries = parse_update(buf)
        with self._apply_lock:
            full, chunks = self._replay(step, entries)
            with self.lock:
                transact(self.target, [Step(full, chunks)], store=COMPACT_SOURCE,
                         held=self.target.held(), specs=full.specs(), fresh=False)
            self.step = step
        kinds = [e.kind for e in entries]
        return {"sketch": kinds.count("sketch"), "dense": kinds.count("dense"), "bytes": len(buf)}

    def _replay(self, step: int, entries: list[CompactEntry]) -> tuple[Manifest, list[Chunk]]:
        """The step as a full representation of the tensors it rewrites: their new words as
        dense chunks, and the trainer's digests as the manifest they must match."""
        table: list[TensorEntry] = []
        chunks: list[Chunk] = []
        for i, e in enumerate(entries):
            cur = self.masters.get(e.name)
            if cur is None or tuple(cur.shape) != e.shape or cur.dtype != torch.float32:
                got = None if cur is None else (tuple(cur.shape), cur.dtype)
                raise ModelMismatch(f"compact update step {step}: '{e.name}' {e.shape} fp32 expected, "
                                    f"receiver holds {got}")
            if tensor_digest(cur) != e.base:
                raise BaseMismatch(f"compact update step {step}: '{e.name}' is not at the update's base "
                                   f"(digest {tensor_digest(cur).hex()[:12]}…, expected "
                                   f"{e.base.hex()[:12]}…); resync this receiver from a full version")
            if e.kind == "sketch":
                new = cur.clone()
                u = _tensor(e, (e.shape[0], e.rank))
                p = rademacher(e.seed, e.name, e.epoch, e.shape[1], e.rank)
                apply_low_rank(new, u, p, coef=e.coef, decay=e.decay)
            else:
                new = _tensor(e, e.shape).clone()
            words = bits(new)
            table.append(TensorEntry(e.name, dtype_of(new).name, list(e.shape), e.digest.hex(),
                                     words.size))
            ref = ChunkRef(f"step-{step}/{e.name}", words.nbytes, "", [(i, 0, words.size)])
            seg = Segment(i, 0, words.size, Op.DENSE, Positions.ALL, Values.RAW, words.size,
                          np.empty(0, np.uint8), words.view(np.uint8))
            chunks.append(Chunk(ChunkFrame((seg,)), ref))
        specs = [t.spec() for t in table]
        root = root_digest((s, bytes.fromhex(t.digest)) for s, t in zip(specs, table, strict=True))
        nbytes = sum(s.nbytes for s in specs)
        full = Manifest(format=MANIFEST_FORMAT, kind=KIND, model=COMPACT_SOURCE, version=step,
                        base=None, base_root=None, root=root.hex(), tensors=table,
                        chunks=[c.ref for c in chunks], dense_bytes=nbytes, payload_bytes=nbytes,
                        changed=sum(s.numel for s in specs))
        return full, chunks

    def bf16_state(self) -> dict[str, torch.Tensor]:
        """The inference copy a rollout worker serves: each master cast to bf16."""
        return {n: t.to(torch.bfloat16) for n, t in self.masters.items()}
