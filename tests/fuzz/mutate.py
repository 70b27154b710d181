"""Mutations of real inputs: byte-level edits, varints, and edits of JSON trees.

Pure functions of the input and of a list of edits, so a hypothesis strategy draws the edits
(and shrinks them) and the nightly script replays them. Positions are taken modulo the input's
length: every edit applies to every input.
"""

from __future__ import annotations

import json
from typing import Any

# Values that break size arithmetic: type boundaries, off-by-ones, and "allocate a lot".
INTERESTING_INTS = (0, 1, 2, 7, 8, 255, 256, 4095, 4096, (1 << 15) - 1, 1 << 15, (1 << 16) - 1,
                    1 << 20, (1 << 30), (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40,
                    1 << 48, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)
DEEP = "\x00fuzz-deep\x00"  # a JSON value replaced, after dumping, by deep nesting
DEEP_HOPS = "\x00fuzz-deep-hops\x00"  # … by a chain of relay hops (wire.Hop), as deep


def varint(v: int) -> bytes:
    """Unsigned LEB128 (any size: values past 64 bits make over-long varints)."""
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def replace_varint(buf: bytes, index: int, value: int) -> bytes:
    """`buf` read as consecutive varints (a gaps, group-table or value stream), with varint
    number `index` (modulo their count) replaced by varint(value)."""
    starts, i = [], 0
    while i < len(buf):
        starts.append(i)
        while i < len(buf) and buf[i] & 0x80:
            i += 1
        i += 1
    if not starts:
        return varint(value)
    k = index % len(starts)
    end = starts[k + 1] if k + 1 < len(starts) else len(buf)
    return buf[:starts[k]] + varint(value) + buf[end:]


Edit = tuple[str, int, int, bytes]  # (kind, position, number, bytes)


def apply_edits(data: bytes, edits: list[Edit]) -> bytes:
    """Apply byte edits in order. Kinds: flip (bit `number`), set (byte = number), truncate,
    insert (bytes), delete (`number` bytes), int (`number` as 1/2/4/8 little-endian bytes,
    width = len(bytes) or 4), varint (insert varint(number))."""
    buf = bytearray(data)
    for kind, pos, num, blob in edits:
        i = pos % (len(buf) + 1)
        if kind == "truncate":
            del buf[i:]
        elif kind == "insert":
            buf[i:i] = blob
        elif kind == "varint":
            buf[i:i] = varint(num)
        elif kind == "delete":
            del buf[i:i + max(1, num)]
        elif not buf:
            continue
        elif kind == "flip":
            buf[i % len(buf)] ^= 1 << (num % 8)
        elif kind == "set":
            buf[i % len(buf)] = num % 256
        elif kind == "int":
            width = len(blob) if len(blob) in (1, 2, 4, 8) else 4
            j = i % len(buf)
            buf[j:j + width] = (num % (1 << (8 * width))).to_bytes(width, "little")
    return bytes(buf)


def paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indices) to a value in a JSON tree, the root first."""
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += paths(v, (*prefix, i))
    return out


def set_path(tree: Any, path: tuple[Any, ...], value: Any, *, delete: bool = False) -> Any:
    """`tree` with the value at `path` replaced (or removed from its dict/list)."""
    if not path:
        return value
    parent = tree
    for k in path[:-1]:
        parent = parent[k]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return tree


def dump_json(tree: Any, depth: int) -> bytes:
    """JSON text of `tree`, with every DEEP value replaced by `depth` nested arrays and every
    DEEP_HOPS by a hop nesting `depth` hops (built as text: json.dumps itself would recurse)."""
    text = json.dumps(tree, separators=(",", ":"), allow_nan=True)
    hops = '{"addr":"h:1","children":[' * depth + "]}" * depth
    return text.replace(json.dumps(DEEP), "[" * depth + "]" * depth).replace(
        json.dumps(DEEP_HOPS), hops).encode()
