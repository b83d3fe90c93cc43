"""Knowledge distillation: train a pruned student on the teacher's next-token distributions (lesson 09).

The loss is DistilBERT's three terms, weighed by DistillConfig: kd * `distillation_loss` (T^2 * KL of the
softened teacher to the softened student), ce * cross-entropy on the text, cos * `hidden_cosine_loss` (last
hidden states). `distill` is a plain PyTorch loop (AdamW, warm-up then cosine, clipping, periodic `evaluate`,
an atomic checkpoint); `batch_at` draws each step's batch from (seed, step) alone, so a resumed run reproduces
the same loss curve. bf16 autocast is the caller's choice (DistillConfig.autocast).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minillm.gguf.vocabulary import check_same_vocabulary


@dataclass
class DistillConfig:
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup: int = 20
    weight_decay: float = 0.01
    clip: float = 1.0
    temperature: float = 2.0
    kd: float = 1.0  # weight of the soft-target KL term
    ce: float = 0.0  # weight of the cross-entropy on the text
    cos: float = 0.0  # weight of the hidden-state cosine term
    eval_every: int = 50
    eval_tokens: int = 512
    checkpoint_every: int = 50
    seed: int = 0
    autocast: bool = False  # train under bf16 autocast (the caller decides: only where bf16 is native)
    # the tied embedding / LM head is 28M of SmolLM2's 135M parameters and was not pruned: leaving it frozen saves its
    # weight gradient and optimizer state, the largest per-token cost of the backward pass after the blocks
    train_embeddings: bool = False

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (1 = the plain distributions, 2-4 softens them), "
                             f"got {self.temperature}")
        if min(self.kd, self.ce, self.cos) < 0 or self.kd + self.ce + self.cos == 0:
            raise ValueError("the loss weights kd, ce, cos must be >= 0 and not all 0")
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise ValueError("steps and batch_size must be >= 1, seq_len >= 2")
        if not isinstance(self.autocast, bool):
            raise ValueError(f"autocast is True or False (the caller resolves it), got {self.autocast!r}")


# ------------------------------------------------------------------------------------------------------- losses


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


def hidden_cosine_loss(student_h: Tensor, teacher_h: Tensor) -> Tensor:
    """1 - mean cosine similarity of the final hidden states (..., dim), DistilBERT's alignment term."""
    return 1 - F.cosine_similarity(student_h.float(), teacher_h.float(), dim=-1).mean()


