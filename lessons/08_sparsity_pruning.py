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
#    channels are (the input of `mlp.down`).
# 2. **What the zeros buy.** A batch-1 decode step is memory-bound: its floor is the bytes it reads. Zeros scattered
#    inside a dense matrix are still read and still multiplied — **unstructured sparsity speeds up nothing** on a
#    dense kernel, and a sparse format that stores positions is no smaller until far past 50%. **2:4 sparsity** (two
#    of every four consecutive weights are zero) is the hardware's compromise: NVIDIA's sparse tensor cores skip the
#    zeros and the format is 0.56x the bytes of bf16 — but only on those GPUs. **Structured pruning** removes whole
#    blocks, KV groups of heads or FFN channels: a smaller *dense* model, faster on any hardware, at a larger quality
#    cost that lesson 09 (distillation) pays back.
#
# Sections: (1) magnitude vs Wanda on one real layer; (2) what zeros cost to store; (3) the benchmark — quality vs
# sparsity curves, and speed vs quality of structured pruning; (4) a pruned model through every engine path, saved
# for lesson 09; (5) on a GPU.

# %%
import copy

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.bench import run_entry
from minillm.engine.llm import LLM
from minillm.course.lesson import QUICK, hardware_line, pick
from minillm.gguf.saved import save_model
from minillm.compress.pruning import block_importance, n_params, prune_structured
from minillm.compress.quality import calibration_ids, perplexity
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
# ## 2. What zeros cost to store
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
# ## 3. The benchmark
#
# `minillm bench sparsity` prunes a copy of the model per variant and scores perplexity, KL and top-1 agreement
# against the unpruned model on the head of the pydoc text (Wanda calibrates on its tail). Blocks are pruned in
# order, each calibrated on the outputs of the already-pruned blocks before it (as in the Wanda paper). Structured
# variants are also timed: batch-1 decode (variants round-robin, best round) and a 128-token prefill.

# %%
result = run_entry("sparsity", quick=QUICK, save=False)  # shown here; `minillm bench sparsity` records it
curve = [r for r in result.rows if r["part"] == "masks"]
structured = [r for r in result.rows if r["part"] == "structured"]
dense = structured[0]

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
for method, style in (("magnitude", "o-"), ("wanda", "s-")):
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
# FLOPs removed. Which blocks go: those whose output is most similar to their input (section 4 prints the
# importances). Perplexity rises several-fold without any training: lesson 09 distills the unpruned model back into
# the pruned one.

# %% [markdown]
# ## 4. A pruned model through every path, saved for lesson 09
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
# ## 5. On a GPU
#
# NVIDIA GPUs from Ampere on run 2:4-sparse fp16/bf16 matmuls on their sparse tensor cores:
# `torch.sparse.to_sparse_semi_structured(w)` compresses a 2:4 weight into the values + metadata layout of section 2
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
# 2:4 mask, and dropping blocks from a model; the last task prunes the real model with your functions. Next, lesson 09
# recovers the pruned model's quality by distilling the unpruned one into it.
