"""LoGRA (weighthub.train): bad input, skipped steps, hooks, learning, compact sync, KL control.

Everything runs on a tiny random Llama (2 layers, hidden 32) with a policy-gradient-style loss
written here: -mean(advantage · log π(token)) over fixed sequences, so the tests are offline,
deterministic and take seconds.
"""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
import xxhash

from weighthub.digest import tensor_digest
from weighthub.errors import BaseMismatch, ChecksumError, FormatError, IntegrityError, UsageError
from weighthub.train import (
    CompactReceiver,
    KLProbe,
    LoGRA,
    apply_low_rank,
    encode_update,
    parse_update,
    rademacher,
    split_params,
)

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 12


def tiny_lm(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).float()


def batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (n, SEQ), generator=g)
    reward = (ids[:, SEQ // 2:] < VOCAB // 4).float().mean(1)  # reward: "small" tokens completed
    return ids, reward - reward.mean()  # GRPO-style group-centred advantage


def pg_loss(model: torch.nn.Module, ids: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits[:, SEQ // 2 - 1:-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, SEQ // 2:, None]).squeeze(-1)
    return -(adv[:, None] * logp).mean()


def make(model: torch.nn.Module, **kw) -> LoGRA:
    sketched, dense = split_params(model)
    kw.setdefault("rank", 4)
    kw.setdefault("lr", 1e-3)
    return LoGRA(sketched, dense, **kw)


def probe(model: torch.nn.Module) -> KLProbe:
    ids, _ = batch(99, 4)
    return KLProbe(model, ids)


def int_bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().view(torch.int32).clone() for n, p in model.named_parameters()}


# -- bad input ---------------------------------------------------------------------------------

def test_rank_larger_than_a_dimension_is_refused():
    m = tiny_lm()
    with pytest.raises(UsageError, match=r"rank 17 exceeds min\(m, n\) = 16 of .*k_proj"):
        make(m, rank=17)


def test_non_2d_parameter_in_sketched_group_is_refused():
    m = tiny_lm()
    norm = ("model.norm.weight", m.model.norm.weight)
    with pytest.raises(UsageError, match="only 2-D weights can be sketched"):
        LoGRA([norm], rank=1)


@pytest.mark.parametrize("target", [0.0, -1e-3, math.nan, math.inf])
def test_kl_target_must_be_positive_and_finite(target):
    with pytest.raises(UsageError, match="kl_target must be a finite KL > 0"):
        make(tiny_lm(), kl_target=target)


def test_parameter_in_both_groups_and_non_fp32_are_refused():
    m = tiny_lm()
    q = ("q", m.model.layers[0].self_attn.q_proj.weight)
    with pytest.raises(UsageError, match="listed twice"):
        LoGRA([q], [q], rank=2)
    w = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16))
    with pytest.raises(UsageError, match="fp32 master"):
        LoGRA([("w", w)], rank=2)


def test_kl_target_without_probe_is_a_usage_error_at_step():
    m = tiny_lm()
    opt = make(m, kl_target=0.01)
    pg_loss(m, *batch(0)).backward()
    with pytest.raises(UsageError, match="no kl_probe"):
        opt.step()


# -- skipped steps, hooks ----------------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_gradient_skips_the_step_and_leaves_bits_untouched(bad):
    m = tiny_lm()
    opt = make(m, record_updates=True)
    pg_loss(m, *batch(0)).backward()
    opt.step()  # one real step, so moments are non-zero
    before = int_bits(m)
    moments = {id(p): opt.state[p]["M"].clone() for p in opt.sketched}
    loss = pg_loss(m, *batch(1))
    loss.backward()
    m.model.norm.weight.grad[3] = bad  # a dense parameter's gradient goes bad
    stats = opt.step()
    assert not stats.applied and "model.norm.weight" in (stats.skipped_reason or "")
    assert opt.history[-1] is stats and opt.applied_steps == 1
    after = int_bits(m)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(torch.equal(moments[id(p)], opt.state[p]["M"]) for p in opt.sketched)
    assert all(float(opt.state[p]["S"].abs().sum()) == 0 for p in opt.sketched)  # cleared
    pg_loss(m, *batch(2)).backward()
    assert opt.step().applied  # and training goes on


def test_nonfinite_gradient_in_a_sketched_weight_is_caught_through_the_sketch():
    m = tiny_lm()
    opt = make(m)
    q = m.model.layers[1].self_attn.q_proj.weight
    q.register_hook(lambda g: g.index_fill(0, torch.tensor([2]), math.nan))
    before = int_bits(m)
    pg_loss(m, *batch(0)).backward()
    stats = opt.step()
    assert not stats.applied and "layers.1.self_attn.q_proj" in (stats.skipped_reason or "")
    assert all(torch.equal(before[n], v) for n, v in int_bits(m).items())


def test_hook_folds_gradients_and_leaves_no_dense_grad_for_sketched_weights():
    m = tiny_lm()
    opt = make(m)
    pg_loss(m, *batch(0)).backward()
    pg_loss(m, *batch(1)).backward()  # a second microbatch accumulates into the sketch
    assert all(p.grad is None for p in opt.sketched)
    assert all(p.grad is not None for p in opt.dense)
    assert all(float(opt.state[p]["S"].abs().sum()) > 0 for p in opt.sketched)
    rep = opt.memory_report()
    assert rep["sketched_total"] <= 0.6 * rep["adamw_equivalent_sketched"]  # ≥ 40% less
    assert rep["peak_transient_grad"] == max(p.nbytes for p in opt.sketched)


# -- learning ----------------------------------------------------------------------------------

def test_logra_reduces_a_policy_gradient_loss():
    m = tiny_lm()
    opt = make(m, rank=8, lr=3e-3, refresh_every=10)
    ids, adv = batch(0, 16)
    first = float(pg_loss(m, ids, adv).detach())
    for _ in range(30):
        pg_loss(m, ids, adv).backward()
        opt.step()
    assert float(pg_loss(m, ids, adv).detach()) < first - 0.05
    assert opt.epoch == 3


def test_logra_solves_a_low_rank_regression():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(32, 48))
    target = torch.randn(32, 2) @ torch.randn(2, 48)
    x = torch.randn(256, 48)
    opt = LoGRA([("w", w)], rank=8, lr=3e-2, refresh_every=5)

    def loss() -> torch.Tensor:
        return ((x @ w.t() - x @ target.t()) ** 2).mean()

    first = float(loss().detach())
    for _ in range(200):
        loss().backward()
        opt.step()
    # a random rank-8 sketch of a 48-wide gradient is noisy: AdamW reaches ~1% here, LoGRA ~9%
    assert float(loss().detach()) < 0.15 * first


