"""Exercise 09 (reference solutions): the distillation loss, the learning-rate schedule and one training step of
knowledge distillation.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# given: DistillConfig (the run's settings), _forward (a model's logits and, when asked, its last hidden states) and
# hidden_cosine_loss (1 - mean cosine similarity of two sets of hidden states: the cos term)
from minillm.compress.distill import DistillConfig, _forward, hidden_cosine_loss

SAME_AS = {
    "distillation_loss": "minillm.compress.distill",
    "lr_at": "minillm.compress.distill",
    "train_step": "minillm.compress.distill",
}

# task 09.loss ------------------------------------------------------------------------------------------------


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """T^2 * mean over positions of KL(softmax(teacher / T) || softmax(student / T)); logits (..., vocab)."""
    if not temperature > 0:  # also refuses NaN
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: same tokens, same vocabulary needed")
    t_logp = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    s_logp = F.log_softmax(student_logits.float() / temperature, dim=-1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)  # per position, summed over the vocabulary
    return kl.mean() * temperature**2


# task 09.schedule --------------------------------------------------------------------------------------------


def lr_at(step: int, cfg: DistillConfig) -> float:
    """Linear warm-up over cfg.warmup steps, then cosine decay from lr to lr * min_lr_ratio at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# task 09.step ------------------------------------------------------------------------------------------------


def train_step(student: nn.Module, teacher: nn.Module, x: Tensor, optimizer: torch.optim.Optimizer,
               cfg: DistillConfig) -> dict[str, float]:
    """One optimizer step on token windows x (batch, seq_len): position t of x[:, :-1] predicts x[:, t + 1].
    The teacher runs without gradients; the student's loss is the weighted sum of the enabled terms; gradients are
    clipped to norm cfg.clip. Returns the loss, each term and the gradient norm before clipping."""
    inp, target = x[:, :-1], x[:, 1:]
    with torch.no_grad():
        t_logits, t_h = _forward(teacher, inp, cfg.cos > 0)
    s_logits, s_h = _forward(student, inp, cfg.cos > 0)
    terms = {}
    if cfg.kd:
        terms["kd"] = distillation_loss(s_logits, t_logits, cfg.temperature)
    if cfg.ce:
        terms["ce"] = F.cross_entropy(s_logits.float().flatten(0, 1), target.flatten())
    if cfg.cos:
        terms["cos"] = hidden_cosine_loss(s_h, t_h)
    loss = cfg.kd * terms.get("kd", 0) + cfg.ce * terms.get("ce", 0) + cfg.cos * terms.get("cos", 0)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss.item()}: lower the learning rate or check the data")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
    optimizer.step()
    return {"loss": loss.item(), **{k: v.item() for k, v in terms.items()}, "grad_norm": float(grad_norm)}
