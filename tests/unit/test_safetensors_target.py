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

from weighthub.errors import BaseMismatch, FormatError, LimitError, TargetBusy, UsageError
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


LOCK = ".weighthub-lock"  # the lock file beside a target stays (deleting it would race)


def _hidden(where: Path) -> list[str]:
    """Hidden files beside a target (temporaries, journals), its lock file aside."""
    return [p.name for p in where.iterdir() if p.name.startswith(".") and not p.name.endswith(LOCK)]


@pytest.mark.parametrize("name", ["out.safetensors", "outdir"])
def test_materialize_then_abort_leaves_nothing(tmp_path: Path, name: str) -> None:
    state = sample_state()
    target = SafetensorsTarget(tmp_path / name)
    views = target.open(specs_of(state))
    _fill(views, state)
    assert len(_hidden(tmp_path)) == 1 and not (tmp_path / name).exists()  # the temporary
    target.abort()
    assert [p.name for p in tmp_path.iterdir()] == [f".{name}{LOCK}"]
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
    assert not _hidden(tmp_path)
    assert SafetensorsTarget(tmp_path / name).held() == HELD
    assert SafetensorsTarget(tmp_path / name).specs() == specs_of(state)


def test_atomic_transaction_changes_nothing_before_commit(tmp_path: Path) -> None:
    state = sample_state()
    out = tmp_path / "out.safetensors"
    _committed(out, state)
    file, sidecar = out.read_bytes(), (tmp_path / "out.safetensors.weighthub.json").read_bytes()
    target = SafetensorsTarget(out, mode="atomic")
    views = target.open(specs_of(state))
    views["b.f32"][:] ^= 1
    assert target.held() == HELD  # its own transaction: what it held when opened
    assert target.peek()["b.f32"][0] == views["b.f32"][0]  # a wrapper's commit reads the new bits
    # a reader ignoring the lock and the sidecar still reads the committed version, whole
    assert out.read_bytes() == file and target.sidecar.read_bytes() == sidecar
    target.abort()
    assert out.read_bytes() == file and target.sidecar.read_bytes() == sidecar
    assert SafetensorsTarget(out).held() == HELD and not _hidden(tmp_path)


def test_in_place_step_is_journaled_before_it_writes_and_abort_claims_the_old_version(
        tmp_path: Path) -> None:
    state = sample_state()
    out = tmp_path / "out.safetensors"
    _committed(out, state)
    file = out.read_bytes()
    target = SafetensorsTarget(out)
    views = target.open(specs_of(state))
    b = views["b.f32"]
    target.journal_step(lambda: [(b[2:10], np.array([1, 5], np.int64)), (views["d.i64"], None)])
    assert json.loads(target.sidecar.read_bytes())["state"] == "applying"
    assert target.journal.exists() and SafetensorsTarget(out).describe().startswith(
        "version 3 (root 111111111111…) being changed: not consistent until")
    old = b.copy()
    b[3] ^= 1  # what the plan said; the engine rolls it back before abort
    b[7] ^= 1
    b[:] = old
    target.abort()
    assert out.read_bytes() == file and not target.journal.exists()
    assert SafetensorsTarget(out).held() == HELD and not _hidden(tmp_path)


@pytest.mark.parametrize("mode", ["in-place", "atomic"])
@pytest.mark.parametrize("name", ["out.safetensors", "outdir"])
def test_update_commits_new_bits_and_claims_them(tmp_path: Path, mode: str, name: str) -> None:
    state = sample_state()
    out = tmp_path / name
    _committed(out, state)
    data = out if out.is_file() else out / "model.safetensors"
    inode = data.stat().st_ino
    target = SafetensorsTarget(out, mode=mode)
    views = target.open(specs_of(state))
    new = {n: t.clone() for n, t in state.items()}
    new["d.i64"][:] = torch.arange(5, dtype=torch.int64) * 7
    new["a.bf16"][3, 2] = 5.0
    _fill(views, new)
    target.commit(Held(HELD.store, HELD.model, 4, "2" * 32))
    assert SafetensorsTarget(out).held() == Held(HELD.store, HELD.model, 4, "2" * 32)
    got = load_checkpoint(out)
    assert all(np.array_equal(bits(got[n]), bits(new[n])) for n in new)
    # atomic: a new file renamed over the old one (readers holding the old one keep it whole)
    assert (data.stat().st_ino != inode) == (mode == "atomic")
    assert not _hidden(tmp_path) and not [p for p in out.parent.rglob(".*.tmp-*")]


