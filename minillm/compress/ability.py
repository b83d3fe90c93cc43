"""Ability-transfer distillation: the student learns the teacher's answers, not only its text (lesson 09).

Plain KD on text (distill.py) leaves a pruned student fluent but answering with unrelated words: answering shows only
in the instruct teacher's answers (chat_data.py). So the student learns those too: sequence-level KD (cross-entropy on
the teacher's greedy tokens, Kim & Rush 2016) plus token-level KD (KL to its logits), on answer positions only (the
49k-way LM head only where the loss looks saves a third of each step); a `text_share` of steps stays plain-text KD.
Recovery trains LoRA (lora.py) or every weight; `first_sentence` and `top1_agreement` score it (`retained_ability`).
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from minillm.compress.distill import (DistillConfig, batch_at, check_pair, distillation_loss, load_checkpoint, lr_at,
                                      save_checkpoint)

Example = tuple[list[int], list[int]]  # (prompt ids in the chat template, the teacher's answer ids)
SENTENCE_ENDS = (".", "!", "?")


@dataclass
class AbilityConfig(DistillConfig):
    text_share: float = 0.25  # share of steps that are plain-text KD (windows of the pydoc text)
    text_len: int = 160  # their window length: about a chat example's (prompt + answer) length
    lora_rank: int = 32  # 0: train every weight of the blocks instead of adapters

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.text_share <= 1:
            raise ValueError(f"text_share must be in [0, 1], got {self.text_share!r}")


def chat_batch_at(examples: list[Example], step: int, cfg: DistillConfig, pad_id: int) -> tuple[Tensor, Tensor]:
    """(x, mask) for `step`, drawn from (seed, step) alone: x (batch, L) the prompt + answer ids right-padded
    (causal attention never looks right, so padding changes nothing before it); mask (batch, L - 1) is True where
    position t predicts an answer token x[t + 1]."""
    gen = random.Random(cfg.seed * 1_000_003 + step)
    return answer_batch([examples[gen.randrange(len(examples))] for _ in range(cfg.batch_size)], pad_id, cfg.seq_len)


def answer_batch(examples: list[Example], pad_id: int, max_len: int | None = None) -> tuple[Tensor, Tensor]:
    """(x, mask) for these examples: x (batch, L) the prompt + answer ids right-padded, cut at max_len; mask
    (batch, L - 1) is True where position t predicts an answer token x[t + 1]."""
    length = max(len(p) + len(a) for p, a in examples)
    length = length if max_len is None else min(length, max_len)
    x = torch.full((len(examples), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), length - 1, dtype=torch.bool)
    for i, (p, a) in enumerate(examples):
        ids = (p + a)[:length]
        x[i, :len(ids)] = torch.tensor(ids)
        mask[i, len(p) - 1:len(ids) - 1] = True
    return x, mask


def _logits_at(model, inp: Tensor, mask: Tensor) -> Tensor:
    """The model's logits (n, vocab) at the positions of `mask` only: the head runs where the loss looks."""
    pos = torch.arange(inp.shape[1], device=inp.device).expand_as(inp)
    h = model.run_layers(model.embed_tokens(inp), pos)
    return model.logits(h[mask][None])[0]


def masked_step(student, teacher, x: Tensor, mask: Tensor | None, optimizer, cfg: DistillConfig) -> dict:
    """One optimizer step of kd * T^2 KL(teacher || student) + ce * cross-entropy on the teacher's tokens, over the
    positions of `mask` (None: all)."""
    inp, target = x[:, :-1], x[:, 1:]
    mask = torch.ones_like(inp, dtype=torch.bool) if mask is None else mask
    with torch.no_grad():
        t_logits = _logits_at(teacher, inp, mask)
    s_logits = _logits_at(student, inp, mask)
    terms = {"kd": distillation_loss(s_logits, t_logits, cfg.temperature) if cfg.kd else torch.zeros(()),
             "ce": F.cross_entropy(s_logits.float(), target[mask]) if cfg.ce else torch.zeros(())}
    loss = cfg.kd * terms["kd"] + cfg.ce * terms["ce"]
    if not torch.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss.item()}: lower the learning rate or check the data")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
    optimizer.step()
    return {"loss": loss.item(), "kd": terms["kd"].item(), "ce": terms["ce"].item(), "grad_norm": float(grad_norm)}


