# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 09 — Distillation: heal a pruned model with the teacher's soft targets
#
# Lesson 08 made SmolLM2 smaller and faster by dropping whole blocks, and its perplexity exploded: the remaining
# blocks were trained to follow the ones that are gone. Training can repair that, and the cheapest teacher for it is
# the model we started from. **Knowledge distillation** (Hinton et al., 2015; DistilBERT, 2019) trains the small
# *student* to reproduce the large *teacher's* next-token distribution at every position, not just the one token the
# text happens to contain:
#
# - a label carries one token's worth of information per position; the teacher's distribution also says which other
#   tokens were plausible, and how plausible ("dark knowledge"), so each training token teaches more;
# - a temperature T > 1 softens both distributions so that those small probabilities matter in the loss; the loss is
#   multiplied by T² so that its gradients stay on the scale of the label loss whatever T is.
#
# Why it matters for inference: the student is a cheaper model with (nearly) the teacher's behaviour — the draft model
# of speculative decoding (lesson 10) and the small model of a cascade. Its speed comes from lesson 08 (fewer blocks);
# its agreement with the teacher, measured here, is what lesson 10's acceptance rate will be.
#
# Sections: (1) what a soft target carries; (2) the three loss terms; (3) the student and a live training loop that
# resumes exactly; (4) the benchmark — KD vs fine-tuning on labels with the same budget; (5) the student, by name.

# %%
import copy
import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import minillm
from minillm.bench import run_entry
from minillm.bench.hardware import native_bf16
from minillm.compress.distill import DistillConfig, distill, distillation_loss, hidden_cosine_loss, train_ids
from minillm.course.lesson import QUICK, hardware_line, pick
from minillm.compress.pruning import block_importance, drop_blocks, least_important
from minillm.compress.quality import calibration_ids, eval_ids

torch.set_num_threads(1)  # one thread: on a shared 2-core machine a second thread mostly measures the neighbours
print(hardware_line())
teacher, tok = minillm.load_model(dtype="float32")

# %% [markdown]
# ## 1. What a soft target carries
#
# The teacher's next-token distribution after a real prompt, at T = 1 and T = 2. The label is the single token the
# text continues with; the distribution ranks the alternatives.
#
# *Predict before you run the next cell:* after "The capital of Germany is", what probability does the teacher give
# ' Berlin' at T = 1, and does T = 2 raise or lower it? Write both down.

# %%
prompt = "The capital of France is Paris. The capital of Germany is"
x = torch.tensor([tok.encode(prompt)])
with torch.no_grad():
    logits = teacher(x)[0, -1]
for T in (1.0, 2.0):
    p = F.softmax(logits / T, dim=-1)
    top = torch.topk(p, 6)
    entropy = -(p * p.clamp_min(1e-12).log()).sum() / math.log(2)
    shown = ", ".join(f"{tok.decode([int(i)])!r} {float(v):.3f}" for v, i in zip(top.values, top.indices))
    print(f"T={T:.0f}: entropy {entropy:.2f} bits | {shown}")

# %% [markdown]
# At T = 1 the distribution is sharp; at T = 2 the runners-up get visible mass. A cross-entropy label says only
# "' Berlin'"; the soft target also says what the teacher considers close, at every position of every text.
#
# ## 2. The loss terms
#
# `minillm.compress.distill` has the three terms of DistilBERT's loss, each switchable: the T²-scaled forward KL
# KL(teacher ‖ student) on softened distributions, cross-entropy on the text, and 1 − cos between the final hidden
# states. Forward KL puts weight where the *teacher* puts probability: the student is pushed to cover every token the
# teacher considers likely.
#
# Why T²: the gradient of the softened KL with respect to the student's logits is (p_s − p_t)/T, and when the two
# models' logits are close, p_s − p_t itself shrinks like 1/T — so the term's gradients fall like 1/T², and the T²
# factor puts them back on the scale of the cross-entropy term. Measure it on the real model (a freshly pruned
# student, far from the teacher, so the 1/T² law holds only roughly):

# %%
student = drop_blocks(copy.deepcopy(teacher), least_important(block_importance(teacher, calibration_ids(tok, 256)),
                                                              14))
batch = torch.tensor([eval_ids(tok, 65)])
with torch.no_grad():
    t_logits = teacher(batch[:, :-1])
s_logits = student(batch[:, :-1]).detach().requires_grad_(True)
print(f"{'T':>4}{'KL (no T^2)':>14}{'|grad| no T^2':>16}{'|grad| with T^2':>18}")
for T in (1.0, 2.0, 4.0, 8.0):
    loss = distillation_loss(s_logits, t_logits, T)
    (g,) = torch.autograd.grad(loss, s_logits)
    print(f"{T:>4.0f}{loss.item() / T**2:>14.4f}{g.norm().item() / T**2:>16.2e}{g.norm().item():>18.2e}")
