"""`weighthub` against hostile inputs on disk: one line on stderr, exit 2 or 3 (issue #17 item 3).

Real subprocesses on real files: a store whose manifest nests past any recursion limit, a chunk
whose exponent-group table holds a 64-bit key (a valid frame, with the manifest's checksum
updated to match: only the parser stands between it and the kernels), a checkpoint whose
safetensors header nests too deeply, a secret file that is a FIFO. Each run exits 2 (input the
user named) or 3 (data refused), never 1 (the verify-mismatch code an uncaught exception also
gives), prints exactly one line on stderr, no traceback, and returns (nothing blocks).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from deadlines import PROCESS_S
from safetensors.torch import save_file

from weighthub import catalog, cli
from weighthub.cli import main
from weighthub.codec import Positions
from weighthub.format import decode_chunk, encode_chunk
from weighthub.format.manifest import chunk_checksum

pytestmark = pytest.mark.slow  # several CLI processes, each importing torch


def _cli(*argv: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run([sys.executable, "-m", "weighthub.cli", *map(str, argv)],
                          capture_output=True, text=True, timeout=PROCESS_S, env=env)


def _refused(p: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == code and len(lines) == 1, (p.returncode, p.stderr)
    assert lines[0].startswith("weighthub: error: ") and "Traceback" not in p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def _grouped_state(seed: int) -> dict[str, torch.Tensor]:
    """bf16 words whose change rate depends on the exponent, so the delta uses groups."""
    rng = np.random.default_rng(0)
    n = 200_000
    exp = rng.integers(110, 125, n, dtype=np.uint16)
    old = (exp << 7) | rng.integers(0, 128, n, dtype=np.uint16)
    new = old.copy()
    if seed:
        new[rng.random(n) < np.where(exp < 116, 0.2, 0.002)] += np.uint16(1)
    return {"w": torch.from_numpy(new.view(np.int16)).view(torch.bfloat16)}


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding v0 (full) and v1 (a delta with exponent-grouped positions)."""
    root = tmp_path_factory.mktemp("published")
    for v in (0, 1):
        ckpt = root / f"ckpt{v}.safetensors"
        save_file(_grouped_state(v), ckpt)
        assert main(["publish", "--encode", "grouped", str(root / "store"), str(ckpt)]) == 0
    return root / "store"


