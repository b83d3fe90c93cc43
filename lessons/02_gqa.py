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
# # Lesson 02 — MHA → MQA → GQA: share key/value heads
#
# Lesson 01 showed that a decode step reads every weight and the whole KV cache, which grows with every token of every
# sequence.
# Attention has `n_heads` query heads; nothing forces each to have its *own* key/value head:
#
# - **MHA** (multi-head attention): one KV head per query head. The original Transformer, Llama-2-7B.
# - **MQA** (multi-query attention, Shazeer 2019): one KV head shared by all query heads. Cache ÷ n_heads.
# - **GQA** (grouped-query attention, Ainslie et al. 2023): `n_kv_heads` groups; the `n_heads / n_kv_heads` adjacent
#   query heads of a group share a KV head. Llama-2-70B (8 KV heads for 64), SmolLM2-135M (3 for 9).
#
# KV bytes per token are 2 × layers × **n_kv_heads** × head_dim × bytes: the cache shrinks, and so do the bytes a
# decode step reads at long context. The question is what it costs in quality. SmolLM2 was *trained* as GQA-3; here
# we convert its real weights to MHA (repeat each KV head: exact) and to MQA (mean-pool the KV heads: the GQA paper's
# starting point before "uptraining") and measure memory, speed and quality. Exercise 02: `minillm grade 02`;
# benchmark: `minillm bench gqa`.

# %%
import inspect

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import minillm
from minillm.attention import sdpa_attention
from minillm.bench.gqa import decode_step_seconds
from minillm.measure.hardware import bf16_status, hardware_info, hardware_summary, preferred_dtype
from minillm.measure.harness import time_fn
from minillm.measure.breakdown import step_breakdown
from minillm.measure.metrics import decode_bytes_per_token
from minillm.model import model_bytes
from minillm.config import LLAMA2_7B, LLAMA2_70B
from minillm.compress.gqa import grouped_attention, kv_heads_for, mean_pool_kv_heads, regroup, to_mha, to_mqa
from minillm.kv_cache import KVCache, kv_bytes, kv_bytes_per_token, max_tokens_in_budget
from minillm.course.lesson import hardware_line, pick
from minillm.compress.quality import eval_ids, kl_to_reference, perplexity_of_ids

print(hardware_line())
hw = hardware_info("cpu")
print("measured roofs:", hardware_summary(hw))
# bf16, the dtype one serves in, where the CPU computes it natively; float32 where bf16 GEMMs are emulated (tens of
# times slower). Nothing below depends on bf16: the conversions work in any dtype (bytes per token scale with it).
dtype_name = preferred_dtype("cpu")
if dtype_name != "bfloat16":
    print(bf16_status("cpu") + "; so this lesson runs in float32")
dtype, short = getattr(torch, dtype_name), {"bfloat16": "bf16", "float32": "fp32"}[dtype_name]
model, tok = minillm.load_model("smollm2-135m", dtype=dtype_name, device="cpu")
cfg = model.config
print(f"SmolLM2-135M: {cfg.n_heads} query heads, {cfg.n_kv_heads} KV heads (group of {cfg.group_size}), "
      f"head_dim {cfg.head_dim}")

# %% [markdown]
# ## 1. Which KV head does a query head read?
#
# Groups are *adjacent* query heads: head h reads KV head h // group. (h % n_kv_heads would interleave the groups;
# that is a different model, and the trained weights only work with the grouping they were trained with.)

# %%
for n_kv in (9, 3, 1):
    print(f"n_kv_heads={n_kv}: query head -> KV head", [kv_heads_for(h, cfg.n_heads, n_kv) for h in range(cfg.n_heads)])

# %% [markdown]
# In symbols, with `group = n_heads / n_kv_heads` and query head `h = g·group + j`:
# `out[h] = softmax(q[h] · k[g]ᵀ / √d + mask) · v[g]`. Exercise 02 asks for this without materialising a copy of K/V per
# query head.

