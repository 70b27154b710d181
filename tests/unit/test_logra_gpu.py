"""LoGRA's batched GPU step (issue #14), on the CPU: the batched reconstruction is bit-identical to
the one-weight reference, the step equals its replay, bad placements and out-of-memory errors
leave every bit unchanged, the memory options work, chunked logits give the plain loss, and
`weighthub bench logra --gpu` runs its CPU fallback at a tiny size."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from test_logra import VOCAB, tiny_lm

from weighthub.errors import UsageError
from weighthub.train import (
    KLProbe,
    LoGRA,
    apply_low_rank,
    apply_low_rank_batch,
    causal_lm_loss,
    chunked_token_loss,
    projection,
    rademacher,
    sketch,
    split_params,
)

SEQ = 12


def reference_apply_low_rank(w: torch.Tensor, u: torch.Tensor, p: torch.Tensor, *, coef: float,
                             decay: float = 1.0) -> None:
    """The original one-weight reconstruction (row blocks, r rank-1 terms in order): the spec."""
    m, n = w.shape
    uc = u.to(torch.float32).mul(projection.fp32(coef))
    pt = p.t().contiguous()
    decay = projection.fp32(decay)
    rows = max(1, (1 << 18) // n)
    for i0 in range(0, m, rows):
        i1 = min(m, i0 + rows)
        a = uc[i0:i1, 0:1] * pt[0:1]
        for k in range(1, u.shape[1]):
            a.add_(uc[i0:i1, k:k + 1] * pt[k:k + 1])
        if decay != 1.0:
            w[i0:i1].mul_(decay)
        w[i0:i1].add_(a)


def ints(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32 if t.dtype == torch.float32 else torch.int16).clone()


def batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (n, SEQ), generator=g)
    adv = torch.randn(n, 1, generator=g).expand(-1, SEQ - 1) / (n * (SEQ - 1))
    return ids, adv.contiguous()


def train_once(m: torch.nn.Module, seed: int) -> None:
    causal_lm_loss(m, *batch(seed), chunk_tokens=16).backward()


# -- the batched reconstruction ---------------------------------------------------------------

@pytest.mark.parametrize("m, n, r, layers", [(300, 1000, 12, 3), (64, 48, 1, 2), (7, 5000, 5, 4),
                                              (96, 96, 32, 5)])
@pytest.mark.parametrize("decay", [1.0, 0.999])
@pytest.mark.parametrize("chunk", [1 << 18, 2000])  # 2000: several chunks per weight and per batch
def test_batched_reconstruction_is_bit_identical_to_the_reference(monkeypatch, m, n, r, layers,
                                                                  decay, chunk):
    monkeypatch.setattr(projection, "_CPU_CHUNK", chunk)
    g = torch.Generator().manual_seed(m * n + r)
    ws = [torch.randn(m, n, generator=g) * 10 ** float(torch.randint(-3, 3, (1,), generator=g))
          for _ in range(layers)]
    us = [torch.randn(m, r, generator=g).to(torch.bfloat16) for _ in range(layers)]
    ps = [rademacher(i, f"w{i}", 3, n, r) for i in range(layers)]
    ref, one, bat = ([w.clone() for w in ws] for _ in range(3))
    for w, u, p in zip(ref, us, ps, strict=True):
        reference_apply_low_rank(w, u, p, coef=-3e-4, decay=decay)
    for w, u, p in zip(one, us, ps, strict=True):
        apply_low_rank(w, u, p, coef=-3e-4, decay=decay)
    uc = torch.stack([projection.scaled_update(u, -3e-4) for u in us])
    apply_low_rank_batch(bat, uc, torch.stack(ps), decay=decay)
    for a, b, c in zip(ref, one, bat, strict=True):
        assert torch.equal(ints(a), ints(b)) and torch.equal(ints(a), ints(c))


def test_training_step_equals_the_reference_replay_of_its_record():
    """Every sketched weight after a batched step = the reference reconstruction of its record."""
    m = tiny_lm()
    opt = LoGRA(*split_params(m, sketch_embeddings=True), rank=4, lr=1e-3, weight_decay=0.1,
                update_dtype=torch.bfloat16, record_updates=True)
    for step in range(3):
        start = {n: p.detach().clone() for n, p in m.named_parameters()}
        train_once(m, step)
        assert opt.step().applied
        now = dict(m.named_parameters())
        for rec in opt.last_update.sketches:
            w = start[rec.name].clone()
            p = rademacher(rec.seed, rec.name, rec.epoch, rec.shape[1], rec.u.shape[1])
            reference_apply_low_rank(w, rec.u, p, coef=rec.coef, decay=rec.decay)
            assert torch.equal(ints(w), ints(now[rec.name])), rec.name


def test_dense_group_foreach_adamw_equals_a_per_parameter_adamw():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in ((5,), (3, 4), (17,))]
    ref = [p.detach().clone() for p in ps]
    opt = LoGRA([], [(f"p{i}", p) for i, p in enumerate(ps)], rank=1, lr=1e-2, weight_decay=0.1)
    ea, sq = [torch.zeros_like(r) for r in ref], [torch.zeros_like(r) for r in ref]
    for t in range(1, 4):
        grads = [torch.randn_like(r) for r in ref]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for r, g, a, s in zip(ref, grads, ea, sq, strict=True):
            a.mul_(0.9).add_(g, alpha=0.1)
            s.mul_(0.999).addcmul_(g, g, value=0.001)
            d = (a / (1 - 0.9 ** t)) / (s / (1 - 0.999 ** t)).sqrt_().add_(1e-8)
            r.mul_(projection.fp32(1 - 1e-2 * 0.1)).add_(d.mul_(projection.fp32(-1e-2)))
    assert all(torch.equal(ints(p), ints(r)) for p, r in zip(ps, ref, strict=True))


def test_a_resumed_run_continues_bit_for_bit():
    """state_dict() carries the stacked state and the counters (bias corrections, refresh
    schedule, projection epoch): a run resumed from a checkpoint after step 3, across a
    projection refresh at step 2 and another at step 4, ends with the uninterrupted run's bits."""
    a, b = tiny_lm(), tiny_lm()
    oa = LoGRA(*split_params(a), rank=4, lr=1e-3, refresh_every=2)
    ob = LoGRA(*split_params(b), rank=4, lr=1e-3, refresh_every=2)
    for step in range(3):
        train_once(a, step)
        oa.step()
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # state_dict() holds references
    b.load_state_dict(a.state_dict())
    assert (ob.steps, ob.applied_steps, ob.epoch, ob.m_t, ob.v_t) == (3, 3, 1, 1, 3)
    for step in range(3, 5):
        train_once(a, step)
        train_once(b, step)
        oa.step()
        ob.step()
    assert ob.epoch == oa.epoch == 2
    assert all(torch.equal(ints(p), ints(q)) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# -- bad placement, out of memory ----------------------------------------------------------------

def test_parameters_on_several_devices_are_refused_by_name():
    m = tiny_lm()
    stray = torch.nn.Parameter(torch.empty(8, 8, device="meta"))
    sk, dn = split_params(m)
    with pytest.raises(UsageError, match=r"one device, got 2 devices .*meta: 1 parameter\(s\), "
                                         r"e\.g\. \['stray'\]"):
        LoGRA([*sk, ("stray", stray)], dn, rank=2)


def _snapshot(m: torch.nn.Module, opt: LoGRA) -> dict[str, torch.Tensor]:
    snap = {f"w:{n}": ints(p) for n, p in m.named_parameters()}
    snap |= {f"g:{n}": ints(p.grad) for n, p in m.named_parameters() if p.grad is not None}
    for i, p in enumerate(opt.sketched + opt.dense):
        for k, v in opt.state[p].items():
            if torch.is_tensor(v):
                snap[f"s{i}:{k}"] = ints(v)
    return snap


@pytest.mark.parametrize("where", ["probe", "workspace", "dense"])
def test_out_of_memory_while_preparing_leaves_every_bit_unchanged(monkeypatch, where):
    m = tiny_lm()
    opt = LoGRA(*split_params(m), rank=4, lr=1e-3, kl_probe=KLProbe(m, batch(99, 2)[0]))
    train_once(m, 0)
    opt.step()  # moments are non-zero now
    train_once(m, 1)
    before, counts = _snapshot(m, opt), (opt.steps, opt.applied_steps, opt.m_t, opt.epoch)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    target = {"probe": (KLProbe, "predict"), "workspace": (sketch.Bucket, "prepare"),
              "dense": (type(opt._dense), "prepare")}[where]
    with monkeypatch.context() as mp:
        mp.setattr(*target, oom)
        with pytest.raises(torch.OutOfMemoryError, match="nothing was applied: weights, gradients "
                                                         "and optimizer state are unchanged"):
            opt.step()
    after = _snapshot(m, opt)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before
                                                                 if not torch.equal(before[k], after[k])]
    assert (opt.steps, opt.applied_steps, opt.m_t, opt.epoch) == counts
    assert opt.step().applied  # the retry goes through


