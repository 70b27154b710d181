"""Canonical tensors: bit views, digests that see every bit, root digests, model checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from weighthub.digest import digest_bits, root_digest, tensor_digest
from weighthub.errors import ModelMismatch, UnknownCodecError, UsageError
from weighthub.tensors import (
    DTYPES,
    TensorSpec,
    bits,
    check_same_model,
    dtype_named,
    dtype_of,
    model_diff,
    specs_of,
)


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_bits_view_writes_through(dtype) -> None:
    t = torch.zeros(3, 4, dtype=dtype.torch_dtype)
    b = bits(t)
    assert b.dtype == dtype.uint and b.shape == (12,)
    b[5] = 1
    assert bits(t)[5] == 1
    assert t.view(-1).view(torch.uint8)[5 * dtype.width] == 1  # little-endian: low byte first
    assert dtype_of(t) is dtype
    assert dtype_named(dtype.name) is dtype
    assert TensorSpec.of("x", t).nbytes == 12 * dtype.width


def test_bits_of_a_non_contiguous_tensor_is_a_copy() -> None:
    t = torch.zeros(4, 4, dtype=torch.float32).t()
    b = bits(t)
    b[0] = 0x3F800000
    assert t.abs().sum() == 0  # writes do not reach a transposed tensor: it must be made contiguous


def test_unsupported_dtype() -> None:
    with pytest.raises(UsageError, match="complex64 is not supported"):
        dtype_of(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(UnknownCodecError, match="unknown dtype 'F4'"):
        dtype_named("F4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_digest_distinguishes_signed_zero_and_nan_payloads(dtype: torch.dtype) -> None:
    pos, neg = torch.zeros(8, dtype=dtype), torch.zeros(8, dtype=dtype)
    neg[3] = -0.0
    assert torch.equal(pos, neg)  # equal as floats...
    assert tensor_digest(pos) != tensor_digest(neg)  # ...not as bits
    a = torch.full((8,), float("nan"), dtype=dtype)
    b = a.clone()
    bits(b)[2] ^= 1  # another NaN payload
    assert torch.isnan(b).all()
    assert tensor_digest(a) != tensor_digest(b)
    assert tensor_digest(a) == tensor_digest(a.clone())


def test_digest_is_the_linear_digest_of_the_words() -> None:
    t = torch.tensor([[1, 2], [3, 258]], dtype=torch.int16)
    words = np.array([1, 2, 3, 258], np.uint16)
    assert tensor_digest(t) == digest_bits(bits(t)) == digest_bits(words)
    assert tensor_digest(t) == digest_bits(words.reshape(2, 2))  # any shape is read row-major
    assert tensor_digest(t) == tensor_digest(t.t().contiguous().t())  # a strided view: same bits
    # same bytes as other words (u8): a different digest, and the root digest differs too
    u = t.view(torch.uint8).reshape(-1)
    assert tensor_digest(u) != tensor_digest(t)
    assert root_digest([(TensorSpec.of("w", t), tensor_digest(t))]) != root_digest(
        [(TensorSpec.of("w", u), tensor_digest(u))])


def test_root_digest_is_independent_of_dict_order_and_sensitive_to_everything() -> None:
    state = {"b": torch.ones(3), "a": torch.zeros(2, 2, dtype=torch.bfloat16), "c": torch.arange(4)}
    entries = [(TensorSpec.of(n, t), tensor_digest(t)) for n, t in state.items()]
    root = root_digest(entries)
    assert root_digest(reversed(entries)) == root
    assert root_digest(sorted(entries, key=lambda e: e[0].name)) == root
    assert len(root) == 16
    renamed = [(TensorSpec("z", s.dtype, s.shape), d) if s.name == "a" else (s, d) for s, d in entries]
    reshaped = [(TensorSpec(s.name, s.dtype, (4,)), d) if s.name == "a" else (s, d) for s, d in entries]
    changed = [(s, bytes(16)) if s.name == "c" else (s, d) for s, d in entries]
    assert len({root, root_digest(renamed), root_digest(reshaped), root_digest(changed)}) == 4


def test_root_digest_spec_formula() -> None:
    t = torch.tensor([1.0, 2.0])
    spec = TensorSpec.of("layer.w", t)
    h = xxhash.xxh3_128()
    h.update(b"layer.w")
    h.update(b"\0F32\0")
    h.update(np.array([2], "<i8").tobytes())
    h.update(tensor_digest(t))
    assert root_digest([(spec, tensor_digest(t))]) == h.digest()


def test_specs_of_sorts_by_name() -> None:
    specs = specs_of({"b": torch.zeros(1), "a": torch.zeros(2, 3, dtype=torch.int64)})
    assert [s.name for s in specs] == ["a", "b"]
    assert specs[0].shape == (2, 3) and specs[0].dtype.name == "I64" and specs[0].numel == 6


def test_check_same_model_messages() -> None:
    exp = specs_of({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16), "c": torch.zeros(1)})
    check_same_model(exp, list(exp), "the target")  # equal: no error
    got = specs_of({"a": torch.zeros(3, 2), "b": torch.zeros(4), "d": torch.zeros(1)})
    with pytest.raises(ModelMismatch) as info:
        check_same_model(exp, got, "the published state")
    msg = str(info.value)
    assert msg.startswith("the published state does not match the store's model")
    # which side lacks a name is said, not left to guess from "missing"/"unexpected"
    assert "missing from the published state: ['c']" in msg
    assert "not in the model: ['d']" in msg
    assert "'a': shape [3, 2], the model has [2, 3]" in msg
    assert "'b': dtype F32, the model has BF16" in msg
    many = specs_of({f"t{i}": torch.zeros(1) for i in range(8)})
    with pytest.raises(ModelMismatch, match=r"missing from x: \['t0', 't1', 't2', 't3', 't4'\] …"):
        check_same_model(many, [], "x")
    with pytest.raises(ModelMismatch, match="another order"):  # indices would not line up
        check_same_model(exp, list(reversed(exp)), "x")


def test_model_diff_kinds() -> None:
    exp = specs_of({"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2), "d": torch.zeros(1)})
    got = specs_of({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.bfloat16),
                    "c": torch.zeros(3, dtype=torch.int8), "e": torch.zeros(1)})
    diff = model_diff(exp, got)
    assert (diff.missing, diff.unexpected) == (["d"], ["e"])
    assert [(e.name, g.dtype.name) for e, g in diff.changed] == [("b", "BF16"), ("c", "I8")]
    assert diff.phrases("CKPT", "version 3") == [
        "missing from CKPT: ['d']", "not in version 3: ['e']",
        "'b': dtype BF16, version 3 has F32", "'c': I8[3], version 3 has F32[2]"]
    assert diff.phrases("CKPT", "v", limit=1)[-1] == "1 more with another dtype or shape"
    assert not model_diff(exp, exp) and not model_diff(exp, exp).phrases("x", "y")