# %% [markdown]
# `grouped_attention` reshapes the 9 query heads into (3 groups × 3) and broadcasts each KV head over its group, so
# K/V are never copied per query head. minillm's SDPA backend does the same for a decode step by folding the group
# into the query-length dimension: (batch, 9, 1, d) becomes (batch, 3, 3, d), three "queries" per KV head.
#
# ## 2. Converting a trained model
#
# A conversion is a transformation of the loaded model (gpt-fast style): it returns a copy with new k/v projections and
# a new config; the original is untouched. Every KV head is first repeated once per query head (MHA, exact), then each
# group of adjacent heads is averaged. Averaging the k-projection *rows* is the same as averaging the keys, even with
# RoPE: the projection is linear, and RoPE rotates every head's key by the same position-dependent angles.

# %% [markdown]
# Pooling, for a k or v projection `W` of shape `(n_kv_heads·head_dim, dim)` and `r = n_kv_heads / new_n_kv_heads`:
# new head `g` is the mean of old heads `g·r … g·r + r − 1`, row block by row block. Exercise 02 asks for that function
# (`mean_pool_kv_heads`); here is the model transformation that uses it:

# %%
print(inspect.getsource(regroup))

# %%
variants = {"MHA (9 KV heads)": to_mha(model), "GQA (3 KV heads, original)": model, "MQA (1 KV head)": to_mqa(model)}
assert regroup(model, 3).config == cfg  # regrouping to what it already has is a plain copy
probe = torch.tensor([eval_ids(tok, 64)])
with torch.inference_mode():
    ref = model(probe).float()
    for name, m in variants.items():
        diff = (m(probe).float() - ref).abs().max().item()
        print(f"{name:28s} KV heads {m.config.n_kv_heads}, k-projection {tuple(m.layers[0].attn.wk.weight.shape)}, "
              f"max |logit - original| = {diff:.3g}")

# %% [markdown]
# ## 3. Memory: KV bytes per token and what fits in a budget
#
# *Predict before you run the next cell:* SmolLM2 keeps 3 KV heads for 9 query heads. With 1 GiB of cache at 2,048
# tokens of context, how many sequences fit for the MHA version (9 KV heads), for GQA (3) and for MQA (1)? Write the
# three numbers down.

# %%
budget = 1 << 30  # 1 GiB for the KV cache
contexts = (2048, 8192)
print(f"{'model':36s} {'KV B/token':>10s} " + " ".join(f"{'max batch @' + str(c):>15s}" for c in contexts)
      + f"   ({short}, {budget / 2**30:.0f} GiB of cache)")
for name, m in variants.items():
    n = max_tokens_in_budget(m.config, budget, dtype)
    print(f"SmolLM2 {name:28s} {kv_bytes_per_token(m.config, dtype):10,d} "
          + " ".join(f"{n // c:15d}" for c in contexts))
for name, c in (("Llama-2-7B (MHA, 32 KV heads)", LLAMA2_7B), ("Llama-2-70B (GQA, 8 KV heads)", LLAMA2_70B),
                ("Llama-2-70B if it were MHA", LLAMA2_70B.with_(n_kv_heads=64))):
    n = max_tokens_in_budget(c, 80 * budget, dtype)
    print(f"{name:36s} {kv_bytes_per_token(c, dtype):10,d} " + " ".join(f"{n // x:15d}" for x in contexts)
          + "   (80 GiB of cache)")
# the prediction is the formula (2 x layers x KV heads x head_dim x bytes per token); the measurement divides the
# budget by what a real 2,048-token cache of each variant allocates
c0 = contexts[0]
for name, m in variants.items():
    mc = m.config
    formula_B = 2 * mc.n_layers * mc.n_kv_heads * mc.head_dim * dtype.itemsize
    real_B = KVCache.for_model(m, 1, c0).nbytes() / c0
    print(f"{name}: predicted {budget // (formula_B * c0)} sequences of {c0} tokens, "
          f"measured {int(budget // (real_B * c0))}, because the allocated cache holds {real_B:,.0f} B per token = "
          f"2 x {mc.n_layers} layers x "
          f"{mc.n_kv_heads} KV heads x {mc.head_dim} x {dtype.itemsize} B ({formula_B:,d})")