# -- memory options ---------------------------------------------------------------------------

def test_sketched_embeddings_are_folded_and_replay_bit_exactly():
    from weighthub.train import CompactReceiver, encode_update

    m = tiny_lm()
    sk, dn = split_params(m, sketch_embeddings=True)
    assert "model.embed_tokens.weight" in dict(sk)  # tied: one parameter, both uses folded
    opt = LoGRA(sk, dn, rank=4, lr=1e-3, record_updates=True, update_dtype=torch.bfloat16)
    r = CompactReceiver({n: p.detach().clone() for n, p in m.named_parameters()})
    for step in range(2):
        train_once(m, step)
        assert m.model.embed_tokens.weight.grad is None
        assert opt.step().applied
        r.apply(encode_update(opt.last_update))
    assert all(torch.equal(ints(r.masters[n]), ints(p)) for n, p in m.named_parameters())
    assert opt.memory_report()["dense_moments"] < 4096  # only the norms are dense


def test_bf16_dense_state_halves_the_dense_moments():
    reps = {}
    for dt in (torch.float32, torch.bfloat16):
        m = tiny_lm()
        opt = LoGRA(*split_params(m), rank=4, lr=1e-3, dense_state_dtype=dt)
        train_once(m, 0)
        assert opt.step().applied
        assert all(opt.state[p]["exp_avg"].dtype == dt for p in opt.dense)
        reps[dt] = opt.memory_report()["dense_moments"]
    assert reps[torch.bfloat16] * 2 == reps[torch.float32]
    with pytest.raises(UsageError, match="dense_state_dtype"):
        LoGRA(*split_params(tiny_lm()), rank=4, dense_state_dtype=torch.float16)


