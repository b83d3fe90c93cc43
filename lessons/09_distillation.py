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
# # Lesson 09 — Distillation: a small model that keeps the teacher's answers
#
# Lesson 08 made SmolLM2 smaller and faster by dropping whole blocks, and its perplexity exploded: the remaining
# blocks were trained to follow the ones that are gone. Training can repair that, and the cheapest teacher for it is
# the model we started from. **Knowledge distillation** (Hinton et al., 2015; DistilBERT, 2019) trains the small
# *student* to reproduce the large *teacher*. It comes in two kinds, and this lesson needs both:
#
# - **standard KD**: the teacher's next-token distribution at every position of plain text, not just the one token the
#   text happens to contain. A label carries one token's worth of information; the distribution also says which other
#   tokens were plausible ("dark knowledge"). A temperature T > 1 softens both distributions, and the loss is
#   multiplied by T² to keep its gradients on the scale of the label loss.
# - **ability transfer**: what an instruct model can *do* — answer a question, follow an instruction — shows only in
#   its answers. So the teacher answers a few thousand chat prompts with the batching engine, and the student learns
#   those answers: cross-entropy on the teacher's own tokens (sequence-level KD) plus KL to its logits over them.
#
# Why it matters for inference: the student is a cheaper model with (nearly) the teacher's behaviour — the draft model
# of speculative decoding (lesson 10) and the small model of a cascade (lesson 13). Its speed comes from lesson 08
# (fewer blocks); whether it is worth serving is measured here as *retained ability*: on held-out chat prompts the
# student never trained on, how often its greedy answer starts with the teacher's first sentence, token for token.
#
# Sections: (1) what a soft target carries; (2) the loss terms and T²; (3) the teacher's answers as data;
# (4) which blocks to drop; (5) LoRA recovery, and a loop that resumes exactly; (6) the benchmark — a size sweep,
# ability transfer vs text-only KD, adapters vs every weight; (7) the student, by name.

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
from minillm.compress.ability import AbilityConfig, answer_batch, chat_batch_at, distill_ability
from minillm.compress.chat_data import ALWAYS_HELD_OUT, chat_ids, chat_prompts, is_held_out, split
from minillm.compress.distill import distillation_loss, evaluate, hidden_cosine_loss, train_ids
from minillm.compress.lora import add_lora
from minillm.compress.pruning import block_importance, drop_blocks, greedy_block_drop, least_important
from minillm.compress.quality import calibration_ids, eval_ids
from minillm.course.lesson import QUICK, RESULTS, hardware_line, pick
from minillm.gguf.saved import recipe_path
from minillm.measure.hardware import native_bf16
from minillm.measure.harness import paired_ratio
from minillm.measure.metrics import decode_tok_s
from minillm.model import model_bytes

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
# T = 2 is p^(1/2) renormalised: a learner who looks at the six tokens above renormalises over those six alone
p1 = F.softmax(logits, dim=-1)
root = p1.sqrt()
berlin = int(torch.argmax(p1))
six = torch.topk(p1, 6).indices
tail = root.sum() - root[six].sum()
print(f"predicted for T=2 (sqrt of the six shown, renormalised over them): {tok.decode([berlin])!r} "
      f"{float(root[berlin] / root[six].sum()):.3f}; measured {float(root[berlin] / root.sum()):.3f}, because the "
      f"other {p1.numel() - 6:,} tokens' square roots add up to {float(tail):.2f} against {float(root[berlin]):.2f} "
      f"for {tok.decode([berlin])!r}: {float(tail / root.sum()):.0%} of the T=2 mass sits outside the six")

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
# factor puts them back on the scale of the cross-entropy term. That "shrinks like 1/T" is a high-temperature
# limit: it needs T to be large next to the differences between logits. Measure it twice on real logits: for the
# freshly pruned student (far from the teacher; section 4 says which blocks it lost) and for the shipped student
# (section 7, trained).
#
# *Predict before you run the next cell:* with the T² factor, does the gradient stay flat from T = 1 to T = 8?

# %%
recipe = json.loads(Path(f"{recipe_path('smollm2-135m-student')}.json").read_text())  # what the bench chose
pruned = drop_blocks(copy.deepcopy(teacher), recipe["dropped_blocks"])  # the shipped student before training
shipped, _ = minillm.load_model("smollm2-135m-student", dtype="float32")  # rebuilt from minillm/assets on first use
batch = torch.tensor([eval_ids(tok, 65)])
with torch.no_grad():
    t_logits = teacher(batch[:, :-1])