ce = F.cross_entropy(s_logits[0], batch[0, 1:])
h_s = student.run_layers(student.embed_tokens(batch[:, :-1]), torch.arange(64)[None])
h_t = teacher.run_layers(teacher.embed_tokens(batch[:, :-1]), torch.arange(64)[None])
grads = {T: torch.autograd.grad(distillation_loss(s_logits, t_logits, T), s_logits)[0].norm().item()
         for T in (1.0, 8.0)}
print(f"from T=1 to T=8 the gradient falls {grads[1.0] / (grads[8.0] / 64):,.0f}x without the T^2 factor and "
      f"{grads[1.0] / grads[8.0]:.0f}x with it")
print(f"cross-entropy on the text {ce.item():.3f} nats; "
      f"hidden-state cosine term {hidden_cosine_loss(h_s, h_t).item():.3f}")

# %% [markdown]
# ## 3. The student, and a training loop you can interrupt
#
# The student is the teacher minus its 14 least important blocks (16 of 30 left: lesson 08's block importance). The
# loop in `distill()` is plain PyTorch: the teacher runs under `no_grad`, the student's blocks train with AdamW
# (warm-up, then cosine decay; gradient-norm clipping), the tied embedding/LM head stays frozen (it was not pruned, and
# it is the largest per-token cost of the backward pass). A batch is a pure function of (seed, step), and a checkpoint
# holds the student, the optimizer and the history, written atomically: a run stopped and resumed from its checkpoint
# continues exactly as if it had never stopped. Here, a few steps straight, and the same steps interrupted halfway:

# %%
ids = train_ids(tok)
ev = torch.tensor(eval_ids(tok, 129))
cfg = DistillConfig(steps=pick(6, 4), batch_size=2, seq_len=64, warmup=1, eval_every=100, eval_tokens=128,
                    lr=5e-4, autocast=native_bf16("cpu"))  # bf16 autocast where the CPU has bf16 natively