# -- compact sync ------------------------------------------------------------------------------

def test_reconstruction_is_fixed_order_and_thread_count_independent():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 1000, generator=g)
    u = torch.randn(300, 12, generator=g)
    p = rademacher(7, "w", 0, 1000, 12)
    outs = []
    threads = torch.get_num_threads()
    for n in (1, max(2, threads)):
        torch.set_num_threads(n)
        x = w.clone()
        apply_low_rank(x, u, p, coef=-1e-3, decay=0.999)
        outs.append(x.view(torch.int32))
    torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(rademacher(7, "w", 0, 1000, 12), p)  # projections are reproducible
    assert not torch.equal(rademacher(7, "w", 1, 1000, 12), p)
    assert p.abs().unique().numel() == 1 and p.unique().numel() == 2  # ±1/√r only


@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16])
def test_compact_payload_replays_bit_exactly_on_two_receivers(update_dtype):
    m = tiny_lm()
    opt = make(m, rank=4, lr=1e-3, weight_decay=0.1, refresh_every=2, update_dtype=update_dtype,
               record_updates=True, kl_target=1e-4, kl_probe=probe(m))
    initial = {n: p.detach().clone() for n, p in m.named_parameters()}
    receivers = [CompactReceiver({n: t.clone() for n, t in initial.items()}) for _ in range(2)]
    for step in range(4):
        pg_loss(m, *batch(step)).backward()
        assert opt.step().applied
        payload = encode_update(opt.last_update)
        for r in receivers:
            assert r.apply(payload)["sketch"] == len(opt.sketched)
    trainer = {n: tensor_digest(p.detach()) for n, p in m.named_parameters()}
    for r in receivers:
        assert {n: tensor_digest(t) for n, t in r.masters.items()} == trainer
        assert all(torch.equal(r.bf16_state()[n].view(torch.int16),
                               p.detach().to(torch.bfloat16).view(torch.int16))
                   for n, p in m.named_parameters())


def _first_step() -> tuple[torch.nn.Module, bytes, CompactReceiver]:
    """A model after one recorded LoGRA step, its compact payload, and a receiver at its start."""
    m = tiny_lm()
    opt = make(m, record_updates=True)
    initial = {n: p.detach().clone() for n, p in m.named_parameters()}
    pg_loss(m, *batch(0)).backward()
    opt.step()
    return m, encode_update(opt.last_update), CompactReceiver(
        {n: t.clone() for n, t in initial.items()})