def lr_at(step: int, cfg: DistillConfig) -> float:
    """Linear warm-up over cfg.warmup steps, then cosine decay from lr to lr * min_lr_ratio at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def batch_at(ids: Tensor, step: int, cfg: DistillConfig) -> Tensor:
    """The (batch_size, seq_len) training windows of `step`: random offsets drawn from (seed, step) alone."""
    if ids.numel() < cfg.seq_len + 1:
        raise ValueError(f"the training text has {ids.numel()} tokens, fewer than seq_len + 1 = {cfg.seq_len + 1}")
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, ids.numel() - cfg.seq_len, (cfg.batch_size,), generator=gen)
    return torch.stack([ids[s:s + cfg.seq_len] for s in starts.tolist()])


# --------------------------------------------------------------------------------------------------- training


def _forward(model, x: Tensor, want_hidden: bool) -> tuple[Tensor, Tensor | None]:
    h = model.run_layers(model.embed_tokens(x), torch.arange(x.shape[1], device=x.device).expand_as(x))
    return model.logits(h), (h if want_hidden else None)


def check_pair(student, teacher) -> None:
    s, t = student.config, teacher.config
    check_same_vocabulary(student, teacher, ("student", "teacher"), "distillation compares next-token "
                          "distributions token by token, so both must share a tokenizer")
    if s.dim != t.dim:
        raise ValueError(f"student dim {s.dim} != teacher dim {t.dim}: the cosine term compares hidden states; "
                         "set cos=0 for a student of another width")


@torch.no_grad()
def evaluate(student, teacher, eval_ids: Tensor, window: int = 256) -> dict:
    """Perplexity of the student, KL(teacher || student) and top-1 agreement, on the held-apart ids."""
    nll = kl = agree = 0.0
    n = 0
    was_training = student.training
    student.eval()
    for i in range(0, eval_ids.numel() - 1, window):
        x = eval_ids[i:i + window + 1][None]
        if x.shape[1] < 2:
            break
        s_logits, t_logits = student(x[:, :-1])[0].float(), teacher(x[:, :-1])[0].float()
        nll += F.cross_entropy(s_logits, x[0, 1:], reduction="sum").item()
        kl += distillation_loss(s_logits, t_logits, 1.0).item() * s_logits.shape[0]
        agree += (s_logits.argmax(-1) == t_logits.argmax(-1)).sum().item()
        n += s_logits.shape[0]
    student.train(was_training)
    return {"ppl": math.exp(nll / n), "kl": kl / n, "top1_agree": agree / n}


def save_checkpoint(path: Path, student, optimizer, step: int, history: list, cfg: DistillConfig) -> None:
    """Atomic: written to a temporary file, then renamed over the old one (a crash never leaves half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({"student": student.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "history": history, "config": dataclasses.asdict(cfg),
                "model_config": dataclasses.asdict(student.config)}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, student, optimizer, cfg: DistillConfig) -> tuple[int, list]:
    ckpt = torch.load(path, weights_only=False, map_location="cpu")
    if ckpt["model_config"] != dataclasses.asdict(student.config):
        raise ValueError(f"checkpoint {path} was written for another student ({ckpt['model_config']}); "
                         f"delete it or pass the student it belongs to")
    saved = {k: v for k, v in ckpt["config"].items() if k not in ("eval_every", "checkpoint_every")}
    if saved != {k: v for k, v in dataclasses.asdict(cfg).items() if k in saved}:
        raise ValueError(f"checkpoint {path} was written with another DistillConfig: resuming would not reproduce "
                         f"its run; delete it or pass the same config ({saved})")
    student.load_state_dict(ckpt["student"])
    optimizer.load_state_dict(ckpt["optimizer"])
    return ckpt["step"], ckpt["history"]


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


def distill(student: nn.Module, teacher: nn.Module, train_ids: Tensor, eval_ids: Tensor, cfg: DistillConfig,
            checkpoint: str | Path | None = None, progress: bool = True, stop_after: int | None = None) -> list[dict]:
    """Train `student` in place on `train_ids` (1-D token ids) against `teacher`. Returns the history: one record
    per step (step, loss terms, lr, tokens/s) and, every eval_every steps, the evaluation on `eval_ids`. With a
    `checkpoint` path the run resumes from it if present and saves to it every checkpoint_every steps and at the
    end; `stop_after` ends the run early after that many steps (an interruption, for tests and demos)."""
    check_pair(student, teacher)
    teacher.eval().requires_grad_(False)
    student.train().requires_grad_(True)
    if not cfg.train_embeddings:
        student.embed.weight.requires_grad_(False)  # the tied LM head is the same tensor
    if cfg.ce == 0 and cfg.kd == 0 and cfg.cos > 0:
        raise ValueError("the cosine term alone does not train the LM head: add kd or ce")
    params = [p for p in student.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(0.9, 0.95))
    start, history = 0, []
    if checkpoint is not None and Path(checkpoint).exists():
        start, history = load_checkpoint(Path(checkpoint), student, optimizer, cfg)
    train_ids, eval_ids = train_ids.to(student.device), eval_ids.to(student.device)
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    for step in range(start, end):
        t0 = time.perf_counter()
        x = batch_at(train_ids, step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, cfg)
        with torch.autocast(student.device.type, torch.bfloat16, enabled=cfg.autocast):
            out = train_step(student, teacher, x, optimizer, cfg)
        tok_s = (x.numel() - x.shape[0]) / (time.perf_counter() - t0)  # tokens predicted per second
        rec = {"step": step + 1, **out, "lr": lr_at(step, cfg), "tok_s": tok_s}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            rec.update({f"eval_{k}": v for k, v in evaluate(student, teacher, eval_ids[:cfg.eval_tokens + 1]).items()})
        history.append(rec)
        if progress:
            ev = f"  eval ppl {rec['eval_ppl']:.1f}" if "eval_ppl" in rec else ""
            print(f"\rstep {step + 1}/{cfg.steps}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                  f"{rec['tok_s']:.0f} tok/s{ev}", end="\n" if ev else "", file=sys.stderr, flush=True)
        if checkpoint is not None and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == end):
            save_checkpoint(Path(checkpoint), student, optimizer, step + 1, history, cfg)
    student.eval().requires_grad_(False)
    return history


# ------------------------------------------------------------------------------------------------------- data


def train_ids(tokenizer, skip: int = 8192) -> Tensor:
    """The pydoc text after its first `skip` tokens: the training split (evaluation uses the head, eval_ids)."""
    from minillm.compress.quality import pydoc_text

    ids = tokenizer.encode(pydoc_text())
    return torch.tensor(ids[skip:])
