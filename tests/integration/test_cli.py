"""The `weighthub` command line end to end: publish, pull, verify, inspect, and hostile inputs.

Most tests call `weighthub.cli.main` in-process (fast); a few run a real subprocess to check exit
codes and that errors are one line on stderr without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from deadlines import PROCESS_S
from safetensors.torch import load_file, save_file

import weighthub
import weighthub.demo
from weighthub import catalog, cli
from weighthub.cli import build_parser, main
from weighthub.cliargs import LazyParser
from weighthub.store import open_store
from weighthub.targets.safetensors_file import DIR_DATA_FILE
from weighthub.tensors import bits


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(96, 32, generator=g).bfloat16(),
        "layers.0.mlp.weight": torch.randn(64, 48, generator=g).bfloat16(),
        "layers.0.norm.weight": torch.randn(48, generator=g),  # F32
        "layers.0.attn.weight": torch.randn(16, 16, generator=g).half(),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A small RL-like update: ~2% of words move by ±1 ulp (on the integer view)."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        if t.is_floating_point():
            flat = t.view(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])
            mask = torch.rand(flat.shape, generator=g) < 0.02
            delta = torch.where(torch.rand(flat.shape, generator=g) < 0.5, 1, -1).to(flat.dtype)
            flat[mask] += delta[mask]
        else:
            t += 1
        out[name] = t
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        and np.array_equal(bits(a[n].contiguous()), bits(b[n].contiguous())) for n in a)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("weighthub: error: ") and "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under a path (or the file and its sidecar), by name, with its bytes."""
    if path.is_dir():
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))}
    return {p.name: p.read_bytes() for p in sorted(path.parent.glob(path.name + "*"))}