def test_second_writer_waits_bounded_then_says_what_the_target_holds(tmp_path: Path) -> None:
    state = sample_state()
    out = tmp_path / "out.safetensors"
    _committed(out, state)
    first = SafetensorsTarget(out)
    first.open(specs_of(state))  # a transaction in progress (another process, or object)
    second = SafetensorsTarget(out, lock_timeout=0.3)
    with pytest.raises(TargetBusy, match=r"out\.safetensors in .* is being changed by another "
                                         r"process \(pid \d+\).*stayed locked for 0\.3s; it holds "
                                         r"version 3 \(root 111111111111…\), consistent; nothing "
                                         r"was changed"):
        second.open(specs_of(state))
    assert second.held() == HELD  # reads need no lock while it is consistent
    first.abort()
    second.open(specs_of(state))  # free again
    second.abort()


def test_legacy_applying_sidecar_is_rematerialized(tmp_path: Path) -> None:
    """A sidecar left "applying" with no journal (a crash of a weighthub without journals)
    claims no version: the next pull writes the file afresh."""
    state = sample_state()
    out = tmp_path / "out.safetensors"
    target = _committed(out, state)
    side = json.loads(target.sidecar.read_bytes())
    target.sidecar.write_text(json.dumps({**side, "state": "applying"}))
    again = SafetensorsTarget(out)
    assert again.held() is None and again.specs() is None
    _fill(again.open(specs_of(state)), state)  # the whole file is written afresh
    again.commit(Held(HELD.store, HELD.model, 4, HELD.root))
    assert SafetensorsTarget(out).held().version == 4
    assert np.array_equal(bits(load_checkpoint(out)["d.i64"]), bits(state["d.i64"]))
    assert not _hidden(tmp_path)


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
    assert [p.name for p in tmp_path.iterdir()] == [".out.safetensors.weighthub-lock"]


def test_abort_never_blesses_a_crashed_apply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import weighthub.targets.safetensors_file as sf

    state = sample_state()
    out = tmp_path / "out.safetensors"
    first = _committed(out, state)
    side = json.loads(first.sidecar.read_bytes())
    first.sidecar.write_text(json.dumps({**side, "state": "applying"}))  # a crash left mixed bits
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
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()
                                           if not p.name.endswith(LOCK)] == ["out.safetensors"]
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


def test_target_modes_bench_runs_at_a_tiny_size(tmp_path: Path) -> None:
    from weighthub.bench.target_modes import measure

    doc = measure(tmp_path, mb=1, changed=0.01, reps=1)
    assert set(doc["modes"]) == {"in-place", "atomic"}
    assert all(m["pause_best_s"] > 0 and m["file_bytes"] > 1 << 20 for m in doc["modes"].values())


def test_crash_journal_cut_short_is_ignored_and_a_corrupt_one_refused(tmp_path: Path) -> None:
    from weighthub.targets.journal import Journal, UndoRecord, read_journal, replay_undo, write_journal

    path = tmp_path / "j"
    data = np.arange(64, dtype=np.uint8)
    recs = [UndoRecord(0, 8, 4, np.array([3, 1], np.int64), np.array([7, 9], np.uint32)),
            UndoRecord(0, 0, 0, None, np.array([5, 6], np.uint8))]
    write_journal(path, Journal("undo", HELD, HELD, ["f"]), recs)
    j = read_journal(path)
    assert j is not None and j.before == HELD and len(j.records) == 2
    replay_undo(j.records, [data])
    assert data[:2].tolist() == [5, 6] and data[8:24].view(np.uint32)[[1, 3]].tolist() == [9, 7]
    raw = path.read_bytes()
    path.write_bytes(raw[:-3])  # cut short: no trailer, so no data byte had changed
    assert read_journal(path) is None
    head = raw.index(b"\n") + 1
    path.write_bytes(raw[:head] + b"\xff" * 21 + raw[head + 21:])  # a record that does not parse
    with pytest.raises(FormatError, match="crash journal does not parse"):
        read_journal(path)
