"""Distillation (lesson 09): the loss against torch's own KL, the schedule, deterministic batches, a training run that
learns without touching the teacher, bit-identical resume from a checkpoint, atomic saves, bad input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.config import ModelConfig
from minillm.compress.distill import (
    DistillConfig,
    batch_at,
    distill,
    distillation_loss,
    evaluate,
    hidden_cosine_loss,
    lr_at,
    save_checkpoint,
)
from minillm.model import Transformer
from minillm.compress.pruning import drop_blocks

TINY = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)


def pair(seed=0):
    torch.manual_seed(seed)
    teacher = Transformer(TINY).eval().requires_grad_(False)
    for p in teacher.parameters():  # default init gives near-uniform logits: nothing to distil
        p.data.normal_(0, 0.3)
    student = drop_blocks(copy.deepcopy(teacher), [1])
    return student, teacher


def text(n=600, seed=1):
    # a learnable sequence: a repeating pattern with noise, so the loss can fall in a few dozen steps
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(n) * 7 % 61
    noise = torch.randint(0, 64, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.1, noise, base)


CFG = dict(steps=12, batch_size=4, seq_len=16, lr=3e-3, warmup=2, eval_every=6, eval_tokens=64, checkpoint_every=4)


@settings(max_examples=30)
@given(rows=st.integers(1, 5), vocab=st.integers(2, 50), temp=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
       scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**16))
def test_distillation_loss_is_t2_times_torch_kl(rows, vocab, temp, scale, seed):
    g = torch.Generator().manual_seed(seed)
    s, t = (torch.randn(2, rows, vocab, generator=g) * scale for _ in range(2))
    want = F.kl_div(F.log_softmax(s / temp, -1).reshape(-1, vocab), F.log_softmax(t / temp, -1).reshape(-1, vocab),
                    reduction="batchmean", log_target=True) * temp**2
    torch.testing.assert_close(distillation_loss(s, t, temp), want, rtol=1e-4, atol=1e-5)
    assert distillation_loss(t, t, temp).abs() < 1e-5


def test_distillation_loss_is_forward_kl():
    t = torch.tensor([[4.0, 0.0, 0.0]])
    s = torch.tensor([[0.0, 4.0, 4.0]])
    forward = distillation_loss(s, t, 1.0)  # KL(teacher || student)
    assert not torch.isclose(forward, distillation_loss(t, s, 1.0))
    p = F.softmax(t, -1)
    assert torch.isclose(forward, (p * (F.log_softmax(t, -1) - F.log_softmax(s, -1))).sum())


def test_hidden_cosine_loss():
    h = torch.randn(2, 5, 8)
    assert hidden_cosine_loss(h, h * 3).abs() < 1e-6
    assert torch.isclose(hidden_cosine_loss(h, -h), torch.tensor(2.0))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = DistillConfig(steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lr_at(100, cfg) == pytest.approx(1e-4) and min(lrs) >= 1e-4 - 1e-12


def test_batches_are_a_function_of_seed_and_step():
    ids, cfg = text(), DistillConfig(**CFG)
    assert torch.equal(batch_at(ids, 3, cfg), batch_at(ids, 3, cfg))
    assert not torch.equal(batch_at(ids, 3, cfg), batch_at(ids, 4, cfg))
    assert batch_at(ids, 0, cfg).shape == (4, 16)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        batch_at(ids[:10], 0, cfg)


def test_training_lowers_the_loss_and_never_touches_the_teacher():
    student, teacher = pair()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    ids = text()
    start = evaluate(student, teacher, ids[:65])
    hist = distill(student, teacher, ids, ids[:65], DistillConfig(**{**CFG, "steps": 30}), progress=False)
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert hist[-1]["eval_kl"] < start["kl"] * 0.7
    assert sum(h["loss"] for h in hist[-5:]) < sum(h["loss"] for h in hist[:5])
    assert not student.training and not any(p.requires_grad for p in student.parameters())


def test_evaluate_teacher_against_itself():
    _, teacher = pair()
    r = evaluate(teacher, teacher, text()[:65])
    assert r["kl"] == pytest.approx(0, abs=1e-6) and r["top1_agree"] == 1.0


@pytest.mark.parametrize("terms", [dict(kd=1.0, ce=0.0, cos=0.0), dict(kd=0.5, ce=0.5, cos=0.2), dict(kd=0.0, ce=1.0)])
def test_interrupted_and_resumed_run_reproduces_the_straight_run(tmp_path, terms):
    cfg = DistillConfig(**{**CFG, **terms})
    ids = text()
    s1, t = pair()
    straight = distill(s1, t, ids, ids[:65], cfg, progress=False)
    s2, _ = pair()
    ckpt = tmp_path / "run.pt"
    first = distill(s2, t, ids, ids[:65], cfg, checkpoint=ckpt, progress=False, stop_after=5)
    assert len(first) == 5
    s3, _ = pair()  # a fresh process would start from a fresh student: the checkpoint restores it
    resumed = distill(s3, t, ids, ids[:65], cfg, checkpoint=ckpt, progress=False)
    assert [h["loss"] for h in resumed] == [h["loss"] for h in straight]
    assert all(torch.equal(a, b) for a, b in zip(s1.state_dict().values(), s3.state_dict().values()))


def test_checkpoint_mismatches_are_refused(tmp_path):
    ids, ckpt = text(), tmp_path / "run.pt"
    s, t = pair()
    distill(s, t, ids, ids[:65], DistillConfig(**CFG), checkpoint=ckpt, progress=False, stop_after=2)
    with pytest.raises(ValueError, match="another DistillConfig"):
        distill(pair()[0], t, ids, ids[:65], DistillConfig(**{**CFG, "lr": 1e-4}), checkpoint=ckpt, progress=False)
    other = drop_blocks(copy.deepcopy(t), [0, 1])
    with pytest.raises(ValueError, match="another student"):
        distill(other, t, ids, ids[:65], DistillConfig(**CFG), checkpoint=ckpt, progress=False)


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ids, ckpt = text(), tmp_path / "run.pt"
    s, t = pair()
    distill(s, t, ids, ids[:65], DistillConfig(**CFG), checkpoint=ckpt, progress=False, stop_after=4)
    good = ckpt.read_bytes()

    def crash(obj, f):
        open(f, "wb").write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(ckpt, s, torch.optim.AdamW(s.parameters()), 8, [], DistillConfig(**CFG))
    assert ckpt.read_bytes() == good


def test_bad_input():
    s, t = pair()
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            DistillConfig(temperature=bad)
        with pytest.raises(ValueError, match="temperature"):
            distillation_loss(torch.zeros(2, 3), torch.zeros(2, 3), bad)
    with pytest.raises(ValueError, match="not all 0"):
        DistillConfig(kd=0, ce=0, cos=0)
    with pytest.raises(ValueError, match="autocast"):
        DistillConfig(autocast="auto")  # the caller resolves it (minillm.measure.hardware.native_bf16)
    with pytest.raises(ValueError, match="differ"):
        distillation_loss(torch.zeros(2, 3), torch.zeros(2, 4), 1.0)
    torch.manual_seed(0)
    other_vocab = Transformer(TINY.with_(vocab_size=80))
    with pytest.raises(ValueError, match="share a tokenizer"):
        distill(other_vocab, t, text(), text()[:65], DistillConfig(**CFG), progress=False)
    with pytest.raises(ValueError, match="cosine term alone"):
        distill(s, t, text(), text()[:65], DistillConfig(**{**CFG, "kd": 0.0, "cos": 1.0}), progress=False)