straight = distill(copy.deepcopy(student), teacher, ids, ev, cfg, progress=False)
ckpt = Path("lesson09_demo.pt")
ckpt.unlink(missing_ok=True)
first = distill(copy.deepcopy(student), teacher, ids, ev, cfg, checkpoint=ckpt, progress=False,
                stop_after=cfg.steps // 2)
resumed = distill(copy.deepcopy(student), teacher, ids, ev, cfg, checkpoint=ckpt, progress=False)
ckpt.unlink()
print("straight:", [round(h["loss"], 4) for h in straight])
print("resumed: ", [round(h["loss"], 4) for h in resumed], "(interrupted after step", len(first), ")")
print(f"identical: {[h['loss'] for h in straight] == [h['loss'] for h in resumed]}; "
      f"{sum(h['tok_s'] for h in straight) / len(straight):.0f} training tokens/s on this machine")

# %% [markdown]
# ## 4. The benchmark: KD vs labels, same budget
#
# `minillm bench distill` starts several students from the same pruned model and trains each on the same batches:
# KD at T = 1, CE only (the text's labels: plain fine-tuning) and, in full mode, KD at T = 2 and DistilBERT's triple
# loss (KD + CE + cosine). T = 1 and the learning rate were chosen on a short pilot run (see the bench's source). The
# data: the pydoc text after its first 8,192 tokens, plus continuations the teacher samples from prompts in that text
# (generated once with the batching engine and cached). Evaluation: the pydoc text's first 512 tokens, never trained
# on. The full run takes tens of minutes on a 2-core CPU, so this lesson reads the run recorded in
# `results/distill.json` (set `RERUN = True` to train here, on your hardware); quick mode runs a tiny version.

# %%
RERUN = False
recorded = Path("../results/distill.json")
if QUICK or RERUN or not recorded.exists():
    result = run_entry("distill", quick=QUICK, save=True, out="../results").to_dict()
else:
    result = json.loads(recorded.read_text())
    print(f"the run recorded in {recorded} ({result['timestamp']}), on: {result['hardware'].get('cpu', '')} "
          f"{result['threads']} thread(s), torch {result['versions'].get('torch', '')}")
rows = {r["variant"]: r for r in result["rows"]}
print(f"\n{'student':<20}{'blocks':>7}{'params':>8}{'ppl':>9}{'KL':>8}{'top-1':>7}{'decode':>9}{'train s':>9}")
for name, r in rows.items():
    dec = f"{r['decode_tok_s']:.1f}" if "decode_tok_s" in r else "-"
    ts = f"{r['train_s']:.0f}" if "train_s" in r else "-"
    print(f"{name:<20}{r['blocks']:>7}{r['params_M']:>7.1f}M{r['ppl']:>9.1f}{r['kl']:>8.3f}{r['top1_agree']:>7.0%}"
          f"{dec:>9}{ts:>9}")
for note in result["notes"]:
    print("note:", note)

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
for name, curve in result["series"].items():
    a1.plot([c["step"] for c in curve], [c["loss"] for c in curve], label=name)
    ev_pts = [(c["step"], c["eval_ppl"]) for c in curve if "eval_ppl" in c]
    a2.plot(*zip(*ev_pts), "o-", label=name)
a1.set_xlabel("step")
a1.set_ylabel("training loss (each run's own objective)")
a1.set_yscale("log")
a1.legend(fontsize=8)
a2.axhline(rows["teacher"]["ppl"], color="gray", ls=":", label="teacher")
a2.set_xlabel("step")
a2.set_ylabel("perplexity, held-apart pydoc head")
a2.set_yscale("log")
a2.legend(fontsize=8)
a2.set_title(result["hardware"].get("cpu", "")[:60], fontsize=8)
plt.tight_layout()
plt.show()

# %%
ra = result["ratios"]
t_ppl, p_ppl = rows["teacher"]["ppl"], rows["pruned, untrained"]["ppl"]
kd, ce = rows["KD (T=1)"], rows["CE only"]
print(f"Pruning alone took perplexity from {t_ppl:.1f} to {p_ppl:.0f}. With the same training tokens, KD reached "
      f"{kd['ppl']:.1f} and CE-only {ce['ppl']:.1f}: KD closed {ra['kd_gap_closed']:.1%} of the perplexity gap, "
      f"CE-only {ra['ce_gap_closed']:.1%}; KD's perplexity is {ra['kd_ppl_over_ce_ppl']:.2f}x CE-only's.")
nats_gap = lambda r: (math.log(p_ppl) - math.log(r["ppl"])) / (math.log(p_ppl) - math.log(t_ppl))
print(f"Measured in nats (log perplexity), which does not flatter a start at {p_ppl:.0f}: KD closed "
      f"{nats_gap(kd):.0%} of the gap, CE-only {nats_gap(ce):.0%}.")
print(f"KL to the teacher: KD {kd['kl']:.3f} vs CE-only {ce['kl']:.3f} nats/token; top-1 agreement "
      f"{kd['top1_agree']:.0%} vs {ce['top1_agree']:.0%}.")
if "KD (T=2)" in rows:
    t2 = rows["KD (T=2)"]
    print(f"Softening to T=2 {'helped' if t2['ppl'] < kd['ppl'] else 'hurt'} at this budget: "
          f"perplexity {t2['ppl']:.1f} vs {kd['ppl']:.1f} at T=1, KL {t2['kl']:.3f} vs {kd['kl']:.3f}.")
if "KD + CE + cosine" in rows:
    tr = rows["KD + CE + cosine"]
    print(f"DistilBERT's triple loss: perplexity {tr['ppl']:.1f}, KL {tr['kl']:.3f}, top-1 {tr['top1_agree']:.0%}.")
print(f"The student decodes {ra['student_decode_vs_teacher']:.2f}x the teacher's tok/s with "
      f"{ra['student_params_vs_teacher']:.0%} of its parameters.")

# %% [markdown]
# How to read it. KD trains on the quantity the KL and agreement columns measure (the teacher's distribution); CE-only
# trains on one-hot labels of the same text, which is what perplexity measures — so each objective has a home column,
# and the printed lines above say which won where on this run. Softening (T = 2) spreads the target over tens of
# thousands of tail tokens: more signal per token for a long run, a distraction from the likely tokens for a short
# one — the line above says which it was here. The budget is tiny for a training run — about twenty thousand tokens
# per student, minutes of CPU — and the gap left is the price of that budget, not the limit of the method (DistilBERT
# trained on billions of tokens). Decode speed comes from the 16 blocks left: the embedding, the LM head and the
# per-step overhead were not pruned, so 53% of the blocks is more than 53% of the time.
#
# ## 5. The student, by name
#
# The bench saves the KD student in the cache directory; `load_model` finds it by name like the real model (and says
# how to train it when it is missing). Lesson 10 uses it as the draft model of speculative decoding: its top-1
# agreement with the teacher above is the fraction of drafted tokens the teacher will accept.

# %%
name = "smollm2-135m-student-quick" if QUICK else "smollm2-135m-student"
student, _ = minillm.load_model(name)
print(f"{name}: {student.config.n_layers} blocks; saved with {student.saved_info.get('budget', {}).get('steps')} "
      f"training steps")
for q in ("The capital of France is", "def fibonacci(n):"):
    for who, m in (("teacher", teacher), ("student", student)):
        print(f"{who:>8}: {q}{minillm.generate(m, tok, q, max_new_tokens=16).text!r}")

# %% [markdown]
# **Exercise 09** (`exercises/ex09_distill.py`, graded by `minillm grade 09`): the distillation loss (graded against
# a reference: the T² factor, the KL direction, log-softmax vs softmax, the reduction axis) and one training step
# (graded: the loss falls on a fixed batch and the teacher receives no gradient); the last task trains the real
# pruned student for a few steps with your code. Next, lesson 10: speculative decoding with this student as the draft.