# %% [markdown]
# Memory scales exactly with n_kv_heads: MHA needs 3x GQA-3's cache, MQA a third of it. For Llama-2-70B, GQA-8 is
# what makes an 80 GiB cache hold a useful batch at all.
#
# ## 4. Speed: decode at long context
#
# A decode step reads all weights once plus every layer's cached K/V. We fill the cache with `context` tokens (random
# values: a step's cost does not depend on them) and time batch-1 decode steps for each variant.

# %%
ctx_list = pick([256, 1024, 2048], [128, 256])
rows = []
for name, m in variants.items():
    for ctx in ctx_list:
        s = decode_step_seconds(m, ctx, steps=pick(8, 3), repeat=pick(3, 1))
        rows.append({"variant": name, "context": ctx, "tok_s": 1 / s,
                     "roof_tok_s": hw["bandwidth_GBps"] * 1e9 / decode_bytes_per_token(m, ctx),
                     "kv_MB": kv_bytes_per_token(m.config, dtype) * ctx / 1e6})
print(f"{'variant':28s} {'context':>7s} {'KV MB':>7s} {'tok/s':>7s} {'roof tok/s':>10s}")
for r in rows:
    print(f"{r['variant']:28s} {r['context']:7d} {r['kv_MB']:7.1f} {r['tok_s']:7.2f} {r['roof_tok_s']:10.1f}")
long = max(ctx_list)
tps = {r["variant"]: r["tok_s"] for r in rows if r["context"] == long}
names = list(variants)
print(f"\nat {long} tokens: GQA-3 vs MHA {tps[names[1]] / tps[names[0]]:.2f}x, MQA vs GQA-3 "
      f"{tps[names[2]] / tps[names[1]]:.2f}x tokens/s")

# %% [markdown]
# Whether fewer KV heads pay off also depends on the kernel reading them *once*. Per layer, one decode step's
# attention at the longest context: minillm's backend (group folded into the query length) against torch's own
# `enable_gqa=True` path. torch's CPU kernel walks the cache once per head of the call (its batch × heads), with that
# head's queries as the rows of the walk; the table prints how many walks each call makes, the cost of one cached
# token in one walk, and the rate at which the kernel streams the cache against this CPU's copy bandwidth:

# %%
print(f"{'KV heads':>8s} {'K+V MB/layer':>12s} {'minillm sdpa ms':>15s} {'walks':>5s} {'ns/token/walk':>13s} "
      f"{'GB/s':>5s} {'torch enable_gqa ms':>19s} {'walks':>5s} {'ns/token/walk':>13s}")
attn_ms = {}
for n_kv in (9, 3, 1):
    q = torch.randn(1, cfg.n_heads, 1, cfg.head_dim, dtype=dtype)
    k, v = (torch.randn(1, n_kv, long, cfg.head_dim, dtype=dtype) for _ in range(2))
    ours = time_fn(lambda q=q, k=k, v=v: sdpa_attention(q, k, v), repeat=pick(20, 5)).median
    grouped = n_kv != cfg.n_heads
    torchs = time_fn(lambda q=q, k=k, v=v, g=grouped: F.scaled_dot_product_attention(q, k, v, enable_gqa=g),
                     repeat=pick(20, 5)).median
    kv_MB = 2 * k.numel() * k.element_size() / 1e6
    attn_ms[n_kv] = (ours * 1e3, torchs * 1e3)
    # minillm folds the group into the query length: one walk per KV head; torch's path keeps one per query head
    walks_ours, walks_torch = n_kv, cfg.n_heads
    print(f"{n_kv:8d} {kv_MB:12.2f} {ours * 1e3:15.3f} {walks_ours:5d} {ours / (walks_ours * long) * 1e9:13.1f} "
          f"{kv_MB / 1e3 / ours:5.1f} {torchs * 1e3:19.3f} {walks_torch:5d} "
          f"{torchs / (walks_torch * long) * 1e9:13.1f}")
