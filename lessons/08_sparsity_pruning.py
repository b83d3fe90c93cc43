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
# # Lesson 08 — Sparsity and pruning: zeros that cost quality, and zeros that buy speed
#
# Lesson 07 made every weight smaller. This lesson removes weights. Two questions decide whether that helps:
#
# 1. **Which weights** can go with the least damage? Magnitude pruning drops the smallest |W|. Wanda (Sun et al.,
#    2023) drops the smallest |W| × ‖X‖: the error of removing W[i, j] is W[i, j]·x_j, so a small weight on a loud
#    input channel matters more than a big one on a quiet channel — and lesson 07 showed how loud some of SmolLM2's
#    channels are (the input of `mlp.down`). SparseGPT (Frantar & Alistarh, 2023) goes one step further: after
#    choosing, it changes the weights it keeps so that they make up for the ones it removed.
# 2. **What the zeros buy.** A batch-1 decode step is memory-bound: its floor is the bytes it reads. Zeros scattered
#    inside a dense matrix are still read and still multiplied — **unstructured sparsity speeds up nothing** on a
#    dense kernel, and a sparse format that stores positions is no smaller until far past 50%. **2:4 sparsity** (two
#    of every four consecutive weights are zero) is the hardware's compromise: NVIDIA's sparse tensor cores skip the
#    zeros and the format is 0.56x the bytes of bf16 — but only on those GPUs. **Structured pruning** removes whole
#    blocks, KV groups of heads or FFN channels: a smaller *dense* model, faster on any hardware, at a larger quality
#    cost that lesson 09 (distillation) pays back.
#
# Sections: (1) magnitude vs Wanda on one real layer; (2) SparseGPT: prune and repair; (3) what zeros cost to store;
# (4) the benchmark — quality vs sparsity curves, and speed vs quality of structured pruning; (5) which heads and
# channels, by LLM-Pruner's and LoRAPrune's rules; (6) weight sharing: shared codebooks and shared blocks; (7) a
# pruned model through every engine path, saved for lesson 09; (8) on a GPU.

# %%
import copy
import time

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.engine.llm import LLM
from minillm.course.lesson import hardware_line, pick, recorded
from minillm.gguf.saved import save_model
from minillm.compress.pruning import block_importance, n_params, prune_structured
from minillm.compress.quality import calibration_ids, eval_ids, perplexity
from minillm.compress.llm_pruner import taylor_importance, weight_gradients
from minillm.compress.sparsegpt import HessianAccumulator, sparsegpt_prune_weight
from minillm.sampling import SamplingParams
from minillm.compress.sparsity import (compress_2to4, decompress_2to4, format_bytes, magnitude_scores,
                                      semi_structured_mask, unstructured_mask, wanda_scores)

torch.set_num_threads(1)  # one thread: on a shared 2-core machine a second thread mostly measures the neighbours
print(hardware_line())
model, tok = minillm.load_model(dtype="float32")
calib = calibration_ids(tok, pick(512, 128))  # the tail of the pydoc text; perplexity is scored on its head

# %% [markdown]
# ## 1. Which weights to remove: magnitude vs Wanda on one real layer
#
# Wanda needs the L2 norm of each input channel over some calibration tokens — one forward pass, no gradients.
# Lesson 07 found the outliers at the input of `mlp.down`; the cell measures, for every block, how far its loudest
# input channel stands above the median one, and takes the block where it stands highest. It prunes that layer to
# 50% both ways and measures the error each mask causes *on the layer's output* for calibration activations. Beside
# it, a prediction from the weights and channel norms alone: if input channels were independent, removing W[i, j]
# would add W[i, j]²·‖x_j‖² to the output's squared error.
#
# *Predict before you run the next cell:* both masks remove half of the weights. Will Wanda's output error be about
# the same as magnitude's, half of it, or a small fraction? Write your guess down.

# %%
sum_sq = {}  # block -> per input channel of its mlp.down, the sum of x_j² over the calibration tokens
hooks = [block.mlp.down.register_forward_pre_hook(
    lambda mod, args, i=i: sum_sq.__setitem__(i, args[0].reshape(-1, args[0].shape[-1]).pow(2).sum(0)))
    for i, block in enumerate(model.layers)]
with torch.inference_mode():
    model(torch.tensor([calib]))
for hook in hooks:
    hook.remove()
spread = {i: float(v.sqrt().max() / v.sqrt().median()) for i, v in sum_sq.items()}
pick_block = max(spread, key=spread.get)
print("loudest / median input channel of mlp.down, block by block:", " ".join(f"{spread[i]:.0f}" for i in spread))
print(f"taking block {pick_block} ({spread[pick_block]:.0f}x; the median block: "
      f"{sorted(spread.values())[len(spread) // 2]:.0f}x)")
layer = model.layers[pick_block].mlp.down
seen = []
hook = layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
with torch.inference_mode():
    model(torch.tensor([calib]))
hook.remove()
x = torch.cat(seen)  # (tokens, 1536): the layer's real inputs
norm = x.pow(2).sum(0).sqrt()
w = layer.weight.detach()
masks = {"magnitude (per matrix)": unstructured_mask(magnitude_scores(w), 0.5, per_row=False),
         "magnitude (per row)": unstructured_mask(magnitude_scores(w), 0.5),
         "Wanda (per row)": unstructured_mask(wanda_scores(w, norm), 0.5),
         "Wanda 2:4": semi_structured_mask(wanda_scores(w, norm))}