fall = {}
print(f"{'student':<10}{'T':>4}{'KL (no T^2)':>14}{'|grad| no T^2':>16}{'|grad| with T^2':>18}")
for who, model in (("pruned", pruned), ("shipped", shipped)):
    with torch.no_grad():
        s_logits = model(batch[:, :-1])
    s_logits.requires_grad_(True)
    grads = {}
    for T in (1.0, 2.0, 4.0, 8.0):
        loss = distillation_loss(s_logits, t_logits, T)
        (g,) = torch.autograd.grad(loss, s_logits)
        grads[T] = g.norm().item()
        print(f"{who:<10}{T:>4.0f}{loss.item() / T**2:>14.4f}{g.norm().item() / T**2:>16.2e}{g.norm().item():>18.2e}")
    fall[who] = (grads[1.0] / grads[8.0], grads[4.0] / grads[8.0])
spread = (t_logits[0].max(-1).values - t_logits[0].median(-1).values).mean().item()
print(f"predicted (the 1/T^2 law, undone by T^2): flat; measured with the T^2 factor: the gradient falls "
      f"{fall['pruned'][0]:.0f}x (pruned) and {fall['shipped'][0]:.0f}x (shipped) from T=1 to T=8 — but only "
      f"{fall['pruned'][1]:.2f}x and {fall['shipped'][1]:.2f}x from T=4 to T=8 — because the teacher's top logit "
      f"stands {spread:.0f} above its median: only when T is large next to that does softening shrink p_s - p_t like "
      f"1/T (without the factor the fall from T=1 to T=8 is {fall['pruned'][0] * 64:,.0f}x and "
      f"{fall['shipped'][0] * 64:,.0f}x)")
ce = F.cross_entropy(s_logits[0].detach(), batch[0, 1:])
h_s = shipped.run_layers(shipped.embed_tokens(batch[:, :-1]), torch.arange(64)[None])
h_t = teacher.run_layers(teacher.embed_tokens(batch[:, :-1]), torch.arange(64)[None])
print(f"the shipped student's cross-entropy on the text {ce.item():.3f} nats; "
      f"hidden-state cosine term {hidden_cosine_loss(h_s, h_t).item():.3f}")

# %% [markdown]
# How to read it: the T² factor undoes the 1/T² law only where the law holds — at temperatures large next to the
# spread of the logits. Between T = 1 and T = 4 these logits are still sharp after softening, so the gradient with T²
# keeps falling; from T = 4 to T = 8 it has nearly levelled off (the second pair of numbers above). Softening is
# therefore not free at moderate T: it spends the signal on tail tokens. This is why the bench trains at T = 1 (and
# DistilBERT-style soft targets pay off over long runs, not over a few hundred steps).
#
# ## 3. The teacher's answers as data
#
# `minillm.compress.chat_data` builds ~2,300 prompts offline from templates — short questions over facts, arithmetic,
# words, definitions, lists, advice, writing, and tasks over paragraphs of CPython's documentation — and holds some
# out by a hash of their text, plus every prompt that lessons 10 and 13 measure on. The teacher answers each one
# greedily with the batching engine (lesson 05), once; the answers are cached. The student learns the answer tokens
# only: the prompt is given, so its positions carry no loss, and the 49k-way LM head runs only where the loss looks.

# %%
prompts = chat_prompts()
train_prompts, held_prompts = split(prompts)
print(f"{len(prompts)} prompts: {len(train_prompts)} to train on, {len(held_prompts)} held out "
      f"(the {len(ALWAYS_HELD_OUT)} that lessons 10 and 13 measure on among them)")
for p in (train_prompts[0], train_prompts[700], train_prompts[-1][:120] + "..."):
    print("  train:", repr(p))
q = "What is the capital of Japan?"  # held out: lesson 13 asks it
assert is_held_out(q)
ids = chat_ids(tok, q)
for who, model in (("teacher", teacher), ("pruned", pruned)):
    print(f"{who:>8}: {minillm.generate(model, tok, ids, max_new_tokens=24).text!r}")
example = (chat_ids(tok, "Name three fruits."), tok.encode("Apples, bananas and oranges.") + [tok.eos_id])
x, mask = chat_batch_at([example], 0, AbilityConfig(batch_size=1, seq_len=64), tok.eos_id)
print("loss on:", repr(tok.decode(x[0, 1:][mask[0]].tolist())), f"({int(mask.sum())} of {mask.numel()} positions)")

