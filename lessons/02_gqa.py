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
# Lesson 01 showed that decode is memory-bound and that the KV cache grows with every token of every sequence.
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
from minillm.measure.metrics import decode_bytes_per_token
from minillm.config import LLAMA2_7B, LLAMA2_70B
from minillm.compress.gqa import grouped_attention, kv_heads_for, mean_pool_kv_heads, regroup, to_mha, to_mqa
from minillm.kv_cache import kv_bytes_per_token, max_tokens_in_budget
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
# `enable_gqa=True` path:

# %%
print(f"{'KV heads':>8s} {'K+V MB/layer':>12s} {'minillm sdpa ms':>15s} {'torch enable_gqa ms':>19s}")
for n_kv in (9, 3, 1):
    q = torch.randn(1, cfg.n_heads, 1, cfg.head_dim, dtype=dtype)
    k, v = (torch.randn(1, n_kv, long, cfg.head_dim, dtype=dtype) for _ in range(2))
    ours = time_fn(lambda q=q, k=k, v=v: sdpa_attention(q, k, v), repeat=pick(20, 5)).median
    grouped = n_kv != cfg.n_heads
    torchs = time_fn(lambda q=q, k=k, v=v, g=grouped: F.scaled_dot_product_attention(q, k, v, enable_gqa=g),
                     repeat=pick(20, 5)).median
    print(f"{n_kv:8d} {2 * k.numel() * k.element_size() / 1e6:12.2f} {ours * 1e3:15.3f} {torchs * 1e3:19.3f}")

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
# - **Speed**: decode is memory-bound, so fewer KV bytes per step means faster steps, *in proportion to the share of
#   the step's bytes that the cache is*. For this 135M model at batch 1 the weights (~270 MB in bf16) dominate until
#   the context reaches thousands of tokens, so the gains at 2048 are modest; they grow with context and batch (the
#   weights are read once per step for the whole batch, the cache once per sequence), which is where serving lives.
#   On a CPU, per-operation overhead also blurs small differences; compare each row with its bandwidth roof.
#   (The roofs differ even at short context: MHA's k/v projections are 3x larger too, MQA's 3x smaller.)
# - **Reading the speed table without over-reading it.** Each tok/s is a median of a few repeats on a shared CPU and
#   the table prints no spread, so a difference of some 20% between neighbouring rows (a variant that seems to get
#   *faster* as its context grows) is not evidence of anything. And where the ratio printed under the table between
#   two variants is larger than the ratio of their roofs, bytes cannot be the explanation: multiply the per-layer times
#   of the attention table by the 30 layers and compare that with the difference in step time. On a CPU the attention
#   *kernel* (how it handles each head layout: torch's `enable_gqa` path, minillm's group folded into the query length,
#   plain MHA) can account for more of the gap than the bandwidth does; a rerun of this notebook shows which it is.
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