def distill_ability(student, teacher, examples: list[Example], text_ids: Tensor, cfg: AbilityConfig, pad_id: int,
                    checkpoint: str | Path | None = None, progress: bool = True, stop_after: int | None = None
                    ) -> list[dict]:
    """Train `student` in place: answer steps on `examples`, plain-text KD steps on `text_ids` (a `text_share` of
    them). Trains the parameters that require grad (add_lora first for adapters); resumes from `checkpoint`."""
    check_pair(student, teacher)
    if not examples and cfg.text_share < 1:
        raise ValueError("no chat examples: pass the teacher's answers, or text_share=1 for text-only KD")
    teacher.eval().requires_grad_(False)
    student.train()
    params = [p for p in student.parameters() if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: call add_lora(student) or student.requires_grad_(True) first")
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(0.9, 0.95))
    start, history = 0, []
    if checkpoint is not None and Path(checkpoint).exists():
        start, history = load_checkpoint(Path(checkpoint), student, optimizer, cfg)
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    t_run = time.perf_counter()
    for step in range(start, end):
        t0 = time.perf_counter()
        text = random.Random(cfg.seed * 7919 + step).random() < cfg.text_share
        x, mask = ((batch_at(text_ids, step, dataclasses.replace(cfg, seq_len=cfg.text_len)), None) if text
                   else chat_batch_at(examples, step, cfg, pad_id))
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, cfg)
        with torch.autocast(student.device.type, torch.bfloat16, enabled=cfg.autocast):
            out = masked_step(student, teacher, x.to(student.device), None if mask is None else mask.to(x.device),
                              optimizer, cfg)
        n_tok = x[:, 1:].numel() if mask is None else int(mask.sum())
        history.append({"step": step + 1, "kind": "text" if text else "chat", **out, "lr": lr_at(step, cfg),
                        "tokens": x.numel(), "loss_tokens": n_tok, "seconds": time.perf_counter() - t0})
        if progress:
            done = step + 1 - start
            eta = (time.perf_counter() - t_run) / done * (end - step - 1)
            print(f"\rstep {step + 1}/{cfg.steps} ({history[-1]['kind']})  loss {out['loss']:.3f}  "
                  f"ce {out['ce']:.3f}  {x.numel() / history[-1]['seconds']:.0f} tok/s  eta {eta / 60:.1f} min",
                  end="", file=sys.stderr, flush=True)
        if checkpoint is not None and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == end):
            save_checkpoint(Path(checkpoint), student, optimizer, step + 1, history, cfg)
    if progress:
        print(file=sys.stderr)
    student.eval()  # what trains still requires grad: a later call continues the same run
    return history


# ----------------------------------------------------------------------------------------------- measurement


def first_sentence(ids: list[int], tokenizer, cap: int = 32) -> list[int]:
    """The shortest prefix of an answer whose text ends a sentence (. ! ? or a line break after some text), at most
    `cap` tokens: what 'the same answer' is checked on."""
    for n in range(1, min(len(ids), cap) + 1):
        text = tokenizer.decode(ids[:n]).strip()
        if text and (text.endswith(SENTENCE_ENDS) or "\n" in text):
            return ids[:n]
    return ids[:cap]


@torch.no_grad()
def top1_agreement(student, examples: list[Example]) -> float:
    """Teacher-forced on the teacher's answers: the share of answer tokens that are also the student's argmax."""
    agree = total = 0
    for prompt, answer in examples:
        x = torch.tensor([prompt + answer], device=student.device)
        logits = student(x[:, :-1])[0, len(prompt) - 1:]
        agree += int((logits.argmax(-1) == x[0, len(prompt):]).sum())
        total += len(answer)
    return agree / max(total, 1)