@pytest.fixture
def history(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A store with versions 0..2 published through the CLI, and their checkpoints."""
    store = tmp_path / "store"
    states = [make_state()]
    states += [step(states[-1], 1)]
    states += [step(states[-1], 2)]
    ckpts = []
    for i, s in enumerate(states):
        ckpts.append(tmp_path / f"ckpt{i}.safetensors")
        save_file(s, ckpts[-1])
    for c in ckpts:
        assert run(capsys, "publish", store, c)[0] == 0
    return store, states, ckpts


def test_publish_full_then_deltas_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    s0 = make_state()
    s1 = step(s0, 1)
    save_file(s0, tmp_path / "a.safetensors")
    ckdir = tmp_path / "ckdir"  # a directory of safetensors files is one checkpoint
    ckdir.mkdir()
    names = sorted(s1)
    save_file({n: s1[n] for n in names[:2]}, ckdir / "part-0.safetensors")
    save_file({n: s1[n] for n in names[2:]}, ckdir / "part-1.safetensors")

    code, out, _ = run(capsys, "publish", f"file://{store}", tmp_path / "a.safetensors", "--json")
    assert code == 0
    doc = json.loads(out)
    assert {"version", "base", "dense_bytes", "payload_bytes", "changed_fraction", "seconds",
            "chunks"} <= set(doc)
    assert (doc["version"], doc["base"], doc["changed_fraction"]) == (0, None, 1.0)

    code, out, _ = run(capsys, "publish", store, ckdir, "--json")
    doc = json.loads(out)
    assert code == 0 and (doc["version"], doc["base"]) == (1, 0)
    assert 0 < doc["changed_fraction"] < 0.2 and doc["payload_bytes"] < doc["dense_bytes"] / 4

    code, out, _ = run(capsys, "publish", store, tmp_path / "a.safetensors")  # readable line
    assert code == 0 and "version 2" in out and "delta from 1" in out
    assert catalog.list_versions(open_store(str(store))) == [0, 1, 2]


@pytest.mark.parametrize("out_name", ["out.safetensors", "outdir"])
def test_pull_materializes_then_updates_in_place(
        history, tmp_path: Path, capsys: pytest.CaptureFixture[str], out_name: str) -> None:
    store, states, _ = history
    out = tmp_path / out_name
    code, text, _ = run(capsys, "pull", store, out, "--version", 0, "--json")
    doc = json.loads(text)
    assert code == 0 and (doc["version"], doc["from_version"]) == (0, None)
    assert {"bytes_fetched", "seconds", "route", "stage_seconds", "apply_seconds"} <= set(doc)
    assert same_bits(load_file(out if out.is_file() else out / "model.safetensors"), states[0])
    data = out if out.is_file() else out / "model.safetensors"
    inode = data.stat().st_ino

    for v in (1, 2):  # one delta at a time, applied in place
        code, text, _ = run(capsys, "pull", store, out, "--version", v, "--json")
        doc = json.loads(text)
        assert code == 0 and (doc["version"], doc["from_version"]) == (v, v - 1)
        assert doc["route"] == [f"{catalog.version_dir(v)}/manifest.json"]
        assert same_bits(load_file(data), states[v])
    assert data.stat().st_ino == inode  # updated in place, not rewritten

    code, text, _ = run(capsys, "pull", store, out)  # already at the latest
    assert code == 0 and "already holds version 2" in text
    assert run(capsys, "verify", store, out)[0] == 0


def test_pull_older_version_into_fresh_path(history, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    store, states, _ = history
    out = tmp_path / "old.safetensors"
    code, text, _ = run(capsys, "pull", store, out, "--version", 1, "--json")
    assert code == 0 and json.loads(text)["version"] == 1
    assert same_bits(load_file(out), states[1])
    assert run(capsys, "verify", store, out, "--version", 1)[0] == 0
    assert run(capsys, "verify", store, out)[0] == 1  # latest is 2


def test_pull_back_to_an_older_version_undoes_deltas(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`--encode fast` deltas (xor/add, gap positions) are invertible: rolling a file back from
    version 3 to 1 fetches those two deltas, not the full version."""
    store = tmp_path / "store"
    states = [make_state()]
    for v in range(1, 4):
        states.append(step(states[-1], v))
    for v, s in enumerate(states):
        save_file(s, tmp_path / f"c{v}.safetensors")
        assert run(capsys, "publish", store, tmp_path / f"c{v}.safetensors", "--encode", "fast")[0] == 0
    out = tmp_path / "out.safetensors"
    assert run(capsys, "pull", store, out)[0] == 0
    code, text, _ = run(capsys, "pull", store, out, "--version", 1, "--json")
    doc = json.loads(text)
    assert code == 0 and (doc["version"], doc["from_version"], doc["backward"]) == (1, 3, True)
    assert doc["route"] == [f"{catalog.version_dir(v)}/manifest.json (inverse)" for v in (3, 2)]
    full = catalog.primary_manifest(open_store(str(store)), 0).payload_bytes
    assert doc["bytes_fetched"] < full / 4
    assert same_bits(load_file(out), states[1])
    code, text, _ = run(capsys, "pull", store, out, "--version", 0)
    assert code == 0 and "rolled back through inverse deltas" in text
    assert same_bits(load_file(out), states[0])


def test_publish_frame_version_1_for_old_receivers(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`--frame-version 1` writes every chunk in version 1 (what a weighthub that reads only
    version 1 accepts), the default version 2; a pull reads both, to the same bits."""
    states = [make_state(), step(make_state(), 1)]
    heads: dict[int, set[int]] = {}
    for fv in (1, 2):
        store = tmp_path / f"store{fv}"
        for v, s in enumerate(states):
            save_file(s, tmp_path / f"c{v}.safetensors")
            extra = ("--frame-version", "1") if fv == 1 else ()
            assert run(capsys, "publish", store, tmp_path / f"c{v}.safetensors", *extra)[0] == 0
        heads[fv] = {int.from_bytes(f.read_bytes()[4:6], "little") for f in store.rglob("*.whc")}
        assert run(capsys, "pull", store, tmp_path / f"out{fv}.safetensors")[0] == 0
        assert same_bits(load_file(tmp_path / f"out{fv}.safetensors"), states[1])
    assert heads == {1: {1}, 2: {2}}
    with pytest.raises(SystemExit) as exc:
        run(capsys, "publish", tmp_path / "store3", tmp_path / "c0.safetensors", "--frame-version", 3)
    assert exc.value.code == 2 and "--frame-version" in capsys.readouterr().err
    assert not (tmp_path / "store3").exists()


def test_verify_ok_and_mismatch(history, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, states, ckpts = history
    code, out, _ = run(capsys, "verify", store, ckpts[2])
    assert code == 0 and "bit-identical" in out
    assert run(capsys, "verify", store, ckpts[0], "--version", 0)[0] == 0

    bad = {n: t.clone() for n, t in states[2].items()}
    bad["layers.0.norm.weight"].view(torch.int32)[3] ^= 1  # one bit of one word
    save_file(bad, tmp_path / "bad.safetensors")
    code, out, _ = run(capsys, "verify", store, tmp_path / "bad.safetensors")
    assert code == 1 and "layers.0.norm.weight" in out and "embed.weight" not in out

    # -0.0 vs +0.0 are equal as floats but not as bits
    zero = {n: t.clone() for n, t in states[2].items()}
    zero["embed.weight"].view(-1)[0] = 0.0
    save_file(zero, tmp_path / "z.safetensors")
    zero["embed.weight"].view(-1)[0] = -0.0
    save_file(zero, tmp_path / "nz.safetensors")
    run(capsys, "publish", store, tmp_path / "z.safetensors")
    assert run(capsys, "verify", store, tmp_path / "z.safetensors")[0] == 0
    code, out, _ = run(capsys, "verify", store, tmp_path / "nz.safetensors")
    assert code == 1 and "embed.weight" in out

    renamed = {("x." + n if n == "step" else n): t for n, t in states[2].items()}
    save_file(renamed, tmp_path / "renamed.safetensors")
    code, out, _ = run(capsys, "verify", store, tmp_path / "renamed.safetensors", "--version", 2)
    assert code == 1 and "x.step" in out and "step" in out


def test_inspect_json(history, capsys: pytest.CaptureFixture[str]) -> None:
    store, states, _ = history
    code, out, _ = run(capsys, "inspect", store, "--json")
    doc = json.loads(out)
    assert code == 0 and [v["version"] for v in doc["versions"]] == [0, 1, 2]
    v0, v1 = doc["versions"][0], doc["versions"][1]
    assert v0["base"] is None and v0["changed_fraction"] == 1.0
    assert v1["base"] == 0 and 0 < v1["changed_fraction"] < 0.2
    assert [r["base"] for r in v1["representations"]] == [0]
    assert v1["payload_bytes"] < v1["dense_bytes"]

    code, out, _ = run(capsys, "inspect", store, "--version", 1, "--json")
    (v,) = json.loads(out)["versions"]
    by_name = {t["name"]: t for t in v["tensors"]}
    assert sorted(by_name) == sorted(states[1])
    assert by_name["step"]["changed_fraction"] == 1.0
    assert all(t["ops"] for t in v["tensors"])  # every tensor changed in this history
    code, out, _ = run(capsys, "inspect", store, "--version", 1)
    assert code == 0 and "embed.weight" in out


def test_publish_of_another_model_is_refused(history, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    store, states, _ = history
    other = {("renamed." + n): t for n, t in states[2].items()}
    save_file(other, tmp_path / "other.safetensors")
    before = catalog.list_versions(open_store(str(store)))
    code, _, err = run(capsys, "publish", store, tmp_path / "other.safetensors")
    assert code == 3
    assert_one_line_error(err, "ModelMismatch", "renamed.")
    assert catalog.list_versions(open_store(str(store))) == before
    assert not any(p.name.startswith(catalog.version_dir(3)) for p in store.iterdir())


def test_bad_paths(history, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, _, ckpts = history
    code, _, err = run(capsys, "publish", store, tmp_path / "missing.safetensors")
    assert code == 2
    assert_one_line_error(err, "missing.safetensors", "does not exist")

    as_file = tmp_path / "store-is-a-file"
    as_file.write_bytes(b"x")
    code, _, err = run(capsys, "publish", as_file, ckpts[0])
    assert code == 2
    assert_one_line_error(err, "store-is-a-file", "not a directory")

    code, _, err = run(capsys, "publish", "/proc/weighthub-test/store", ckpts[0])
    assert code == 3
    assert_one_line_error(err, "/proc/weighthub-test")

    code, _, err = run(capsys, "pull", "ftp://bucket/x", tmp_path / "o.safetensors")
    assert code == 2
    assert_one_line_error(err, "s3")

    (tmp_path / "empty-store").mkdir()
    code, _, err = run(capsys, "pull", tmp_path / "empty-store", tmp_path / "o.safetensors")
    assert code == 3
    assert_one_line_error(err, "no committed version")
    assert not (tmp_path / "o.safetensors").exists()

    for argv in (["pull", tmp_path / "typo", tmp_path / "o.safetensors"],
                 ["inspect", tmp_path / "typo"], ["verify", f"file://{tmp_path}/typo", ckpts[0]]):
        code, _, err = run(capsys, *argv)
        assert code == 2
        assert_one_line_error(err, "typo", "does not exist")
    assert not (tmp_path / "typo").exists()  # read-only commands create no store

    (tmp_path / "o.bin").write_bytes(b"x")  # not .safetensors: a directory OUT, but a file
    code, _, err = run(capsys, "pull", store, tmp_path / "o.bin")
    assert code == 3
    assert_one_line_error(err, "o.bin")
    code, _, err = run(capsys, "pull", store, "/proc/weighthub-test/o.safetensors")
    assert code == 3
    assert_one_line_error(err, "/proc/weighthub-test")


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["pull", "only-store"], ["publish", "s", "c", "--retain", "x"], ["frob"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    capsys.readouterr()


def _pulled_at_1(history, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str):
    store = history[0]
    out = tmp_path / name
    assert run(capsys, "pull", store, out, "--version", 1)[0] == 0
    return store, out, snapshot(out)


def _v2_chunks(store: Path) -> list[Path]:
    chunks = sorted((store / catalog.version_dir(2)).rglob("*.whc"))
    assert chunks
    return chunks


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_damaged_chunk_leaves_out_untouched(history, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str], damage: str) -> None:
    store, out, before = _pulled_at_1(history, tmp_path, capsys, "out.safetensors")
    chunk = _v2_chunks(store)[0]
    if damage == "flip":
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        chunk.write_bytes(bytes(raw))
    else:
        chunk.unlink()
    code, _, err = run(capsys, "pull", store, out)
    assert code == 3
    assert_one_line_error(err, *(["ChecksumError", "corrupt"] if damage == "flip"
                                 else ["ObjectNotFound", chunk.name]))
    assert snapshot(out) == before
    fresh = tmp_path / "fresh"  # a materializing pull fails the same way and leaves nothing
    assert run(capsys, "pull", store, fresh)[0] == 3
    assert not fresh.exists() and not list(tmp_path.glob(".fresh*"))


def test_garbage_manifest_is_a_clear_error(history, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    store, out, before = _pulled_at_1(history, tmp_path, capsys, "out.safetensors")
    manifest = store / catalog.version_dir(2) / catalog.PRIMARY
    manifest.write_bytes(manifest.read_bytes()[:57])
    code, _, err = run(capsys, "inspect", store, "--version", 2)
    assert code == 3
    assert_one_line_error(err, "FormatError", "manifest.json")
    code, _, err = run(capsys, "pull", store, out, "--version", 2)
    assert code == 3
    assert_one_line_error(err, "FormatError", "manifest.json")
    assert snapshot(out) == before
    code, _, err = run(capsys, "pull", store, tmp_path / "fresh")  # latest is the broken one
    assert code == 3
    assert_one_line_error(err, "FormatError", "not valid JSON")
    assert not (tmp_path / "fresh").exists()


def test_pull_of_missing_version(history, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, _, _ = history
    out = tmp_path / "o.safetensors"
    code, _, err = run(capsys, "pull", store, out, "--version", 7)
    assert code == 3
    assert_one_line_error(err, "VersionNotFound", "version 7")
    assert not out.exists()
    code, _, err = run(capsys, "verify", store, history[2][0], "--version", 7)
    assert code == 3
    assert_one_line_error(err, "version 7")


@pytest.mark.parametrize("name", ["out.safetensors", "outdir"])
def test_out_modified_behind_weighthubs_back(history, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str], name: str) -> None:
    store, out, _ = _pulled_at_1(history, tmp_path, capsys, name)
    data = out if out.is_file() else out / "model.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x01  # one bit of the last tensor's data
    data.write_bytes(bytes(raw))
    before = snapshot(out)
    code, _, err = run(capsys, "pull", store, out)
    assert code == 3
    assert_one_line_error(err, "BaseMismatch", "modified outside weighthub")
    assert snapshot(out) == before


def test_non_empty_directory_without_version_is_refused(
        history, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, _, _ = history
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "pull", store, out)
    assert code == 2
    assert_one_line_error(err, "non-empty directory")
    assert snapshot(out) == {"notes.txt": b"mine"}


def test_demo_is_forwarded_lazily(monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    seen = {}
    fake = types.ModuleType("weighthub.demo.run")
    fake.main = lambda args: seen.update(vars(args)) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "weighthub.demo.run", fake)
    monkeypatch.setattr(weighthub.demo, "run", fake, raising=False)
    assert main(["demo", "--steps", "3", "--lr", "1e-4", "--json", "s.json"]) == 0
    assert (seen["steps"], seen["receivers"], seen["lr"], seen["seed"], seen["json"]) == \
        (3, 2, 1e-4, 0, "s.json")
    assert seen["store"] is None

    monkeypatch.setitem(sys.modules, "weighthub.demo.run", None)  # import now fails
    monkeypatch.delattr(weighthub.demo, "run")
    code, _, err = run(capsys, "demo")
    assert code == 2
    assert_one_line_error(err, "demo is not available")


def _cli(*argv: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run([sys.executable, "-m", "weighthub.cli", *map(str, argv)],
                          capture_output=True, text=True, timeout=PROCESS_S, env=env)


def test_subprocess_exit_codes_and_one_line_errors(history, tmp_path: Path) -> None:
    store, _, ckpts = history
    # each run pays the torch/numba import (~2 s): three cover exit codes 1, 2 and 3
    p = _cli("verify", store, ckpts[1])
    assert p.returncode == 1 and "embed.weight" in p.stdout
    p = _cli("publish", store, tmp_path / "nope.safetensors")
    assert p.returncode == 2 and p.stdout == ""
    assert_one_line_error(p.stderr, "nope.safetensors")
    p = _cli("pull", store, tmp_path / "o.safetensors", "--version", 99)
    assert p.returncode == 3
    assert_one_line_error(p.stderr, "VersionNotFound")


# --- start-up: what the CLI imports -----------------------------------------------------------

_IMPORTS_PROBE = """
import contextlib, io, json, sys
from weighthub.cli import main
seen = {}
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    seen[" ".join(argv)] = [code, sorted(m for m in ("torch", "numba") if m in sys.modules)]
import weighthub.publish  # the control: a module that does need them
seen["control"] = [0, sorted(m for m in ("torch", "numba") if m in sys.modules)]
print(json.dumps(seen))
"""


def test_help_inspect_and_usage_errors_do_not_import_torch_or_numba(history) -> None:
    """Their imports cost seconds per process (~4.5 s measured, before they were made lazy);
    `--help`, `inspect` (manifests only) and argument errors need neither. Checked in a fresh
    process, by sys.modules, not by timing."""
    store = str(history[0])
    argvs = [["--help"], ["--version"], ["inspect", store], ["inspect", store, "--version", "1", "--json"],
             ["pull", store, "o.safetensors", "--version", "-1"], ["publish", "--help"],
             ["serve", "--help"], ["serve", "hub", "--help"], ["bench", "--help"]]
    p = subprocess.run([sys.executable, "-c", _IMPORTS_PROBE, json.dumps(argvs)], capture_output=True,
                       text=True, timeout=PROCESS_S)
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout)
    assert seen.pop("control") == [0, ["numba", "torch"]]  # the probe does see them when imported
    assert seen == {" ".join(a): [2 if "-1" in a else 0, []] for a in argvs}


# --- usage errors, messages, help -------------------------------------------------------------

def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"weighthub {weighthub.__version__}"


@pytest.mark.parametrize("value", ["-1", "x"])
def test_bad_version_numbers_are_usage_errors(history, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              value: str) -> None:
    store, _, ckpts = history
    out = tmp_path / "o.safetensors"
    for argv in (["pull", store, out], ["verify", store, ckpts[0]], ["inspect", store]):
        with pytest.raises(SystemExit) as info:
            main([*map(str, argv), "--version", value])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "argument --version" in err
        assert ("numbered from 0" if value == "-1" else "not a version") in err
        assert "have none" not in err
    assert not out.exists()


def test_non_safetensors_input_is_a_usage_error(history, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    store = history[0]
    before = catalog.list_versions(open_store(str(store)))
    (tmp_path / "model.bin").write_bytes(b"\x80\x02}q\x00." * 100)  # e.g. a pickled torch file
    for command in ("publish", "verify"):
        code, _, err = run(capsys, command, store, tmp_path / "model.bin")
        assert code == 2
        assert_one_line_error(err, "model.bin is not a safetensors file")
        assert "LimitError" not in err
    assert catalog.list_versions(open_store(str(store))) == before


def test_verify_says_how_tensors_differ(history, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, states, _ = history
    fp32 = {n: (t.float() if n == "embed.weight" else t) for n, t in states[2].items()}
    save_file(fp32, tmp_path / "fp32.safetensors")
    code, out, _ = run(capsys, "verify", store, tmp_path / "fp32.safetensors")
    assert code == 1
    assert "in 1 tensor(s): 'embed.weight': dtype F32, version 2 has BF16" in out

    renamed = {("x." + n if n == "step" else n): t for n, t in states[2].items()}
    renamed["layers.0.norm.weight"] = renamed["layers.0.norm.weight"].clone()
    renamed["layers.0.norm.weight"].view(torch.int32)[0] ^= 1
    save_file(renamed, tmp_path / "renamed.safetensors")
    code, out, _ = run(capsys, "verify", store, tmp_path / "renamed.safetensors")
    assert code == 1 and len(out.strip().splitlines()) == 1
    assert "in 3 tensor(s): missing from the checkpoint: ['step']; not in version 2: ['x.step']; " \
           "other bits: ['layers.0.norm.weight']" in out


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("weighthub",)):
    """Every parser of the command line (lazy subcommands filled in), with its command path."""
    if isinstance(parser, LazyParser):
        parser.populate()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                assert helps.get(name), f"{' '.join(path)} {name} has no help line"
                yield from _parsers(sub, (*path, name))


def test_every_argument_has_a_help_line() -> None:
    missing = [f"{' '.join(path)} {'/'.join(a.option_strings) or a.dest}"
               for path, p in _parsers(build_parser()) for a in p._actions
               if not isinstance(a, argparse._HelpAction | argparse._VersionAction)
               and (not a.help or a.help == argparse.SUPPRESS)]
    assert missing == []


def test_help_texts(capsys: pytest.CaptureFixture[str]) -> None:
    def usage(*argv: str) -> str:
        with pytest.raises(SystemExit) as info:
            main([*argv, "--help"])
        assert info.value.code == 0
        return capsys.readouterr().out

    bench = usage("bench")
    head = bench.split("\n\n")[0]
    assert "[SUITE] ..." in head and not re.search(r"(?<!\[)SUITE(?!\])", head)  # optional
    assert "--hub HOST:PORT" in usage("serve", "node")  # a lazy subcommand still has its help
    pull = " ".join(usage("pull").split())
    # the directory layout is documented where users look (and kept equal to the target's)
    assert cli._DIR_DATA_FILE == DIR_DATA_FILE
    assert f"A directory OUT gets one file, {DIR_DATA_FILE}, whatever files the checkpoint was " \
           "published from" in pull and "--force" in pull


# --- pull into paths weighthub did not write, or that changed since ----------------------------

def test_pull_refuses_a_file_weighthub_did_not_write(history, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    store, states, _ = history
    out = tmp_path / "mine.safetensors"
    save_file({"notes": torch.ones(4)}, out)
    before = snapshot(out)
    code, _, err = run(capsys, "pull", store, out)
    assert code == 2
    assert_one_line_error(err, "mine.safetensors exists and was not written by weighthub", "--force")
    assert snapshot(out) == before
    code, text, _ = run(capsys, "pull", store, out, "--force")
    assert code == 0 and "pulled" in text and same_bits(load_file(out), states[2])
    code, text, _ = run(capsys, "pull", store, out)
    assert code == 0 and "already holds version 2" in text


@pytest.mark.parametrize("name", ["out.safetensors", "outdir"])
def test_pull_notices_edits_outside_weighthub_at_the_same_version(
        history, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    store, out, _ = _pulled_at_1(history, tmp_path, capsys, name)
    states = history[1]
    data = out if out.is_file() else out / DIR_DATA_FILE
    st = data.stat()
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x01  # one bit of the last tensor's data; same size
    data.write_bytes(bytes(raw))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # an edit a second later
    before = snapshot(out)
    code, _, err = run(capsys, "pull", store, out, "--version", 1)  # the version it claims to hold
    assert code == 3
    assert_one_line_error(err, "BaseMismatch", "modified outside weighthub", "version 1", "--force")
    assert snapshot(out) == before
    code, text, _ = run(capsys, "pull", store, out, "--version", 1, "--force")
    assert code == 0 and "from nothing to version 1" in text
    assert same_bits(load_file(data), states[1])
    assert run(capsys, "verify", store, out, "--version", 1)[0] == 0


def test_pull_into_a_directory_writes_one_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = make_state()
    shards = tmp_path / "shards"
    shards.mkdir()
    names = sorted(state)
    save_file({n: state[n] for n in names[:2]}, shards / "model-00001-of-00002.safetensors")
    save_file({n: state[n] for n in names[2:]}, shards / "model-00002-of-00002.safetensors")
    assert run(capsys, "publish", tmp_path / "store", shards)[0] == 0
    code, text, _ = run(capsys, "pull", tmp_path / "store", tmp_path / "out")
    assert code == 0 and f"pulled {tmp_path / 'out' / DIR_DATA_FILE} from nothing" in text
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [DIR_DATA_FILE, "weighthub.json"]
    assert same_bits(load_file(tmp_path / "out" / DIR_DATA_FILE), state)