# %% [markdown]
# ## 4. Which blocks to drop
#
# Lesson 08 scored each block alone: 1 − cos(its input, its output), with every other block in place — and dropped
# the lowest scores all at once. That is fine for one block. For fourteen it is not: each score assumed its
# neighbours stay, and the errors of removing several compound in ways no single score saw.
# `greedy_block_drop` removes one block at a time instead: each round tries every remaining block, measures the KL
# its removal costs on a few of the teacher's training answers (the behaviour we want to keep), drops the cheapest,
# and re-measures with it gone. A round re-runs only the blocks after the candidate, so fourteen rounds take a few
# minutes; the bench (section 6) chose the shipped student's blocks this way.
#
# *Predict before you run the next cell:* both ways drop 14 of 30 blocks. How far apart will the two untrained
# students start, in perplexity?

# %%
importance = block_importance(teacher, calibration_ids(tok, 256))
one_shot = least_important(importance, 14)
ev = torch.tensor(eval_ids(tok, pick(257, 129)))
start = {"one-shot importance (lesson 08)": one_shot, "greedy, by KL on answers (the bench)": recipe["dropped_blocks"]}
start_eval = {}
for name, drop in start.items():
    e = start_eval[name] = evaluate(drop_blocks(copy.deepcopy(teacher), drop), teacher, ev)
    print(f"{name:<40} drops {drop}: perplexity {e['ppl']:>9,.0f}, top-1 agreement with the teacher "
          f"{e['top1_agree']:.0%}, KL {e['kl']:.2f} nats/token; summed one-block scores "
          f"{float(importance[drop].sum()):.3f}")
(o_name, o), (g_name, g_) = start_eval.items()
o_score, g_score = (float(importance[d].sum()) for d in start.values())
print(f"predicted by lesson 08's one-block scores (summed 1 - cos of the dropped blocks: one-shot {o_score:.3f}, "
      f"greedy {g_score:.3f}): the one-shot student starts "
      f"{'closer to' if o_score < g_score else 'further from'} the teacher; measured perplexity {o['ppl']:,.0f} vs "
      f"{g_['ppl']:,.0f} ({o['ppl'] / g_['ppl']:,.0f}x apart), because removed together the one-shot blocks cost "
      f"{o['kl']:.2f} nats/token of KL to the teacher and the greedy ones {g_['kl']:.2f}: scores measured one block "
      f"at a time do not add up to the cost of removing {len(one_shot)} at once")
calib = [(chat_ids(tok, p), tok.encode(a) + [tok.eos_id]) for p, a in (
    ("Name three fruits.", "Apples, bananas and oranges."),
    ("Write one sentence about rain.", "Rain taps softly on the window as the grey afternoon turns to evening."))]
x, mask = answer_batch(calib[:pick(2, 1)], tok.eos_id)  # mask: the positions that predict an answer token
first = greedy_block_drop(teacher, x[:, :-1], 1, mask)
print(f"one greedy round here, on {len(x)} answers: block {first[0]} costs the least "
      f"({'in' if first[0] in recipe['dropped_blocks'] else 'not in'} the shipped set)")

# %% [markdown]
# The one-shot choice removes blocks that each looked redundant while their neighbours were there; what removing them
# together costs is the KL printed above, next to the greedy set's. The untrained start is what the training budget
# of section 6 builds on (the bench measures both untrained starts side by side, on a longer text).
#
# ## 5. LoRA recovery, and a training loop you can interrupt
#
# The student keeps 16 of 30 blocks; the 16 left are still good, they just follow neighbours that are gone. LoRA
# (`minillm.compress.lora`; LoRAPrune and LLM-Pruner heal pruned models this way) freezes every weight W and learns
# W + (α/r)·B·A beside it, A (r × in) and B (out × r). B starts at zero, so before training the adapted student *is*
# the pruned one; `merge_lora` folds B·A into W afterwards, so the served student is a plain model at no extra cost.
# What training makes is a few MB — small enough to ship with the course (section 7).
#
# The loop (`distill_ability`) is plain PyTorch: the teacher runs under `no_grad`; AdamW with warm-up and cosine
# decay; gradient-norm clipping; a quarter of the steps are plain-text KD windows so the student keeps the teacher's
# language model. A batch is a pure function of (seed, step), and a checkpoint holds the student, the optimizer and
# the history, written atomically: a run stopped and resumed continues exactly as if it had never stopped.