@pytest.mark.parametrize("weighted", [False, True])
def test_chunked_loss_equals_the_plain_loss_and_gradient(weighted):
    ids, adv = batch(3)
    out = []
    for chunk in (None, 7, 1024):
        m = tiny_lm()
        loss = causal_lm_loss(m, ids, adv if weighted else None, chunk_tokens=chunk)
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    for loss, grads in out[1:]:
        torch.testing.assert_close(loss, out[0][0])
        for n, g in grads.items():
            torch.testing.assert_close(g, out[0][1][n], rtol=1e-4, atol=1e-6)
    with pytest.raises(UsageError, match="chunk_tokens"):
        chunked_token_loss(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long),
                           chunk_tokens=0)


def test_nonfinite_check_names_a_bad_dense_gradient_after_one_fused_check():
    m = tiny_lm()
    opt = LoGRA(*split_params(m), rank=4, lr=1e-3)
    train_once(m, 0)
    m.model.layers[1].input_layernorm.weight.grad[0] = math.inf
    s = opt.step()
    assert not s.applied and "layers.1.input_layernorm" in (s.skipped_reason or "")


# -- the bench's CPU fallback -------------------------------------------------------------------

def test_bench_logra_gpu_runs_its_cpu_fallback_and_writes_json(tmp_path: Path, capsys):
    from weighthub.cli import main

    out = tmp_path / "logra.json"
    assert main(["bench", "logra", "--gpu", "--device", "cpu", "--tiny", "--ranks", "2",
                 "--steps", "1", "--budget-gb", "0.05", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and "not GPU figures" in doc["note"]
    assert "NOTE: no CUDA" in capsys.readouterr().out
    labels = [r["label"] for r in doc["runs"]]
    logra = "logra r2 emb-sketched chunked-loss"
    assert labels[:2] == ["adamw fused", "adamw fused chunked-loss"] and logra in labels
    for r in doc["runs"]:
        assert r["peak_bytes"] is not None and r["step_s"] > 0 and r["step_s_with_probe"] > 0
        assert len(r["kl"]) == 1 and all(k["realized"] is not None for k in r["kl"])
        if r["optimizer"] == "logra":
            assert all(k["predicted"] is not None for k in r["kl"])
            assert {"memory_vs_adamw", "time_vs_adamw", "kl_pred_over_real", "optimizer_bytes"} <= r.keys()
    cap = doc["capacity"]
    assert cap["budget_gb"] == 0.05 and "params_ratio" in cap
    assert all(cap[k]["layers"] >= 0 for k in ("adamw fused chunked-loss", logra))
    with pytest.raises(SystemExit):  # argparse: a usage error, before any work
        main(["bench", "logra", "--gpu", "--ranks"])