def test_compact_payload_refuses_corruption_and_a_wrong_base():
    _m, payload, r = _first_step()
    flipped = bytearray(payload)
    flipped[len(payload) // 2] ^= 1
    with pytest.raises(ChecksumError):
        r.apply(bytes(flipped))
    with pytest.raises(FormatError):
        r.apply(b"nonsense" * 10)
    r.apply(payload)
    held = {n: t.view(torch.int32).clone() for n, t in r.masters.items()}
    with pytest.raises(BaseMismatch):
        r.apply(payload)  # applying twice: the masters are no longer at its base
    assert all(torch.equal(held[n], t.view(torch.int32)) for n, t in r.masters.items())


def _reheadered(payload: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    """The payload with its JSON header edited by `edit(header)`, re-checksummed."""
    (hlen,) = struct.unpack_from("<I", payload, 8)
    header = json.loads(payload[12:12 + hlen])
    edit(header)
    head = json.dumps(header, separators=(",", ":")).encode()
    frame = payload[:8] + struct.pack("<I", len(head)) + head + payload[12 + hlen:-16]
    return frame + xxhash.xxh3_128_digest(frame)


def _retagged(payload: bytes, name: str, digest: bytes) -> bytes:
    """The payload with `name`'s declared result digest replaced (a well-formed frame)."""

    def edit(header: dict) -> None:  # type: ignore[type-arg]
        for e in header["entries"]:
            if e["name"] == name:
                e["digest"] = digest.hex()

    return _reheadered(payload, edit)


def test_compact_replay_that_misses_the_trainers_digest_is_rolled_back():
    """The replayed words go through the engine: written in place, digests checked, and on a
    mismatch every master is restored exactly (the masters are the engine's target)."""
    m, payload, r = _first_step()
    before = {n: t.view(torch.int32).clone() for n, t in r.masters.items()}
    tensors = {n: t for n, t in r.masters.items()}  # updated in place, never replaced
    last = parse_update(payload)[1][-1].name  # the last entry: the others are written first
    with pytest.raises(IntegrityError, match="differ from the manifest's digests"):
        r.apply(_retagged(payload, last, bytes(16)))
    assert all(torch.equal(before[n], t.view(torch.int32)) for n, t in r.masters.items())
    assert r.step is None
    r.apply(payload)
    assert r.step == 1 and all(r.masters[n] is t for n, t in tensors.items())
    assert {n: tensor_digest(t) for n, t in r.masters.items()} == \
        {n: tensor_digest(p.detach()) for n, p in m.named_parameters()}


@pytest.mark.parametrize("edit, what", [
    (lambda h: h.update(step="3"), "not an integer"),
    (lambda h: h["entries"][0].update(offset=0.0), "not an integer"),
    (lambda h: h["entries"][0].update(nbytes=True), "not an integer"),
    (lambda h: h["entries"][0].update(rank=str(h["entries"][0]["rank"])), "not an integer"),
    (lambda h: h["entries"][0].update(base=h["entries"][0]["base"] + "00"), "hex digest"),
    (lambda h: h["entries"][0].update(digest="ab"), "hex digest"),
    (lambda h: h["entries"][0].update(coef="1e-3"), "finite number"),
    (lambda h: h["entries"][0].update(name=7), "not a string"),
    (lambda h: h.update(entries={"a": 1}), "list of objects"),
])
def test_compact_payload_refuses_what_no_writer_emits(edit, what) -> None:  # type: ignore[no-untyped-def]
    _m, payload, r = _first_step()
    assert parse_update(payload)[1][0].kind == "sketch", "the rank/coef cases edit a sketch"
    before = {n: t.view(torch.int32).clone() for n, t in r.masters.items()}
    with pytest.raises(FormatError, match=what):
        r.apply(_reheadered(payload, edit))
    assert all(torch.equal(before[n], t.view(torch.int32)) for n, t in r.masters.items())
    r.apply(payload)  # the untouched payload still applies


def test_compact_payload_refuses_deeply_nested_json() -> None:
    head = b'{"step":1,"entries":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    from weighthub.train import compact

    frame = compact.MAGIC + struct.pack("<I", len(head)) + head
    frame += xxhash.xxh3_128_digest(frame)
    with pytest.raises(FormatError):
        compact.parse_update(frame)


# -- predicted-KL step control -----------------------------------------------------------------

def test_predicted_kl_tracks_realized_kl_for_small_steps():
    m = tiny_lm()
    opt = make(m, lr=1e-3, kl_probe=probe(m))
    for step in range(3):
        pg_loss(m, *batch(step)).backward()
        s = opt.step()
        assert s.alpha == 1.0 and s.predicted_kl and s.realized_kl
        assert 0.5 < s.predicted_kl / s.realized_kl < 2.0, s


def test_kl_target_scales_the_step_to_stay_near_target():
    m = tiny_lm()
    target = 1e-4
    opt = make(m, lr=3e-2, kl_target=target, kl_probe=probe(m))
    for step in range(3):
        pg_loss(m, *batch(step)).backward()
        s = opt.step()
        assert s.alpha < 1.0 and s.predicted_kl == pytest.approx(target, rel=1e-6)
        assert s.realized_kl < 2.0 * target, s
