"""SafetensorsTarget and load_checkpoint: hostile headers, materialize/commit/abort, sidecars."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from weighthub.errors import BaseMismatch, FormatError, LimitError, UsageError
from weighthub.targets import SafetensorsTarget, load_checkpoint
from weighthub.targets.base import Held
from weighthub.targets.safetensors_header import MAX_HEADER_BYTES, read_header
from weighthub.tensors import bits, specs_of

HELD = Held("file:///store", "0" * 32, 3, "1" * 32)


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(17, 5, generator=g).bfloat16(),
        "b.f32": torch.randn(33, generator=g),
        "c.f16": torch.randn(3, 3, generator=g).half(),
        "d.i64": torch.arange(5, dtype=torch.int64),
        "e.u8": torch.arange(7, dtype=torch.uint8),
        "f.empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "g.special": torch.tensor([float("nan"), -0.0, 0.0, float("inf")], dtype=torch.bfloat16),
    }


def raw_safetensors(path: Path, header: object, data: bytes = b"", *, declared: int | None = None,
                    pad: bool = True) -> Path:
    raw = json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if declared is None else declared) + raw + data)
    return path


ENTRY = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


HOSTILE = [
    ("empty file", None, b"", None, FormatError),
    ("length larger than file", {"x": ENTRY}, bytes(16), 10_000, LimitError),
    ("length over the limit", {"x": ENTRY}, bytes(16), MAX_HEADER_BYTES + 1, LimitError),
    ("offsets inconsistent with shape", {"x": {**ENTRY, "data_offsets": [0, 12]}}, bytes(16),
     None, FormatError),
    ("data past the end", {"x": {**ENTRY, "data_offsets": [8, 24]}}, bytes(16), None, FormatError),
    ("negative offset", {"x": {**ENTRY, "data_offsets": [-4, 12]}}, bytes(16), None, FormatError),
    ("negative dim", {"x": {**ENTRY, "shape": [-2, -2]}}, bytes(16), None, FormatError),
    ("float dim", {"x": {**ENTRY, "shape": [2.0, 2]}}, bytes(16), None, FormatError),
    ("string offsets", {"x": {**ENTRY, "data_offsets": "0,16"}}, bytes(16), None, FormatError),
    ("missing dtype", {"x": {"shape": [4], "data_offsets": [0, 16]}}, bytes(16), None,
     FormatError),
    ("unknown dtype", {"x": {**ENTRY, "dtype": "F128"}}, bytes(16), None, FormatError),
    ("header not an object", [1, 2], b"", None, FormatError),
    ("overlapping tensors", {"x": ENTRY, "y": {**ENTRY, "data_offsets": [8, 24]}}, bytes(24),
     None, FormatError),
]


# no safetensors header at all: as a checkpoint to read, the caller named the wrong file
NOT_SAFETENSORS = {"empty file", "length larger than file", "length over the limit",
                   "header not an object"}


@pytest.mark.parametrize(("name", "header", "data", "declared", "error"), HOSTILE,
                         ids=[case[0] for case in HOSTILE])
def test_hostile_headers_are_refused(tmp_path: Path, name: str, header: object, data: bytes,
                                     declared: int | None, error: type[Exception]) -> None:
    path = tmp_path / "bad.safetensors"
    if header is None:
        path.write_bytes(b"\x05\x00\x00")  # not even the 8-byte length
    else:
        raw_safetensors(path, header, data, declared=declared)
    with pytest.raises(error, match=r"bad\.safetensors"):
        read_header(path)
    if name in NOT_SAFETENSORS:
        with pytest.raises(UsageError, match=r"bad\.safetensors is not a safetensors file"):
            load_checkpoint(path)
    else:  # a safetensors header with bad entries: a corrupt file, not a wrong one
        with pytest.raises(error) as info:
            load_checkpoint(path)
        assert not isinstance(info.value, UsageError)


@pytest.mark.parametrize("content", [b"", b"hello, weights\n", b"\x80\x02}q\x00(X\x01\x00\x00\x00aq" * 64],
                         ids=["empty", "text", "pickle"])
def test_other_files_are_not_safetensors(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=r"model\.bin is not a safetensors file \(.+\); give a "):
        load_checkpoint(path)


def test_header_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 8) + b"\xff{nope}\x00" + bytes(8))
    with pytest.raises(FormatError, match="not JSON"):
        read_header(path)
    with pytest.raises(UsageError, match=r"not a safetensors file .*not JSON"):
        load_checkpoint(path)


def test_truncated_real_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file(sample_state(), path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-3])  # the last tensor's data is cut short
    with pytest.raises(FormatError, match="inconsistent offsets"):
        load_checkpoint(path)
    path.write_bytes(raw[:20])  # cut inside the header: no header to read at all
    with pytest.raises(LimitError):
        read_header(path)
    with pytest.raises(UsageError, match="not a safetensors file"):
        load_checkpoint(path)


def test_load_checkpoint_bits_and_errors(tmp_path: Path) -> None:
    state = sample_state()
    save_file(state, tmp_path / "m.safetensors")
    got = load_checkpoint(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(state)
    for n, t in state.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape
        assert np.array_equal(bits(got[n]), bits(t))
    with pytest.raises(UsageError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"no \.safetensors"):
        load_checkpoint(tmp_path / "empty")
    save_file({"b.f32": state["b.f32"]}, tmp_path / "dup.safetensors")
    with pytest.raises(FormatError, match="two files"):
        load_checkpoint(tmp_path)


def _fill(views: dict[str, np.ndarray], state: dict[str, torch.Tensor]) -> None:
    for n, t in state.items():
        views[n][:] = bits(t)


@pytest.mark.parametrize("name", ["out.safetensors", "outdir"])
def test_materialize_then_abort_leaves_nothing(tmp_path: Path, name: str) -> None:
    state = sample_state()
    target = SafetensorsTarget(tmp_path / name)
    views = target.open(specs_of(state))
    _fill(views, state)
    assert len(list(tmp_path.iterdir())) == 1  # the hidden temporary, not yet the name
    target.abort()
    assert list(tmp_path.iterdir()) == []
    assert target.held() is None


@pytest.mark.parametrize("name", ["out.safetensors", "outdir"])
def test_materialize_commit_loads_with_safetensors(tmp_path: Path, name: str) -> None:
    state = sample_state()
    target = SafetensorsTarget(tmp_path / name)
    _fill(target.open(specs_of(state)), state)
    target.commit(HELD)
    data = tmp_path / name if name.endswith(".safetensors") else tmp_path / name / "model.safetensors"
    loaded = load_file(data)
    assert sorted(loaded) == sorted(state)
    for n, t in state.items():
        assert loaded[n].dtype == t.dtype and loaded[n].shape == t.shape
        assert np.array_equal(bits(loaded[n].contiguous()), bits(t))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert SafetensorsTarget(tmp_path / name).held() == HELD
    assert SafetensorsTarget(tmp_path / name).specs() == specs_of(state)


def test_in_place_abort_restores_the_committed_sidecar(tmp_path: Path) -> None:
    state = sample_state()
    out = tmp_path / "out.safetensors"
    target = SafetensorsTarget(out)
    _fill(target.open(specs_of(state)), state)
    target.commit(HELD)
    sidecar = target.sidecar.read_bytes()
    views = target.open(specs_of(state))
    assert target.held() is None  # "applying": mixed bits are never claimed as a version
    views["b.f32"][0] ^= 1
    views["b.f32"][0] ^= 1  # the receiver rolled its change back
    target.abort()
    # committed again, with the same version; its files' stats are re-recorded (rolling back
    # wrote through the map), so the rollback is not mistaken for an edit outside weighthub
    after = json.loads(target.sidecar.read_bytes())
    assert {**after, "files": None} == {**json.loads(sidecar), "files": None}
    assert after["files"]["out.safetensors"][0] == out.stat().st_size
    assert target.held() == HELD and SafetensorsTarget(out).held() == HELD


@pytest.mark.parametrize("name", ["out.safetensors", "outdir"])
def test_crash_while_applying_is_rematerialized(tmp_path: Path, name: str) -> None:
    state = sample_state()
    target = SafetensorsTarget(tmp_path / name)
    _fill(target.open(specs_of(state)), state)
    target.commit(HELD)
    target.open(specs_of(state))["d.i64"][:] = 99  # ... and the process dies here
    again = SafetensorsTarget(tmp_path / name)
    assert again.held() is None and again.specs() is None
    _fill(again.open(specs_of(state)), state)  # the whole file is written afresh
    again.commit(Held(HELD.store, HELD.model, 4, HELD.root))
    assert SafetensorsTarget(tmp_path / name).held().version == 4
    assert np.array_equal(bits(load_checkpoint(tmp_path / name)["d.i64"]), bits(state["d.i64"]))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_foreign_directory_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "outdir"
    out.mkdir()
    (out / "readme.txt").write_text("not weighthub's")
    with pytest.raises(UsageError, match="non-empty directory"):
        SafetensorsTarget(out).open(specs_of(sample_state()))
    assert [p.name for p in tmp_path.iterdir()] == ["outdir"]


def test_failed_materialize_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import weighthub.targets.safetensors_file as sf

    def disk_full(path: Path, specs: object) -> None:
        path.write_bytes(b"partial")
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(sf, "write_empty_safetensors", disk_full)
    with pytest.raises(OSError, match="No space"):
        SafetensorsTarget(tmp_path / "out.safetensors").open(specs_of(sample_state()))
    assert list(tmp_path.iterdir()) == []


def test_abort_never_blesses_a_crashed_apply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import weighthub.targets.safetensors_file as sf

    state = sample_state()
    out = tmp_path / "out.safetensors"
    first = SafetensorsTarget(out)
    _fill(first.open(specs_of(state)), state)
    first.commit(HELD)
    first.open(specs_of(state))  # a process marks it "applying", then dies
    monkeypatch.setattr(sf, "write_empty_safetensors", lambda *a: (_ for _ in ()).throw(OSError(28, "full")))
    second = SafetensorsTarget(out)
    with pytest.raises(OSError):
        second.open(specs_of(state))  # re-materializing fails ...
    second.abort()  # ... and the receiver aborts: the mixed bits stay unclaimed
    assert SafetensorsTarget(out).held() is None


def _committed(out: Path, state: dict[str, torch.Tensor]) -> SafetensorsTarget:
    target = SafetensorsTarget(out)
    _fill(target.open(specs_of(state)), state)
    target.commit(HELD)
    return target


def test_foreign_file_is_refused_unless_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    save_file({"mine": torch.ones(3)}, out)  # the user's file: no sidecar beside it
    before = out.read_bytes()
    with pytest.raises(UsageError, match=r"out\.safetensors exists and was not written by weighthub"
                                         r".*--force"):
        SafetensorsTarget(out).held()  # refused at the first question, before any fetch
    with pytest.raises(UsageError, match="not written by weighthub"):
        SafetensorsTarget(out).open(specs_of(sample_state()))
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]
    state = sample_state()
    forced = SafetensorsTarget(out, overwrite=True)
    assert forced.held() is None
    _fill(forced.open(specs_of(state)), state)
    forced.commit(HELD)
    assert SafetensorsTarget(out).held() == HELD and sorted(load_checkpoint(out)) == sorted(state)


@pytest.mark.parametrize("name", ["out.safetensors", "outdir"])
@pytest.mark.parametrize("edit", ["size", "mtime"])
def test_modified_outside_weighthub_is_not_trusted(tmp_path: Path, name: str, edit: str) -> None:
    state = sample_state()
    out = tmp_path / name
    _committed(out, state)
    data = out if out.is_file() else out / "model.safetensors"
    st = data.stat()
    if edit == "size":
        with data.open("ab") as f:
            f.write(b"\0")
    else:  # same size, other bits, written a second later (set explicitly: no clock race)
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 1
        data.write_bytes(bytes(raw))
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(BaseMismatch, match=r"modified outside weighthub after it was pulled to "
                                           r"version 3 \((model|out)\.safetensors: size or mtime"):
        SafetensorsTarget(out).held()
    with pytest.raises(BaseMismatch, match="--force"):
        SafetensorsTarget(out).specs()
    forced = SafetensorsTarget(out, overwrite=True)
    assert forced.held() is None  # holds nothing trusted: rewritten from the store
    _fill(forced.open(specs_of(state)), state)
    forced.commit(HELD)
    assert SafetensorsTarget(out).held() == HELD
    assert np.array_equal(bits(load_checkpoint(out)["a.bf16"]), bits(state["a.bf16"]))


def test_sidecar_without_file_stats_is_trusted_as_before(tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    target = _committed(out, sample_state())
    old = json.loads(target.sidecar.read_bytes())
    del old["files"]  # as written before sidecars recorded sizes and mtimes
    target.sidecar.write_text(json.dumps(old))
    with out.open("ab") as f:
        f.write(b"\0")
    assert SafetensorsTarget(out).held() == HELD