# %%
student = copy.deepcopy(pruned)
n_total = sum(p.numel() for p in student.parameters())
add_lora(student, rank=32, alpha=64.0)
n_train = sum(p.numel() for p in student.parameters() if p.requires_grad)
print(f"LoRA rank 32 on the 7 matmuls of 16 blocks + their norms: {n_train / 1e6:.2f}M trainable of "
      f"{n_total / 1e6:.1f}M ({n_train / n_total:.1%}); {n_train * 2 / 1e6:.1f} MB in fp16")
examples = [(chat_ids(tok, p), tok.encode(a) + [tok.eos_id]) for p, a in (
    ("Name three fruits.", "Apples, bananas and oranges."), ("What is 2 + 3?", "2 + 3 = 5."))]
cfg = AbilityConfig(steps=pick(6, 2), batch_size=2, seq_len=96, warmup=1, lr=2e-3, kd=1.0, ce=1.0,
                    text_len=48, autocast=native_bf16("cpu"))
text = train_ids(tok)
straight = distill_ability(copy.deepcopy(student), teacher, examples, text, cfg, tok.eos_id, progress=False)
ckpt = Path("lesson09_demo.pt")
ckpt.unlink(missing_ok=True)
first = distill_ability(copy.deepcopy(student), teacher, examples, text, cfg, tok.eos_id, checkpoint=ckpt,
                        progress=False, stop_after=cfg.steps // 2)
resumed = distill_ability(copy.deepcopy(student), teacher, examples, text, cfg, tok.eos_id, checkpoint=ckpt,
                          progress=False)
ckpt.unlink()
print("straight:", [(h["kind"], round(h["loss"], 3)) for h in straight])
print("resumed: ", [(h["kind"], round(h["loss"], 3)) for h in resumed], "(interrupted after step", len(first), ")")
print(f"identical: {[h['loss'] for h in straight] == [h['loss'] for h in resumed]}; "
      f"{sum(h['tokens'] for h in straight) / sum(h['seconds'] for h in straight):.0f} training tokens/s here")

# %% [markdown]
# ## 6. The benchmark: which student, trained how
#
# `minillm bench distill` prunes the teacher to 24, 20 and 16 blocks (chosen greedily, section 4) and trains each
# with LoRA on the same batches for the same steps; at 16 blocks the same budget also trains standard text-only KD
# (no answers) and every weight instead of adapters. The 16-block student then trains on to the full budget and is
# shipped (section 7). Each row is measured the same way: parameters, decode tokens/s at batch 1, perplexity and KL on
# the held-apart pydoc text, and retained ability on held-out prompts — answer match (the student's greedy answer
# starts with the teacher's first sentence, exact tokens) and top-1 agreement on the teacher's answers. The full run
# takes about an hour on a 2-core CPU, so this lesson reads the run recorded in `results/distill.json` (set
# `RERUN = True` to train here, on your hardware); quick mode runs a tiny version.

# %%
RERUN = False
recorded = RESULTS / "distill.json"
if RERUN or not recorded.exists():  # quick mode reads it too (its quick run: tests/test_bench.py, -m slow)
    result = run_entry("distill", quick=QUICK, save=not QUICK, out=RESULTS).to_dict()
else:
    result = json.loads(recorded.read_text())
    print(f"the run recorded in results/{recorded.name} ({result['timestamp']}), on: "
          f"{result['hardware'].get('cpu', '')} {result['threads']} thread(s), "
          f"torch {result['versions'].get('torch', '')}")
rows = {r["variant"]: r for r in result["rows"]}
print(f"\n{'student':<38}{'blocks':>7}{'params':>8}{'decode':>8}{'ppl':>9}{'KL':>7}{'answers':>9}{'top-1':>7}"
      f"{'train':>8}")
for name, r in rows.items():
    ts = f"{r['train_s'] / 60:.0f} min" if "train_s" in r else "-"
    print(f"{name:<38}{r['blocks']:>7}{r['params_M']:>7.1f}M{r['decode_tok_s']:>8.1f}{r['ppl']:>9.1f}{r['kl']:>7.2f}"
          f"{r['answer_match']:>9.0%}{r['answer_top1']:>7.0%}{ts:>8}")
for note in result["notes"]:
    print("note:", note)

# %%
sweep = [r for n, r in rows.items() if "ability KD (LoRA)" in n and "shipped" not in n]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
speed0 = rows["teacher"]["decode_tok_s"]
a1.plot([r["decode_tok_s"] / speed0 for r in sweep], [r["answer_match"] for r in sweep], "o-",
        label="ability KD, LoRA (sweep budget)")
for r in sweep:
    a1.annotate(f"{r['blocks']} blocks", (r["decode_tok_s"] / speed0, r["answer_match"]), fontsize=8)
for name, marker in (("text-only KD (LoRA)", "s"), ("ability KD (all weights)", "^"), ("shipped", "*")):
    r = next((v for n, v in rows.items() if name in n), None)
    if r is not None:
        a1.plot(r["decode_tok_s"] / speed0, r["answer_match"], marker, ms=10, label=name)
a1.axvline(1.5, color="gray", ls=":")
a1.set_xlabel("decode speed vs the teacher (batch 1)")
a1.set_ylabel("held-out answers matching the teacher")
a1.legend(fontsize=8)
for name, curve in result["series"].items():
    chat = [c for c in curve if c["kind"] == "chat"]
    a2.plot([c["step"] for c in chat], [c["ce"] for c in chat], label=name, lw=1)
a2.set_xlabel("step")
a2.set_ylabel("cross-entropy on the teacher's answer tokens")
a2.set_yscale("log")
a2.legend(fontsize=7)
a2.set_title(result["hardware"].get("cpu", "")[:60], fontsize=8)
plt.tight_layout()
plt.show()

# %%
ra = result["ratios"]
t, u = rows["teacher"], rows["keep 16, untrained"]
final = next(v for n, v in rows.items() if "shipped" in n)
spread = result.get("spread", {}).get("student_decode_vs_teacher")
how = ("interleaved pairs" if "rows_decode_vs_teacher" in ra else "its rows' best-of-3, timed minutes apart")
how += (f"; over {len(spread['runs'])} runs min {spread['min']:.2f} / median {spread['median']:.2f} / max "
        f"{spread['max']:.2f}" if spread else "; one recorded run, no spread: section 7 measures it live in "
        "interleaved pairs, with their min/median/max")
print(f"The shipped student: {final['blocks']} of {t['blocks']} blocks, {ra['student_params_vs_teacher']:.0%} of the "
      f"parameters, {ra['student_decode_vs_teacher']:.2f}x the teacher's decode speed in the recorded run "
      f"({how}). On the "
      f"{result['settings'].get('heldout_measured')} held-out prompts its greedy answer starts with the teacher's "
      f"first sentence {final['answer_match']:.0%} of the time (the untrained pruned student: "
      f"{u['answer_match']:.0%}); top-1 agreement on the teacher's answers {final['answer_top1']:.0%} (untrained: "
      f"{u['answer_top1']:.0%}).")
print(f"Perplexity on the pydoc text: teacher {t['ppl']:.1f}, pruned {u['ppl']:,.0f}, shipped {final['ppl']:.1f} — "
      f"{ra['ppl_gap_closed']:.1%} of the gap closed in perplexity, {ra['log_ppl_gap_closed']:.0%} in log-perplexity "
      f"(nats), which does not flatter a start at {u['ppl']:,.0f}.")
one = rows.get("keep 16, untrained (one-shot importance)")
if one is not None:
    print(f"Lesson 08's one-shot block choice would have started at perplexity {one['ppl']:,.0f} (top-1 on answers "
          f"{one['answer_top1']:.0%}, vs {u['answer_top1']:.0%} for the greedy choice). Section 4 measured "
          f"{o['ppl']:,.0f} vs {g_['ppl']:,.0f} for the same two block sets on the first {ev.numel() - 1} tokens of "
          f"the same text; the bench evaluates {result['settings'].get('eval_tokens', '?')}, so the numbers differ "
          f"and the ordering is what carries over.")
sweep16 = rows.get(f"keep {final['blocks']}, ability KD (LoRA)")
if sweep16 is not None and "train_steps" in final:
    print(f"More steps at {final['blocks']} blocks: {sweep16.get('train_steps', '?')} steps gave answer match "
          f"{sweep16['answer_match']:.0%}, top-1 {sweep16['answer_top1']:.0%}, perplexity {sweep16['ppl']:.1f}; "
          f"{final['train_steps']} steps gave {final['answer_match']:.0%}, {final['answer_top1']:.0%}, "
          f"{final['ppl']:.1f}.")
if "rows_decode_vs_teacher" in ra:
    print(f"Decode speed: {ra['student_decode_vs_teacher']:.2f}x from interleaved teacher/student pairs; the rows' "
          f"best-of-3 numbers, measured minutes apart, give {ra['rows_decode_vs_teacher']:.2f}x.")
if "ability_over_text_answer_match" in ra or "ability_minus_text_answer_match" in ra:
    ab, tx = rows["keep 16, ability KD (LoRA)"], rows["keep 16, text-only KD (LoRA)"]
    full = rows["keep 16, ability KD (all weights)"]
    print(f"Same steps, same size: learning the teacher's answers matched {ab['answer_match']:.0%} of held-out "
          f"answers, standard text-only KD {tx['answer_match']:.0%} (top-1 on answers {ab['answer_top1']:.0%} vs "
          f"{tx['answer_top1']:.0%}); text-only KD reached perplexity {tx['ppl']:.1f} vs {ab['ppl']:.1f}.")
    print(f"Adapters vs every weight, same steps: top-1 on answers {ab['answer_top1']:.0%} in "
          f"{ab['train_s'] / 60:.1f} min (LoRA) vs {full['answer_top1']:.0%} in {full['train_s'] / 60:.1f} min (every "
          f"weight; answer match {ab['answer_match']:.0%} vs {full['answer_match']:.0%}). The minutes are wall time "
          f"on a shared machine: compare them with care; what ships is LoRA's, because its update is "
          f"{recipe_path('smollm2-135m-student').stat().st_size / 1e6:.1f} MB and the full student is "
          f"{full['params_M'] * 4:.0f} MB in float32.")
for name, (op, want) in result["targets"].items():
    got = ra[name]
    ok = got >= want if op == ">=" else got > want if op == ">" else got <= want
    shown = f"{got:.3f}"
    if name == "ability_over_text_answer_match" and tx["answer_match"] == 0:
        # runs recorded before the bench stored the difference divided by a 0 clamped to 1e-9: show the two shares
        shown = (f"undefined ({ab['answer_match']:.0%} vs {tx['answer_match']:.0%}: text-only KD matched none), "
                 f"ability minus text {ab['answer_match'] - tx['answer_match']:+.0%} points")
        ok = ab["answer_match"] > tx["answer_match"]
    print(f"target {name} {op} {want}: {shown} {'met' if ok else 'MISSED'}")

# %% [markdown]
# How to read it. Each objective has its home column: text-only KD trains on the quantity perplexity and KL measure
# (the teacher's distribution on plain text), ability transfer on the teacher's answers, which the answer columns
# measure — the lines above say which won where, at equal steps. Blocks buy ability and cost speed: the sweep is the
# DistilBERT-style trade-off; section 7 prints how far the speed-up sits from the share of blocks kept, and what
# explains the difference. The budget is tiny for a training run — minutes of CPU per student; DistilBERT trained on
# billions of tokens — and the line on more steps above says what the longer run bought at 16 blocks.
#
# Was it the start? Section 4's block choice and the bench's untrained rows (the lines above) show how far apart the
# two starts were. An exact first sentence needs every one of its tokens right, so answer match lags per-token
# agreement (the shipped student's two numbers above) and is the last number to move.
#
# ## 7. The student, by name
#
# `load_model("smollm2-135m-student")` works on a fresh checkout without training: the course ships what training
# made — the dropped blocks, the LoRA factors and the block norms, a few MB in `minillm/assets/` with their sha256 —
# and the loader rebuilds the student from the teacher once (seconds), then reads it from the cache. Lesson 10 drafts
# with it; lesson 13 cascades with it. Here it answers held-out questions next to the teacher:

# %%
print(f"smollm2-135m-student: {shipped.config.n_layers} blocks; {shipped.saved_info.get('built_from', 'saved')}")
speed_prompt = eval_ids(tok, 32)
pair = paired_ratio(lambda: decode_tok_s(teacher, speed_prompt, pick(64, 8)),
                    lambda: decode_tok_s(shipped, speed_prompt, pick(64, 8)), pairs=pick(5, 2))
live = sorted(pair.ratios)
print(f"decode at batch 1, here, in {len(pair.ratios)} interleaved pairs: the student is {pair.median:.2f}x the "
      f"teacher's speed (min {live[0]:.2f} / median {pair.median:.2f} / max {live[-1]:.2f}; per pair: "
      f"{[round(r, 2) for r in pair.ratios]}); the recorded run's {ra['student_decode_vs_teacher']:.2f}x lies "
      f"{'inside' if live[0] <= ra['student_decode_vs_teacher'] <= live[-1] else 'outside'} that range")
# a decode step reads every weight once; the tied embedding is read as the LM head and was not pruned
t_bytes, s_bytes = model_bytes(teacher), model_bytes(shipped)
head = teacher.lm_head.weight.numel() * teacher.lm_head.weight.element_size()
print(f"if time followed the blocks kept: {teacher.config.n_layers / shipped.config.n_layers:.2f}x; if it followed "
      f"the bytes a step reads ({t_bytes / 1e6:.0f} vs {s_bytes / 1e6:.0f} MB, the unpruned LM head's "
      f"{head / 1e6:.0f} MB in both): {t_bytes / s_bytes:.2f}x; measured median {pair.median:.2f}x")
for q in ("What is the capital of Japan?", "Who painted the Mona Lisa?", "Give me three tips for staying healthy."):
    ids = chat_ids(tok, q)
    for who, m in (("teacher", teacher), ("student", shipped)):
        print(f"{who:>8}: {q} -> {minillm.generate(m, tok, ids, max_new_tokens=pick(20, 6)).text!r}")

# %% [markdown]
# ### How far more tokens take it
#
# The shipped student stopped at the bench's budget with its answer match still rising. `python -m
# minillm.bench.distill_curve` continues from what shipped (fresh adapters on its weights, the same data and mix)
# and measures the same held-out prompts as it goes. The recorded run:

# %%
curve_path = RESULTS / "distill-curve.json"
if curve_path.exists():
    sc = json.loads(curve_path.read_text())
    pts = sc["curve"]
    for c in pts:
        print(f"step {c['step']:>4}: {c['tokens']:>9,} training tokens, {c['train_s'] / 60:5.1f} CPU-min: answer match "
              f"{c['answer_match']:.3f}, top-1 {c['top1']:.3f}")
    gain = (pts[-1]["answer_match"] - pts[0]["answer_match"]) / (pts[-1]["tokens"] - pts[0]["tokens"]) * 1e6
    rate = (pts[-1]["tokens"] - pts[0]["tokens"]) / (pts[-1]["train_s"] - pts[0]["train_s"])
    print(f"answer match moved {gain:+.3f} per million tokens past the ship, at {rate:,.0f} training tokens/s on "
          f"this CPU ({sc['threads']} threads): another million tokens is {1e6 / rate / 3600:.1f} hours here")
    if sc.get("note"):
        print(f"({sc['note']})")
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.plot([c["tokens"] for c in pts], [c["answer_match"] for c in pts], marker="o", label="answer match")
    ax.plot([c["tokens"] for c in pts], [c["top1"] for c in pts], marker=".", label="top-1 on answers")
    ax.axvline(sc["shipped"]["train_tokens"], ls=":", color="gray", label="shipped")
    ax.set_xlabel("training tokens")
    ax.set_ylabel(f"held-out ({sc['heldout']} prompts)")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
else:
    print("no recorded curve: python -m minillm.bench.distill_curve")

# %% [markdown]
# ## 8. A specialist: the same start, one job
#
# The general student must keep every ability of the teacher in half its blocks, on minutes of CPU, and matches the
# teacher's first sentence on few new prompts. The field's small models that match a large one do it on a *narrow*
# job: DistilBERT's 97% is per task, after distilling on that task. `python -m minillm.recipes.specialist` takes the
# same pruned start (the general student's 16 blocks, fresh LoRA) and distills it on one family of prompts only —
# plurals and opposites ("What is the plural of knife?", "What is the antonym of wet?") — with the teacher's answers
# as targets. It holds out whole phrasings and whole words (an adjective with its opposite), so agreement on them
# measures the skill, not memory. The recorded run, beside the general student and the teacher:

# %%
spec = json.loads((RESULTS / "specialist.json").read_text())
b = spec["budget"]
print(f"recorded: python -m minillm.recipes.specialist ({b['steps']} steps of {b['batch_size']}, {b['tokens']:,} "
      f"tokens, {b['train_s'] / 60:.1f} train-minutes on {b['threads']} threads); held-out phrasings: "
      f"{spec['split']['held_templates']}")
print(f"{'model':>16} {'set':>18} {'n':>4} {'answer match':>13} {'top-1':>7} {'names its word':>15}")
for who, sets in spec["agreement"].items():
    for name, r in sets.items():
        value = f"{r['value_match']:>15.2f}" if "value_match" in r else ""
        print(f"{who:>16} {name:>18} {r['n']:>4} {r['answer_match']:>13.2f} {r['top1_agree']:>7.2f} {value}")
held = spec["agreement"]["specialist"]["in_domain_heldout"]
print("specialist on held-out prompts, by what is new: " + ", ".join(
    f"{k} {held[f'answer_match_{k}']:.2f} (n={held[f'n_{k}']})" for k in ("held_template", "held_entity", "held_both")))
print(f"of the specialist's held-out misses, {(1 - held['value_match']) / (1 - held['answer_match']):.0%} name another "
      f"word than the teacher (the rest: the teacher's word in another form)")
print(f"the teacher names, for a word, the word it names most often for it across phrasings in "
      f"{spec['teacher_consistency']:.0%} of its answers")
print(f"decode, batch 1, one thread, interleaved pairs: specialist {spec['decode']['ratio_median']:.2f}x the teacher")
countries = json.loads((RESULTS / "specialist-countries.json").read_text())["agreement"]["specialist"]
print(f"the same recipe on country facts (results/specialist-countries.json, 80 steps): held-out answer match "
      f"{countries['in_domain_heldout']['answer_match']:.2f}, on its training prompts "
      f"{countries['in_domain_seen']['answer_match']:.2f}")
specialist = minillm.load_model("smollm2-135m-specialist-words", dtype="float32")[0]
for q in ("What is the plural of fox?", "What's the plural of fox?", "What is the opposite word of dirty?"):
    ids = chat_ids(tok, q)
    for who, m in (("teacher", teacher), ("specialist", specialist)):
        print(f"{who:>10}: {q} -> {minillm.generate(m, tok, ids, max_new_tokens=pick(16, 6)).text!r}")

fig, ax = plt.subplots(figsize=(6.5, 3.5))
curve = spec["curve"]
ax.plot([c["step"] for c in curve], [c["heldout_answer_match"] for c in curve], marker="o", label="answer match")
ax.plot([c["step"] for c in curve], [c["heldout_top1"] for c in curve], marker=".", label="top-1 on answers")
ax.axhline(spec["teacher_consistency"], ls="--", color="tab:red", label="the teacher's own consistency")
ax.axhline(0.9, ls=":", color="gray", label="target 90%")
ax.set_xlabel("training steps (8 prompts each)")
ax.set_ylabel("on held-out in-domain prompts")
ax.set_title("the specialist learns its job")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# How to read it. On its job the specialist agrees with the teacher far more often than the general student does,
# on phrasings and words it never saw, and decodes faster (the lines above). It still misses the 90% target, and the
# "names its word" column and the teacher's consistency say why: most misses are not the form of the answer but the
# word in it, and the teacher itself does not name one word per word — asked for the plural of "fox" in two
# phrasings, it names two different words (the examples above, where the two models part). A student that
# learns the *rule* agrees with the teacher only where the teacher follows it; whole-answer agreement with a teacher
# is capped by how predictable the teacher is, and this teacher's own consistency (the dashed line) sits below the
# target. The curve also shows the budget was not the limit: more steps (a first run went to 480) raised agreement
# on the training prompts and lowered it on held-out ones — memorising the teacher's slips does not transfer. The
# countries run is the other half of the lesson: a country's capital is a fact stored in the blocks the student
# dropped, and the recipe learned the answers' form (its training prompts) but not the facts it never saw. Lesson
# 13 puts the specialist behind a router, on a workload where only part of the traffic is its job.
#
# **Exercise 09** (`exercises/ex09_distill.py`, graded by `minillm grade 09`): the distillation loss (graded against
# a reference: the T² factor, the KL direction, log-softmax vs softmax, the reduction axis) and one training step
# (graded: the loss falls on a fixed batch and the teacher receives no gradient); the last task trains the real
# pruned student for a few steps with your code. Next, lesson 10: speculative decoding, with a draft head learned
# from the teacher's own answers and with this student as the draft.