print(f"torch's enable_gqa at 3 KV heads costs {attn_ms[3][1] / attn_ms[9][0]:.2f}x minillm's MHA call (9 walks "
      f"each); minillm's fold at 3 KV heads costs {attn_ms[3][0] / attn_ms[9][0]:.2f}x it (3 walks, "
      f"MHA's time / the fold's = {attn_ms[9][0] / attn_ms[3][0]:.1f}x for 3x the bytes); copy bandwidth "
      f"{hw['bandwidth_GBps']:.1f} GB/s")

# %% [markdown]
# The speed table's ratios against the byte roofs' ratios: the roof counts every byte of the step (weights and cache)
# at copy bandwidth. Where the measured ratio is larger, the step's time is not proportional to its bytes. The step
# breakdown (`minillm.measure.breakdown`) splits one decode step at the longest context into its terms, so the gap
# between two variants can be charged to the term it is made of:

# %%
bw = hw["bandwidth_GBps"] * 1e9
split = {name: step_breakdown(m, "decode", context=long, bandwidth=bw, repeat=pick(5, 2))
         for name, m in variants.items()}
for name, b in split.items():
    kv_GB, w_GB = kv_bytes(variants[name].config, long + 1, 1, dtype) / 1e9, model_bytes(variants[name]) / 1e9
    print(f"{b.line().replace('decode b=1', name)}")
    print(f"    the matmuls stream {w_GB * 1e3:.0f} MB of weights at {w_GB / b.terms['matmul'] * 1e3:.1f} GB/s, "
          f"attention {kv_GB * 1e3:.0f} MB of cache at {kv_GB / b.terms['attention'] * 1e3:.1f} GB/s "
          f"(copy bandwidth {bw / 1e9:.1f} GB/s)")
for a, b in ((names[0], names[1]), (names[1], names[2])):
    A, B, sa, sb = split[a], split[b], a.split(" (")[0], b.split(" (")[0]
    saved = A.wall_ms - B.wall_ms
    diff = {t: A.terms[t] - B.terms[t] for t in A.terms}
    top = max(diff, key=diff.get)
    line = (f"{sa} -> {sb}: step {A.wall_ms:.1f} -> {B.wall_ms:.1f} ms ({A.wall_ms / B.wall_ms:.2f}x; byte roofs "
            f"{A.byte_floor_ms / B.byte_floor_ms:.2f}x, whose bytes at copy bandwidth are worth "
            f"{A.byte_floor_ms - B.byte_floor_ms:.1f} ms); ")
    if saved <= 0:
        line += f"no time saved in this run ({saved:+.1f} ms); attention term {diff['attention']:+.1f} ms"
    else:
        share = diff["attention"] / saved
        line += f"of the {saved:.1f} ms saved, the attention term is {diff['attention']:.1f} ms ({share:.0%})"
        if share < 0.5:
            line += f", under half: the largest term of the difference is {top} ({diff[top]:.1f} ms)"
    print(line)

# %% [markdown]
# ## 5. Quality: what mean-pooling costs
#
# Two measures on real English (the Python docs that ship with Python, `minillm.compress.quality`): the mean KL
# divergence from the original model's next-token distribution (0 = unchanged), and perplexity.

# %%
ids = eval_ids(tok, pick(1024, 128))
quality = {}
for name, m in variants.items():
    quality[name] = (kl_to_reference(m, model, ids), perplexity_of_ids(m, ids, window=512))