@pytest.fixture
def ctx_store(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """v0 and v1 published with the default encoding and the given context coder: a
    context-coded delta."""
    for v in (0, 1):
        ckpt = tmp_path / f"ckpt{v}.safetensors"
        save_file(_grouped_state(v), ckpt)
        assert main(["publish", "--context-coder", request.param, str(tmp_path / "store"),
                     str(ckpt)]) == 0
    # `--context-coder range` writes the range coding (id ctx), the default ans
    assert _primary_codings(tmp_path / "store") == {"ctx" if request.param == "range" else "ans"}
    return tmp_path / "store"


@pytest.fixture
def store(published: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(published, tmp_path / "store"))


def _primary(store: Path, v: int) -> Path:
    return store / catalog.version_dir(v) / catalog.PRIMARY


def test_a_manifest_nested_past_the_recursion_limit(store: Path, tmp_path: Path) -> None:
    # objects, since a manifest's head is read as one first: an array is "not a manifest" at once
    _primary(store, 1).write_bytes(b'{"a":' * 100_000 + b"0" + b"}" * 100_000)
    _refused(_cli("inspect", store), 3, "FormatError", "nested too deeply", catalog.PRIMARY)
    _refused(_cli("pull", store, tmp_path / "out.safetensors"), 3, "FormatError", "nested too deeply")
    assert not (tmp_path / "out.safetensors").exists()


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    return bytes(out + bytes([v]))


def _pull_refuses_an_edited_chunk(store: Path, tmp_path: Path, positions: Positions,
                                  table: Callable[[int], bytes], *needles: str) -> None:
    """Replace the position stream of v1's first segment coded `positions` with table(count),
    re-checksum the chunk in the manifest (so only the parser stands in the way), pull."""
    manifest = _primary(store, 1)
    doc = msgspec.json.decode(manifest.read_bytes())
    for ref in doc["chunks"]:
        path = store / ref["key"]
        segments = list(decode_chunk(path.read_bytes(), where=ref["key"]).segments)
        hits = [i for i, s in enumerate(segments) if s.positions == positions]
        if hits:
            break
    assert hits, f"the fixture's delta must use {positions.name.lower()} positions"
    seg = segments[hits[0]]
    segments[hits[0]] = replace(seg, pos_bytes=np.frombuffer(table(seg.count), np.uint8))
    hostile = encode_chunk(segments)
    path.write_bytes(hostile)
    ref.update(size=len(hostile), checksum=chunk_checksum(hostile))
    manifest.write_bytes(msgspec.json.encode(doc))
    out = tmp_path / "out.safetensors"
    _refused(_cli("pull", store, out), 3, "FormatError", *needles, ref["key"])
    assert not out.exists()


def test_a_chunk_whose_group_table_overflows_int64(store: Path, tmp_path: Path) -> None:
    # one group whose key is 2^63 (past int64 and the exponent field): a valid frame otherwise
    _pull_refuses_an_edited_chunk(store, tmp_path, Positions.GROUPS,
                                  lambda count: b"\x01" + b"\x80" * 9 + b"\x01" + _varint(count),
                                  "group keys out of range")


@pytest.mark.parametrize("ctx_store", ["range", "ans"], indirect=True)
def test_a_context_coded_chunk_whose_group_key_is_past_int64(ctx_store: Path, tmp_path: Path
                                                             ) -> None:
    """The same through the context coders: a group table whose key is 2^63, coded as the spec
    says (tests/reference_ctx.py, tests/reference_ans.py)."""
    import reference_ans
    import reference_ctx

    ans = _primary_codings(ctx_store) == {"ans"}
    code_positions = reference_ans.code_positions if ans else reference_ctx.code_positions
    _pull_refuses_an_edited_chunk(ctx_store, tmp_path, Positions.ANS if ans else Positions.CTX,
                                  lambda count: code_positions([(1 << 63, count, 1)], [[0] * count]),
                                  "group table out of range")


def _primary_codings(store: Path) -> set[str]:
    """The context codings (ctx, ans) v1's manifest names."""
    doc = msgspec.json.decode(_primary(store, 1).read_bytes())
    ops = {o for t in doc["tensors"] for o in t["ops"]}
    return {o.split("/")[1] for o in ops} & {"ctx", "ans"}


def test_a_checkpoint_whose_header_nests_too_deeply(store: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "deep.safetensors"
    header = b'{"w":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    ckpt.write_bytes(struct.pack("<Q", len(header)) + header)
    _refused(_cli("verify", store, ckpt), 2, "not a safetensors file", "nested too deeply")


def test_a_secret_file_that_is_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "secret"
    os.mkfifo(fifo)
    try:  # before the fix the open blocked forever: the subprocess's timeout bounds the wait
        p = _cli("serve", "hub", "--db", tmp_path / "hub.db", "--secret-file", fifo, "--port", "0")
    except subprocess.TimeoutExpired:
        pytest.fail("weighthub serve hub blocked on a FIFO secret file")
    _refused(p, 2, "not a regular file", str(fifo))


def test_an_unexpected_exception_is_one_line_and_exit_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The last line of defence (a parser bug not yet mapped): never a traceback, never exit 1."""
    import weighthub.cli_read

    def broken(_store: object) -> list[int]:
        raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(weighthub.cli_read.catalog, "list_versions", broken)
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    assert main(["inspect", str(tmp_path)]) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "internal error RecursionError" in lines[0] and "weighthub bug" in lines[0]
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")  # the traceback, for the bug report
    with pytest.raises(RecursionError):
        main(["inspect", str(tmp_path)])