want = x @ w.T
energy = w.pow(2) * norm.pow(2)  # what each weight adds to the output's squared size, channels taken independent
print(f"input channel norms: median {norm.median():.1f}, max {norm.max():.1f} ({norm.max() / norm.median():.0f}x)")
print(f"{'mask':<24}{'kept':>7}{'predicted error':>17}{'rel. output error':>20}")
pred, meas = {}, {}
for name, mask in masks.items():
    pred[name] = float((energy * ~mask).sum().sqrt() / energy.sum().sqrt())
    meas[name] = float((x @ (w * mask).T - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
    print(f"{name:<24}{mask.float().mean():>7.0%}{pred[name]:>17.2%}{meas[name]:>20.2%}")
agree = (masks["magnitude (per row)"] == masks["Wanda (per row)"]).float().mean()
loud = norm > 10 * norm.median()
share = energy[:, loud].sum() / energy.sum()
dropped = 1 - masks["magnitude (per row)"][:, loud].float().mean()
by_mag, by_wanda = "magnitude (per row)", "Wanda (per row)"
print(f"magnitude and Wanda agree on {agree:.0%} of the weights; they differ on the loud channels")
print(f"predicted Wanda / magnitude error = {pred[by_wanda] / pred[by_mag]:.2f}, measured "
      f"{meas[by_wanda] / meas[by_mag]:.2f}, because the {int(loud.sum())} input channels louder than 10x the median "
      f"({loud.float().mean():.1%} of them) carry {share:.0%} of the output's energy: Wanda keeps their weights, "
      f"magnitude drops {dropped:.0%} of them")

# %% [markdown]
# ## 2. SparseGPT: prune and repair
#
# Magnitude and Wanda only choose which weights to zero; the error the zeros cause stays in the output. SparseGPT
# (Frantar & Alistarh, 2023) also repairs it, layer by layer. For one layer the loss is ‖(W' − W) X‖², X the
# layer's calibration inputs; its Hessian with respect to any row of W is the same matrix, **H = X Xᵀ** (inputs ×
# inputs). The Optimal Brain Surgeon (Hassibi & Stork, 1993) answers both questions from H⁻¹: removing weight w_j
# costs w_j² / [H⁻¹]_jj, and the best change of the weights still free is −(w_j / [H⁻¹]_jj) · H⁻¹[:, j]. The weights
# that stay absorb what the removed one did, through the correlations between input channels — which is what
# choosing alone cannot do.
#
# Exactly, that needs a different H⁻¹ for every row (each row keeps a different set): rows × inputs³ work.
# SparseGPT's trick: sweep the columns left to right and let a removal update only the columns to its right. Then
# every row uses the same sequence of inverses (of the Hessian of columns j, j+1, …), and all of them are rows of one
# Cholesky factor of H⁻¹. The updates of a block of 128 columns reach the rest of the matrix in one matmul (lazy
# batching), and every 128 columns the mask is chosen afresh by the OBS cost w² / [H⁻¹]_jj², on weights already
# updated. It costs more than Wanda's one norm per channel: a Cholesky per layer and a sweep of rows × inputs² per
# matrix — and H must be invertible: with fewer calibration tokens than the layer has inputs, X Xᵀ is singular and
# only the dampening (1% of the mean diagonal added to it) holds the solve to what the calibration text did not show.
#
# The cell takes a typical layer this time — the `mlp.down` of the block whose loudest channel stands at the median
# of section 1's list (three giant channels make any mask look good) — prunes it to 50% four ways, and measures the
# output error on the calibration tokens the Hessian came from *and* on held-out tokens (the head of the text), with
# H from two calibration budgets.
#
# *Predict before you run the next cell:* with H from fewer calibration tokens than the layer has inputs, will
# SparseGPT's held-out error be lower than Wanda's, about the same, or higher? And with eight times the tokens?

# %%
typical = sorted(spread, key=spread.get)[len(spread) // 2]
layer_t = model.layers[typical].mlp.down
w_t = layer_t.weight.detach()


def layer_inputs(ids: list[int], window: int = 256) -> torch.Tensor:
    """What layer_t receives over `ids` (tokens, inputs), a window at a time."""
    got = []
    hook = layer_t.register_forward_pre_hook(lambda mod, args: got.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.inference_mode():
        for i in range(0, len(ids) - 1, window):
            model(torch.tensor([ids[i:i + window]]))
    hook.remove()
    return torch.cat(got)


def rel_error(x_in: torch.Tensor, w_new: torch.Tensor) -> float:
    ref_out = x_in @ w_t.T
    return float((x_in @ w_new.T - ref_out).norm() / ref_out.norm())


x_held = layer_inputs(eval_ids(tok, pick(1024, 256)))
big_calib = calibration_ids(tok, 8 * len(calib))
print(f"mlp.down of block {typical} ({spread[typical]:.0f}x): {w_t.shape[1]} inputs; held-out tokens {len(x_held)}")
print(f"{'calib tokens':>12}  {'mask':<32}{'calib error':>12}{'held-out error':>16}{'seconds':>9}")
errors, ranks = {}, {}
for ids in (calib, big_calib):
    x_cal = layer_inputs(ids)
    acc = HessianAccumulator(w_t.shape[1])
    acc.add(x_cal)
    hess = acc.hessian
    ranks[len(ids)] = int(torch.linalg.matrix_rank(hess))  # how many input directions the tokens pin down
    wanda_keep = unstructured_mask(wanda_scores(w_t, x_cal.pow(2).sum(0).sqrt()), 0.5)
    start = time.perf_counter()
    w_sgpt, sgpt_keep = sparsegpt_prune_weight(w_t, hess, 0.5)
    seconds = time.perf_counter() - start
    variants = {"magnitude per row, zeroed": (w_t * unstructured_mask(magnitude_scores(w_t), 0.5), None),
                "Wanda, zeroed": (w_t * wanda_keep, None),
                "Wanda's mask, repaired by OBS": (sparsegpt_prune_weight(w_t, hess, mask=wanda_keep)[0], None),
                "SparseGPT (its own mask)": (w_sgpt, seconds)}
    for name, (w_new, secs) in variants.items():
        errors[(len(ids), name)] = rel_error(x_cal, w_new), rel_error(x_held, w_new)
        cal, held = errors[(len(ids), name)]
        print(f"{len(ids):>12}  {name:<32}{cal:>12.2%}{held:>16.2%}" + (f"{secs:>8.2f}s" if secs else ""))
for ids in (calib, big_calib):
    s_cal, s_held = errors[(len(ids), "SparseGPT (its own mask)")]
    w_cal, w_held = errors[(len(ids), "Wanda, zeroed")]
    print(f"{len(ids)} calibration tokens ({len(ids) / w_t.shape[1]:.2f} per input): SparseGPT's error is "
          f"{s_cal / w_cal:.2f}x Wanda's on the calibration tokens, {s_held / w_held:.2f}x on held-out ones")
(small, big) = (len(calib), len(big_calib))
held_ratio = {n: errors[(n, "SparseGPT (its own mask)")][1] / errors[(n, "Wanda, zeroed")][1] for n in (small, big)}
print(f"predicted by the least-squares view: below Wanda on the calibration tokens at both budgets, on held-out ones "
      f"only with enough tokens; measured held-out {held_ratio[small]:.2f}x with {small} tokens and "
      f"{held_ratio[big]:.2f}x with {big}, because "
      f"H from {small} tokens has rank {ranks[small]} of {w_t.shape[1]} inputs (from {big}: {ranks[big]})")

# %% [markdown]
# Read the two ratios of each budget together. On the tokens H came from, the repair always wins: it is a least-squares
# fit to them. On new tokens it wins only when enough tokens stood behind H per input; with too few, the fit bends
# the kept weights to the calibration text. Wanda keeps one number per channel and has little to overfit. The
# paper calibrates with 128 × 2048 tokens; section 4's benchmark measures what the budget does to the whole model.

# %% [markdown]
# ## 3. What zeros cost to store
#
# A zero in a dense bf16 matrix still takes 2 bytes. CSR stores each kept value plus its column index — at 50%
# sparsity that is *more* bytes than dense. 2:4 stores the two kept values of every group of four and their two 2-bit
# positions: half the values plus 1 bit per weight of metadata. `compress_2to4` builds that layout from a real pruned
# layer and `decompress_2to4` restores it exactly.

# %%
print(f"{'layer shape':<14}{'dense bf16':>12}{'CSR @50%':>12}{'2:4':>10}")
for shape in [(576, 576), (192, 576), (1536, 576), (576, 1536)]:
    b = format_bytes(shape, 0.5)
    print(f"{str(shape):<14}{b['dense'] / 1024:>10.0f}KB{b['csr'] / 1024:>10.0f}KB{b['2:4'] / 1024:>8.0f}KB")
w24 = (w * masks["Wanda 2:4"]).bfloat16()
values, meta = compress_2to4(w24)
print(f"real layer: values {tuple(values.shape)} bf16 + metadata {tuple(meta.shape)} uint8 = "
      f"{(values.numel() * 2 + meta.numel()) / (w24.numel() * 2):.4f}x dense; "
      f"round trip exact: {torch.equal(decompress_2to4(values, meta), w24)}")

# %% [markdown]
# ## 4. The benchmark
#
# `minillm bench sparsity` prunes a copy of the model per variant and scores perplexity, KL and top-1 agreement
# against the unpruned model on the head of the pydoc text (Wanda calibrates on its tail). Blocks are pruned in
# order, each calibrated on the outputs of the already-pruned blocks before it (as in the Wanda paper). Structured
# variants are also timed: batch-1 decode (variants round-robin, best round) and a 128-token prefill. SparseGPT
# runs on the same calibration tokens as Wanda (rows at 50-70% and 2:4; the quick run keeps 50% only), and its
# `prune_s` column is the price of the repair. The full run adds rows at 60% that change one thing at a time: the
# dampening, or eight times the calibration tokens for both methods.

# %%
result = recorded("sparsity", quick_run=False)  # `minillm bench sparsity` records it (~1 hour on 2 busy cores)
curve = [r for r in result["rows"] if r["part"] == "masks"]
structured = [r for r in result["rows"] if r["part"] == "structured"]
dense = structured[0]

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
for method, style in (("magnitude", "o-"), ("wanda", "s-"), ("sparsegpt", "^-")):
    pts = sorted((r["sparsity"], r["ppl"]) for r in curve if r["method"] == method and r["pattern"] == "unstructured")
    a1.plot(*zip(*pts), style, label=f"{method}, unstructured")
    two4 = [r for r in curve if r["method"] == method and r["pattern"] == "2:4"]
    a1.scatter([r["sparsity"] for r in two4], [r["ppl"] for r in two4], marker="x", s=80, label=f"{method}, 2:4")
a1.axhline(dense["ppl"], color="gray", ls=":", label="unpruned")
a1.set_yscale("log")
a1.set_xlabel("fraction of block weights zeroed")
a1.set_ylabel("perplexity (pydoc head)")
a1.set_title("quality vs sparsity")
a1.legend(fontsize=7)
for r in structured:
    a2.scatter(r["params_removed"], r["decode_tok_s"])
    a2.annotate(r["variant"], (r["params_removed"], r["decode_tok_s"]), fontsize=7)
a2.set_xlabel("fraction of parameters removed")
a2.set_ylabel("batch-1 decode tok/s")
a2.set_title(f"structured pruning — {hardware_line()[:50]}", fontsize=8)
plt.tight_layout()
plt.show()

# %%
by = {r["variant"]: r for r in curve}
mag, wan = by["magnitude unstructured 50%"], by["wanda unstructured 50%"]
print(f"At 50% unstructured sparsity: magnitude perplexity {mag['ppl']:.1f}, Wanda {wan['ppl']:.1f} "
      f"(unpruned {dense['ppl']:.1f}): Wanda's is {mag['ppl'] / wan['ppl']:.1f}x "
      f"{'lower' if wan['ppl'] < mag['ppl'] else 'higher'}, from one forward pass of calibration text.")
m24, w24r = by["magnitude 2:4 50%"], by["wanda 2:4 50%"]
print(f"2:4 (also 50%, but constrained to every group of 4): magnitude {m24['ppl']:.1f}, Wanda {w24r['ppl']:.1f} — "
      f"the constraint costs Wanda {w24r['ppl'] / wan['ppl']:.1f}x in perplexity over free placement.")
print(f"\n{'method, pattern, sparsity':<30}{'ppl':>9}{'KL':>7}{'top-1':>7}{'prune s':>9}")
for r in curve + [r for r in result["rows"] if r["part"] == "calibration"]:
    print(f"{r['variant']:<30}{r['ppl']:>9.1f}{r['kl']:>7.2f}{r['top1_agree']:>7.0%}{r['prune_s']:>9.1f}")
for level in (50, 60, 70):
    sg, wa = by.get(f"sparsegpt unstructured {level}%"), by.get(f"wanda unstructured {level}%")
    if sg and wa:
        print(f"{level}%: SparseGPT perplexity {sg['ppl']:.1f} vs Wanda {wa['ppl']:.1f} "
              f"({sg['ppl'] / wa['ppl']:.2f}x), {sg['prune_s'] / wa['prune_s']:.1f}x Wanda's pruning time")
calib_rows = {(r["method"], r["calib_tokens"], r["damp"]): r for r in result["rows"] if r["part"] == "calibration"}
if calib_rows:
    n_cal = result["settings"]["calibration_tokens"]  # the run's (this notebook's calib may be shorter)
    n_big = max(k[1] for k in calib_rows)
    sg_big, wa_big = calib_rows[("sparsegpt", n_big, 0.01)], calib_rows[("wanda", n_big, None)]
    sg_damp = calib_rows[("sparsegpt", n_cal, 0.1)]
    print(f"At 60% with {n_big} calibration tokens: SparseGPT {sg_big['ppl']:.1f} vs Wanda {wa_big['ppl']:.1f} "
          f"({sg_big['ppl'] / wa_big['ppl']:.2f}x; with {n_cal}: "
          f"{by['sparsegpt unstructured 60%']['ppl'] / by['wanda unstructured 60%']['ppl']:.2f}x); with "
          f"{n_cal} tokens and damp {sg_damp['damp']} instead of {sg_big['damp']}: {sg_damp['ppl']:.1f}.")
print(f"\n{'structured variant':<34}{'removed':>8}{'ppl':>8}{'decode':>9}{'prefill':>9}")
for r in structured:
    print(f"{r['variant']:<34}{r['params_removed']:>8.0%}{r['ppl']:>8.1f}"
          f"{r.get('decode_vs_dense', 1):>8.2f}x{r.get('prefill_vs_dense', 1):>8.2f}x")
best = max(structured[1:], key=lambda r: r["decode_vs_dense"])
print(f"\nLargest decode gain: {best['variant']} ({best['decode_vs_dense']:.2f}x, {best['params_removed']:.0%} of the "
      f"parameters, perplexity {best['ppl'] / dense['ppl']:.1f}x the unpruned model's).")

# %% [markdown]
# How to read the structured table. A decode step's time is the bytes it reads *plus* a fixed cost per operation
# (Python, kernel launches, the attention over the cache). Dropping a block removes both its bytes and its ~dozen
# operations; narrowing the FFN removes bytes only, and removing a KV group removes the fewest bytes (the K/V
# projections are the small ones with GQA). Compare rows with a similar "removed" column to see which of the two
# costs dominates on the machine named above; prefill, which is compute-bound, gains roughly in proportion to the
# FLOPs removed. Which blocks go: those whose output is most similar to their input (section 7 prints the
# importances). Perplexity rises several-fold without any training: lesson 09 distills the unpruned model back into
# the pruned one.

# %% [markdown]
# ## 5. Which heads and channels: three papers' rules at equal parameters
#
# Section 4's structured rows choose KV groups and FFN channels by their *activations* (how much each contributes to
# the output on calibration text). LLM-Pruner (Ma et al., 2023) asks the loss instead. It first finds the coupled
# structures from the model's dependency graph — a KV group is one KV head's rows of `wk`/`wv`, its query heads' rows
# of `wq` and their columns of `wo`; an FFN channel is a row of `gate` and `up` and a column of `down` — so a
# structure is removed whole and the model stays dense. Then, for each, the first-order Taylor estimate of what the
# loss loses without it: Σ |w · ∂L/∂w| over its weights (element-wise) or |Σ w · ∂L/∂w| (vector-wise), from one
# backward pass over calibration text. LoRAPrune (Zhang et al., 2023) computes the same estimate without the frozen
# weights' gradients (a 7B model's would cost 28 GB): with W' = W + s·BA, the adapters see ∂L/∂B = s·G·Aᵀ and
# ∂L/∂A = s·Bᵀ·G, so (∂L/∂B·A + B·∂L/∂A)/s estimates G — what a LoRA fine-tuning run computes anyway, so pruning can
# happen *during* recovery. `minillm bench pruning` gives every rule the same shape (2 of 3 KV groups, 1,024 of 1,536
# channels per block), then the same LoRA recovery budget, and also prunes each structure alone.

# %%

grads = weight_gradients(model, calib, window=pick(128, 64))
kv_t, ffn_t = taylor_importance(model, grads, "element")
print("LLM-Pruner importance of each KV group, block 0 and the last block:",
      [round(v, 2) for v in kv_t[0].tolist()], [round(v, 2) for v in kv_t[-1].tolist()])
pr = recorded("pruning", quick_run=False)  # `minillm bench pruning` records it (its recovery runs take minutes)
rows = {r["method"]: r for r in pr["rows"]}
dense_p = rows.pop("dense")
print(f"\n{'rule':<26}{'params':>8}{'ppl pruned':>11}{'KV only':>9}{'FFN only':>9}{'ppl recovered':>14}{'top-1':>7}")
for name, r in rows.items():
    kv_only = f"{r['ppl_kv_only']:>9.1f}" if "ppl_kv_only" in r else f"{'-':>9}"
    ffn_only = f"{r['ppl_ffn_only']:>9.1f}" if "ppl_ffn_only" in r else f"{'-':>9}"
    print(f"{name:<26}{r['params_M']:>7.1f}M{r['ppl_pruned']:>11.1f}{kv_only}{ffn_only}{r['ppl']:>14.1f}"
          f"{r['top1_agree']:>7.0%}")
print(f"(dense: {dense_p['ppl']:.1f})")
act, el = rows["activation (lesson 08)"], rows["LLM-Pruner element"]
better = lambda a, b: "better" if a < b else "worse"  # noqa: E731
print(f"\nFFN channels alone: LLM-Pruner's rule {el['ppl_ffn_only']:.1f} vs the activation rule "
      f"{act['ppl_ffn_only']:.1f} ({better(el['ppl_ffn_only'], act['ppl_ffn_only'])}); KV groups alone: "
      f"{el['ppl_kv_only']:.1f} vs {act['ppl_kv_only']:.1f} ({better(el['ppl_kv_only'], act['ppl_kv_only'])}).")
fig, ax = plt.subplots(figsize=(8, 3.4))
names = list(rows)
x = range(len(names))
ax.bar([i - 0.2 for i in x], [rows[n]["ppl_pruned"] for n in names], 0.4, label="pruned")
ax.bar([i + 0.2 for i in x], [rows[n]["ppl"] for n in names], 0.4, label="after LoRA recovery")
ax.axhline(dense_p["ppl"], color="gray", ls=":", label="dense")
ax.set_xticks(list(x), names, fontsize=7)
ax.set_yscale("log")
ax.set_ylabel("held-out perplexity")
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %%
ffn_wins, kv_wins = el["ppl_ffn_only"] < act["ppl_ffn_only"], el["ppl_kv_only"] < act["ppl_kv_only"]
print(f"A first-order estimate is exact for a small change (tests/test_llm_pruner.py checks it against the loss's own "
      f"central difference). One FFN channel is 1/{model.config.ffn_dim} of a block's MLP: there the Taylor rule is "
      f"{'the better' if ffn_wins else 'not the better'} choice ({el['ppl_ffn_only']:.1f} vs "
      f"{act['ppl_ffn_only']:.1f}). One KV group is 1/{model.config.n_kv_heads} of a block's attention, far from a "
      f"small change: there it is {'still better' if kv_wins else 'worse'} ({el['ppl_kv_only']:.1f} vs "
      f"{act['ppl_kv_only']:.1f}).")
lp = rows["LoRAPrune (cut at half)"]
print(f"After the same recovery budget: activation {act['ppl']:.1f}, LLM-Pruner {el['ppl']:.1f}, LoRAPrune "
      f"{lp['ppl']:.1f} (its estimate is the gradient projected onto the adapters' {pr['settings']['rank']} "
      f"directions per matrix; what it saves is the frozen weights' gradients, 4 bytes per weight).")

# %% [markdown]
# LLM-Pruner's own recipe also leaves the first and last blocks whole (they change the residual stream the most,
# section 7's importances); here one shape for every block (one ModelConfig) prunes them too.

# %% [markdown]
# ## 6. Weight sharing: a few shared values stand for every weight
#
# The seeds name three ways to shrink a model: prune it (this lesson), distill it (lesson 09), and **share its
# weights**. Lesson 07 gave every group of 64 weights its own evenly spaced 8 or 16 levels (uniform int4/3-bit).
# Shared codebooks place the levels where the weights are instead: k-means over each output row's 576-1,536 values
# picks 8 (3 bits of index) or 16 (4 bits) centres, and every weight stores only the index of its nearest one
# (SqueezeLLM, Kim et al., 2023). K-means minimises the squared error of the *weights*; what matters is the error of
# the *output*, so SqueezeLLM weights each weight by its sensitivity — the Fisher information, the squared gradient of
# the loss — and keeps the rare very large weights exactly (dense-and-sparse). Cross-layer sharing (ALBERT) goes
# further: neighbouring blocks use one set of weights. `minillm bench codebook` measures them beside lesson 07's rows.

# %%
cb = recorded("codebook", quick_run=False)  # `minillm bench codebook` records it (k-means over 106M weights: minutes)
crow = {r["variant"]: r for r in cb["rows"]}
print(f"{'variant':<40}{'bits/weight':>12}{'MB':>8}{'ppl':>11}{'top-1':>7}")
for r in cb["rows"]:
    bits = f"{r['bits_per_weight']:>12.2f}" if "bits_per_weight" in r else f"{'-':>12}"
    print(f"{r['variant']:<40}{bits}{r['weight_MB']:>8.1f}{r['ppl']:>11.1f}{r['top1_agree']:>7.0%}")
u3, c3, c3f = crow["uniform 3-bit g64 RTN"], crow["codebook 3-bit"], crow["codebook 3-bit Fisher"]
c3o = crow["codebook 3-bit +0.5% outliers"]
print(f"\nAt 3 bits: plain k-means {c3['ppl']:.0f} vs uniform {u3['ppl']:.0f} "
      f"({cb['ratios']['codebook3_vs_uniform3_ppl']:.2f}x); keeping 0.5% of the weights exact: {c3o['ppl']:.1f}; "
      f"weighted by the Fisher information: {c3f['ppl']:.1f} "
      f"({cb['ratios']['codebook3_fisher_vs_uniform3_ppl']:.2f}x uniform's, at {c3f['bits_per_weight']:.2f} bits per "
      f"weight against {u3['bits_per_weight']:.2f}).")
shared = crow["blocks shared in pairs (mean), bf16"]
print(f"Blocks shared in pairs without retraining: {cb['ratios']['shared_pairs_bytes_vs_bf16']:.2f}x the bytes, "
      f"perplexity {shared['ppl']:.3g}.")
fig, ax = plt.subplots(figsize=(8, 3.6))
for r in cb["rows"]:
    if "bits_per_weight" in r and r["ppl"] < 1e4:
        ax.scatter(r["bits_per_weight"], r["ppl"], marker="o" if "codebook" in r["variant"] else "s")
        ax.annotate(r["variant"], (r["bits_per_weight"], r["ppl"]), fontsize=6)
ax.axhline(crow["fp32 (reference)"]["ppl"], color="gray", ls=":", label="unquantized")
ax.set_yscale("log")
ax.set_xlabel("bits per weight (indices or codes + tables or scales)")
ax.set_ylabel("held-out perplexity")
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# Why plain k-means loses at 3 bits while its *average* weight error is the lower one: eight centres chosen to
# minimise the squared error follow the bulk of a row, and the few very large weights — the ones lesson 07 showed
# matter most — land in a cluster with ordinary ones, while uniform min/max levels always keep each group's
# extremes. The printed rows measure both cures: keep those weights exact, or let the loss's sensitivity weight
# the clustering. Sharing whole blocks without retraining destroys the model: ALBERT trains the shared weights.
#
# **Stored bits become speed only when the kernel reads them.** The first implementation looked the dense float32
# weight up from the codes on every step and called torch's matmul: 3 bits stored, more than 32 read. The LUT kernel
# (`kernels/cpu/codebook_matmul.cpp`) never builds the weight: a group of 8 codes is one 32-bit load, a variable shift
# spreads them to 8 lanes, and `vpermps` looks each up in the row's table held in one register (a 16-value table is
# two registers and a blend), then one FMA per 8 weights. The bench times both, and here one MLP matrix is timed
# three ways on this machine:

# %%
from minillm.compress.codebook import CodebookLinear, pack_codes  # noqa: E402
from minillm.compress.quant import cpu_kernels, cpu_kernels_disabled  # noqa: E402
from minillm.measure.harness import time_fn  # noqa: E402

print(f"decode tok/s at batch 1 (the bench's run, {cb['settings']['threads']} thread): fp32 "
      f"{crow['fp32 (reference)']['decode_tok_s']:.1f}; codebook 3-bit with the LUT kernel {c3['decode_tok_s']:.1f}, "
      f"with the dense lookup {c3['decode_tok_s_dense_lookup']:.1f} "
      f"({cb['ratios']['codebook3_lut_vs_dense_lookup_decode']:.1f}x); codebook 4-bit "
      f"{crow['codebook 4-bit']['decode_tok_s']:.1f} against int4 on lesson 07's kernel (integer dot products, no "
      f"lookup) {crow['int4 g64 RTN']['decode_tok_s']:.1f} ({cb['ratios']['codebook4_decode_vs_int4']:.2f}x)")
if cpu_kernels() is not None:
    # the 30 up projections in a row (106 MB in float32: more than the caches hold, as in a decode step), against 30
    # 3-bit codebook layers of the same shape (random codes and tables: the kernel's time does not depend on them)
    ups = [layer.mlp.up.weight.detach() for layer in model.layers]
    n_out, n_in = ups[0].shape
    luts = [CodebookLinear(pack_codes(torch.randint(0, 8, (n_out, n_in)), 3), torch.randn(1, 8), 3, n_in)
            for _ in ups]
    x1 = torch.randn(1, n_in)
    with torch.inference_mode():
        t_lut = time_fn(lambda: [m(x1) for m in luts], warmup=2, repeat=pick(20, 3)).median
        t_f32 = time_fn(lambda: [torch.nn.functional.linear(x1, w) for w in ups], warmup=2,
                        repeat=pick(20, 3)).median
        with cpu_kernels_disabled():
            t_dense = time_fn(lambda: [m(x1) for m in luts], warmup=1, repeat=pick(3, 1)).median
    code_bytes, f32_bytes = sum(m.qweight.numel() for m in luts), 4 * sum(w.numel() for w in ups)
    groups = sum(w.numel() for w in ups) / 8
    print(f"30 matrices of {n_out}x{n_in}, 1 row, {torch.get_num_threads()} thread(s): float32 matmul "
          f"{t_f32 * 1e3:.2f} ms ({f32_bytes / t_f32 / 1e9:.1f} GB/s of weights), LUT kernel {t_lut * 1e3:.2f} ms "
          f"({code_bytes / t_lut / 1e9:.1f} GB/s of codes, {t_lut * 1e9 / groups * torch.get_num_threads():.2f} "
          f"thread-ns per group of 8), dense lookup + matmul {t_dense * 1e3:.1f} ms")
    print(f"The LUT kernel reads {f32_bytes / code_bytes:.1f}x fewer bytes than float32 and runs at "
          f"{t_f32 / t_lut:.2f}x its speed: it moves {code_bytes / t_lut / 1e9:.1f} GB/s where float32 streams "
          f"{f32_bytes / t_f32 / 1e9:.1f}, so its time is the lookup's instructions per group, not the memory")
else:
    print("the CPU kernels did not build here: CodebookLinear uses the dense lookup")

# %% [markdown]
# What a codebook buys is the quality at a given number of bits (the table above); its speed is set by the lookup's
# instructions per group of 8, compared with lesson 07's int4 kernel in the first line printed above.

# %% [markdown]
# ## 7. A pruned model through every path, saved for lesson 09
#
# The importance of each block is 1 − cos(input, output) of its hidden states on calibration text: the first and
# last blocks change the residual stream the most. Drop the ten least important; the config says 20 blocks, and
# generate (contiguous and paged caches) and the continuous-batching engine all run it unchanged.

# %%
imp = block_importance(model, calib)
print("block importance:", " ".join(f"{v:.2f}" for v in imp.tolist()))
pruned = copy.deepcopy(model)
report = prune_structured(pruned, calib, drop_n_blocks=10)
print(f"dropped blocks {report['dropped_blocks']}: {n_params(model) / 1e6:.1f}M -> {n_params(pruned) / 1e6:.1f}M "
      f"parameters ({report['params_removed']:.0%} removed); config: {pruned.config.n_layers} layers")
print(f"perplexity: unpruned {perplexity(model, tok, max_tokens=pick(512, 64), window=256):.1f}, "
      f"pruned {perplexity(pruned, tok, max_tokens=pick(512, 64), window=256):.1f}")
prompt = "The capital of France is"
for cache in ("contiguous", "paged"):
    print(f"{cache:>10}: {prompt}{minillm.generate(pruned, tok, prompt, max_new_tokens=12, cache=cache).text!r}")
engine = LLM.from_model(pruned, tok, num_blocks=64)
outs = engine.generate([prompt, "Python is a programming language that"], SamplingParams(max_tokens=12))
for o in outs:
    print(f"    engine: {o.text!r}")
folder = save_model(pruned, "smollm2-pruned-20", info={"dropped_blocks": report["dropped_blocks"]})
print(f"saved to {folder} (lesson 09 starts from it: minillm.gguf.saved.load_saved('smollm2-pruned-20'))")

# %% [markdown]
# ## 8. On a GPU
#
# NVIDIA GPUs from Ampere on run 2:4-sparse fp16/bf16 matmuls on their sparse tensor cores:
# `torch.sparse.to_sparse_semi_structured(w)` compresses a 2:4 weight into the values + metadata layout of section 3
# and `F.linear` dispatches to the sparse kernel. The speedup appears at prefill sizes (the matmul is compute-bound
# and the sparse core does half the math); at batch-1 decode the step is bound by bytes and launch overhead.
# `scripts/gpu_check.sh` times it for this model's shapes (`scripts/gpu_check_sparsity.py`). No GPU was available
# when this notebook was executed: its numbers are the CPU named at the top, where torch has no sparse kernel.
#
# **A roofline model: when 2:4 pays** (`minillm/measure/roofline.py`; a model, not a measurement). A step takes
# max(bytes / bandwidth, FLOPs / FLOP/s) plus its ops × a fixed cost per op (on a GPU the launches overlap the work,
# so the largest term sets the time). A 2:4 kernel reads 0.5625x the bytes of each block matrix (half the values
# plus the positions) and, on a sparse tensor core, spends half the time on its FLOPs; the embedding/LM head stays
# dense. Without a kernel the zeros are read and multiplied like any weight. This CPU's numbers are measured now; the
# H100's are its datasheet's (bf16; the sparse tensor-core rate is twice the dense 989 TFLOP/s).

# %%
from minillm.measure import roofline  # noqa: E402
from minillm.measure.harness import time_fn  # noqa: E402
from minillm.config import LLAMA2_7B  # noqa: E402

cpu, h100, ops = roofline.this_cpu(torch.float32), roofline.H100_SXM, roofline.eager_ops(model)


def sparse_scales(cfg) -> tuple[float, float]:
    """(bytes, matmul FLOPs) of a model whose block matrices are 2:4, as fractions of the dense model's."""
    read = cfg.n_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    blocks = read - cfg.vocab_size * cfg.dim - 2 * cfg.n_layers * cfg.dim  # the head and the norms stay dense
    return (read - blocks + 0.5625 * blocks) / read, (read - blocks + 0.5 * blocks) / read


def speedup(machine, cfg, tokens, kernel=True) -> float:
    n_ops = ops * cfg.n_layers // model.config.n_layers
    byte_scale, flop_scale = sparse_scales(cfg) if kernel else (1.0, 1.0)
    dense, sparse = (roofline.forward_step(cfg, machine, tokens=tokens, context=max(64, tokens // 2), ops=n_ops,
                                           weight_scale=b, matmul_flop_scale=f)
                     for b, f in ((1.0, 1.0), (byte_scale, flop_scale)))
    return machine.seconds(dense) / machine.seconds(sparse)


SMOLLM2 = model.config
cases = [("SmolLM2 decode", SMOLLM2, 1), ("SmolLM2 prefill 2048", SMOLLM2, 2048),
         ("Llama-2-7B decode", LLAMA2_7B, 1), ("Llama-2-7B prefill 2048", LLAMA2_7B, 2048)]
print(f"{'2:4 vs dense, model':<26}" + "".join(f"{name:>24}" for name, _, _ in cases))
for label, machine, kernel in (("this CPU, no 2:4 kernel", cpu, False), ("this CPU, if it had one", cpu, True),
                               ("H100 SXM, sparse cores", h100, True)):
    print(f"{label:<26}" + "".join(f"{speedup(machine, cfg, n, kernel):>23.2f}x" for _, cfg, n in cases))
print(f"({cpu.source}, {cpu.op_seconds * 1e6:.1f} us per op; H100: {h100.source})")
xb = torch.randn(1, w.shape[1])
w24f = w24.float()
dense_s = time_fn(lambda: xb @ w.T, warmup=2, repeat=pick(50, 10)).median
masked_s = time_fn(lambda: xb @ w24f.T, warmup=2, repeat=pick(50, 10)).median
expand_s = time_fn(lambda: xb @ decompress_2to4(values, meta).float().T, warmup=2, repeat=pick(50, 10)).median
print(f"predicted 1.00x on this CPU (no 2:4 kernel: the zeros are read and multiplied), measured on block "
      f"{pick_block}'s mlp.down at batch 1: {dense_s / masked_s:.2f}x with the zeros in a dense matrix, "
      f"{dense_s / expand_s:.2f}x kept in the 2:4 layout and expanded for each call, because without a kernel the "
      f"layout saves bytes at rest and costs work in use; the sign flips where a kernel exists and the step is bound "
      f"by what 2:4 halves: on the H100 model, {speedup(h100, LLAMA2_7B, 2048):.2f}x for a 2048-token Llama-2-7B "
      f"prefill, {speedup(h100, SMOLLM2, 1):.2f}x for this model's launch-bound decode")

# %% [markdown]
# **Exercise 08** (`exercises/ex08_sparsity.py`, graded by `minillm grade 08`): Wanda scores and per-row masks, a
# 2:4 mask, dropping blocks from a model, and LLM-Pruner's Taylor importance of a KV group and an FFN channel (graded
# against sums over each group's weights built by hand, and against the loss's own slope from autograd); the last
# task prunes the real model with your functions, FFN channels chosen by your importance included. Next, lesson 09
# recovers the pruned model's quality by distilling the unpruned one into it.