print(f"{'variant':28s} {'KL to original (nats/token)':>28s} {'perplexity':>11s}   ({len(ids)} pydoc tokens, {short})")
for name, (kl, ppl) in quality.items():
    print(f"{name:28s} {kl:28.4f} {ppl:11.2f}")

question = "What is the capital of France?"
for name in (names[1], names[2]):
    out = minillm.generate(variants[name], tok, question, max_new_tokens=pick(24, 12), chat=True)
    print(f"{name}: {out.text!r}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
for name in names:
    pts = [(r["context"], r["tok_s"]) for r in rows if r["variant"] == name]
    ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
ax1.set_xlabel("context (tokens in the cache)")
ax1.set_ylabel("decode tokens/s (batch 1)")
ax1.set_title("decode speed vs context")
ax1.legend()
ax1.grid(alpha=0.3)
kv_kb = [kv_bytes_per_token(variants[n].config, dtype) / 1e3 for n in names]
ppl = [quality[n][1] for n in names]
ax2.scatter(kv_kb, ppl)
for n, x, y in zip(names, kv_kb, ppl):
    ax2.annotate(n.split(" (")[0], (x, y), textcoords="offset points", xytext=(5, 5))
ax2.set_xscale("log")
ax2.set_yscale("log")
ax2.set_xlabel(f"KV cache, KB per token ({short})")
ax2.set_ylabel("perplexity on pydoc text (log)")
ax2.set_title("memory vs quality (no retraining)")
ax2.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What the numbers say
#
# - **Memory** follows n_kv_heads exactly: 9 : 3 : 1. At a fixed cache budget GQA-3 fits 3x the batch × context of
#   MHA, MQA 9x.
# - **Speed**: by the roofline, fewer KV bytes per step buy faster steps *in proportion to the share of the step's
#   bytes that the cache is*; for this 135M model at batch 1 the weights (~270 MB in bf16) are most of the bytes
#   until the context reaches thousands of tokens, so the byte roofs' ratios (the breakdown prints them) are far
#   below the cache's 3x. The measured ratios are another matter: the breakdown above prints, for each pair, the step
#   time saved, how much of it is the attention term, and what the saved bytes would be worth at copy bandwidth. Its
#   second line per variant says why the two can differ: the matmuls and the attention kernel stream their bytes at
#   the rates it prints, so a byte of cache need not cost what a byte of weights costs; the table before it shows the
#   attention kernel's cost per cached token per walk and how many walks each head layout makes (torch's `enable_gqa`
#   path keeps one walk per *query* head). The gains grow with context and batch (the weights are read once per step
#   for the whole batch, the cache once per sequence), which is where serving lives.
# - **Reading the speed table without over-reading it.** Each tok/s is a median of a few repeats on a shared CPU and
#   the table prints no spread, so a difference of some 20% between neighbouring rows (a variant that seems to get
#   *faster* as its context grows) is not evidence of anything; the breakdown re-times the longest context on its own,
#   and the two ratios it prints beside the table's show how far a rerun moves them.
# - **Quality**: MHA by repetition is exact (KL 0, same perplexity): it is the same function, with 3x the cache.
#   Going *down* is not free. SmolLM2's three KV heads learned different things; averaging them into one gives every
#   query head a key that none of them was trained to read, in every one of the 30 layers, and the errors compound.
#   The perplexity printed above is the honest price of MQA **without uptraining**: the model is broken. The GQA paper
#   uses mean-pooling only as the *initialisation* and then continues pre-training for ~5% of the original compute to
#   recover quality; the models you download as GQA were trained that way (or from scratch). The lesson: the KV-head
#   count is an architecture decision made before or during training, and the memory it saves is paid for there.

# %% [markdown]
# **Exercise 02** (`exercises/ex02_gqa.py`): write `grouped_attention` (no per-query-head copy of K/V) and
# `mean_pool_kv_heads`. `minillm grade 02` grades them, its last task running SmolLM2 with your attention as its
# backend; `minillm hint 02 [task] --level 1|2|3` when you are stuck.
