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
# # Lesson 01 — The KV cache: stop recomputing the past
#
# A decoder generates one token per step, and token *t* attends to the keys and values of tokens 0..*t*. Without
# a cache, step *t* runs the whole model over all *t* tokens again: the keys and values of the past are recomputed
# every step, although they never change (a token's K and V depend only on the tokens before it). Per-token work
# grows with the position, and the total work for *T* tokens grows as *T*².
#
# The **KV cache** stores every layer's keys and values once. A decode step then projects only the new token,
# appends its K/V, and attends over the stored ones: the matmul work per token is constant, and only the attention
# reads grow with context. The price is memory: **2 × layers × kv_heads × head_dim × bytes** per token, per sequence.
#
# This lesson measures both sides on SmolLM2-135M: per-token latency with and without the cache, identical output,
# and what the cache costs in memory as context grows. Exercise 01 implements the cache's write and a decode step's
# attention (`minillm grade 01`); the benchmark is `minillm bench kv-cache`.

# %%
import inspect
from itertools import pairwise

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.measure import roofline
from minillm.measure.breakdown import step_breakdown
from minillm.measure.hardware import hardware_info, hardware_summary, peak_flops
from minillm.measure.metrics import decode_bytes_per_token, model_flops_per_token, weight_bytes
from minillm.config import LLAMA2_7B, LLAMA2_70B, SMOLLM2_135M
from minillm.kv_cache import KVCache, append_kv, kv_bytes, kv_bytes_per_token, max_tokens_in_budget
from minillm.course.lesson import hardware_line, pick
from minillm.compress.quality import eval_ids

print(hardware_line())
hw = hardware_info("cpu")
print("measured roofs:", hardware_summary(hw))
model, tok = minillm.load_model("smollm2-135m", dtype="float32", device="cpu")
print(f"loaded {model.config.n_layers} layers, {model.config.n_heads} query heads, "
      f"{model.config.n_kv_heads} KV heads, head_dim {model.config.head_dim}")

# %% [markdown]
# ## 1. The cache is a buffer and a position
#
# `KVCache` preallocates, per layer, a `(batch, n_kv_heads, max_len, head_dim)` tensor for K and one for V. The model
# hands each layer's new K/V to `attend`, which writes them after the cached positions and attends over the filled
# prefix only. Writing past `max_len` raises `CacheFullError`: a cache that silently wrapped around would overwrite
# the oldest tokens and give wrong answers with no error.

# %% [markdown]
# `append_kv` (exercise 01 asks you to write it) has a small contract:
#
# ```text
# append_kv(k_cache, v_cache, k, v, start) -> end
#     end = start + number of new positions in k
#     end > capacity  ->  raise CacheFullError, write nothing
#     k_cache[:, :, start:end] = k ; v_cache[:, :, start:end] = v
# ```
#
# Here is how the engine's `KVCache.attend` uses it, once per layer per forward:

# %%
print(inspect.getsource(KVCache.attend))

# %% [markdown]
# ## 2. Same text, with and without the cache
#
# `generate(..., cache="none")` is the baseline: every step feeds the whole sequence through the model again.
# Greedy decoding must give the same tokens either way (in float32; in bfloat16 the two paths round differently and a
# near-tie between two tokens can flip).

# %%
question = "Explain in two sentences why the sky is blue."
with_cache = minillm.generate(model, tok, question, max_new_tokens=pick(64, 12), cache="contiguous", chat=True)
without = minillm.generate(model, tok, question, max_new_tokens=pick(64, 12), cache="none", chat=True)
print("with cache:   ", repr(with_cache.text))
print("without cache:", repr(without.text))
print("identical token ids:", with_cache.token_ids == without.token_ids, f"({len(with_cache.token_ids)} tokens)")

# %% [markdown]
# ## 3. Per-token latency vs position
#
# Now a longer run: a 32-token prompt, then a fixed number of new tokens (`ignore_eos`), timing when each token comes
# out. Without the cache, step *t* processes 32 + *t* tokens; with it, one.

# %%
n_new = pick(256, 24)
prompt = eval_ids(tok, 32)  # the first 32 tokens of Python's pydoc topics: real English, always the same
runs = {}
for cache in ("contiguous", "none"):
    minillm.generate(model, tok, prompt, max_new_tokens=4, cache=cache, ignore_eos=True)  # warm-up
    runs[cache] = minillm.generate(model, tok, prompt, max_new_tokens=n_new, cache=cache, ignore_eos=True)


def per_token_ms(result):
    t = result.token_times
    return [(b - a) * 1e3 for a, b in pairwise(t)]  # gap before token i+1: one decode step


lat = {k: per_token_ms(r) for k, r in runs.items()}
print(f"{'position':>8}  {'no cache ms':>11}  {'KV cache ms':>11}")
for i in sorted({0, len(lat['none']) // 4, len(lat['none']) // 2, len(lat['none']) - 1}):
    print(f"{32 + i + 1:8d}  {lat['none'][i]:11.1f}  {lat['contiguous'][i]:11.1f}")
total = {k: r.token_times[-1] for k, r in runs.items()}
print(f"total for {n_new} tokens: no cache {total['none']:.2f} s, KV cache {total['contiguous']:.2f} s "
      f"-> {total['none'] / total['contiguous']:.1f}x faster; identical tokens: "
      f"{runs['none'].token_ids == runs['contiguous'].token_ids}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
positions = [32 + i + 1 for i in range(len(lat["none"]))]
ax1.plot(positions, lat["none"], label="no cache: recompute all tokens")
ax1.plot(positions, lat["contiguous"], label="KV cache: one token")
ax1.set_xlabel("position of the token being generated")
ax1.set_ylabel("ms per token")
ax1.set_title("per-token decode latency")
ax1.legend()
ax1.grid(alpha=0.3)
for k, label in (("none", "no cache (~quadratic)"), ("contiguous", "KV cache (~linear)")):
    ax2.plot(range(1, n_new + 1), runs[k].token_times, label=label)
ax2.set_xlabel("tokens generated")
ax2.set_ylabel("seconds since start")
ax2.set_title("cumulative time")
ax2.legend()
ax2.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the left plot: without the cache each step's latency climbs with the position (the forward pass covers 32 + *t*
# tokens); with the cache it stays flat, because the weights are read once per step whatever the position, and the
# attention over a few hundred cached keys is a small part of the step at this size. Integrated over the run (right),
# that is a parabola against a straight line. The speedup therefore *depends on how many tokens you generate*:
# `minillm bench kv-cache` reports it at 256 new tokens.
#
# ## 4. What the cache costs in memory
#
# Bytes per token = 2 (K and V) × layers × kv_heads × head_dim × bytes per value. Worked examples in fp16:
#
# *Predict before you run the next cell:* Llama-2-7B has 32 layers and 32 KV heads of 128 dims. In fp16, how many GiB
# does the cache of one 4096-token sequence take? Write your number down.

# %%
for name, cfg in (("SmolLM2-135M", SMOLLM2_135M), ("Llama-2-7B", LLAMA2_7B), ("Llama-2-70B", LLAMA2_70B)):
    per_tok = kv_bytes_per_token(cfg, torch.float16)
    print(f"{name:13s} 2 x {cfg.n_layers} layers x {cfg.n_kv_heads} kv_heads x {cfg.head_dim} x 2 B = "
          f"{per_tok:>9,} B/token; {kv_bytes(cfg, 4096) / 2**30:5.2f} GiB for one 4096-token sequence")
budget = 16 * 2**30
print(f"\nwith {budget / 2**30:.0f} GiB for the KV cache (fp16):")
for name, cfg in (("SmolLM2-135M", SMOLLM2_135M), ("Llama-2-7B", LLAMA2_7B), ("Llama-2-70B", LLAMA2_70B)):
    n = max_tokens_in_budget(cfg, budget, torch.float16)
    print(f"  {name:13s} {n:>9,} tokens = batch {n // 4096:4d} at 4096 context, batch {n // 1024:5d} at 1024")
cache = KVCache.for_model(model, batch_size=1, max_len=2048)
print(f"\nallocated: KVCache(batch 1, max_len 2048, {model.dtype}) reserves {cache.nbytes() / 2**20:.1f} MiB "
      f"= kv_bytes formula {kv_bytes(model.config, 2048, dtype=model.dtype) / 2**20:.1f} MiB")
del cache
w16 = weight_bytes(model) / 2  # the weights in fp16
print(f"SmolLM2-135M's fp16 cache outgrows its fp16 weights ({w16 / 2**20:.0f} MiB) at "
      f"{w16 / kv_bytes_per_token(SMOLLM2_135M):,.0f} tokens of batch x context (batch 8: "
      f"{w16 / kv_bytes_per_token(SMOLLM2_135M) / 8:,.0f} tokens each)")
print(f"per token, Llama-2-7B's cache is {kv_bytes_per_token(LLAMA2_7B) / kv_bytes_per_token(SMOLLM2_135M):.1f}x "
      f"SmolLM2-135M's, and Llama-2-70B's is {kv_bytes_per_token(LLAMA2_70B) / kv_bytes_per_token(LLAMA2_7B):.2f}x "
      f"Llama-2-7B's")
# the prediction, checked against the engine's own allocation: a Llama-2-7B-shaped KVCache on the meta device
# (shapes and dtypes, no memory), the same class that reserved SmolLM2's cache above
predicted = 2 * LLAMA2_7B.n_layers * LLAMA2_7B.n_kv_heads * LLAMA2_7B.head_dim * 2 * 4096
reserved = KVCache(LLAMA2_7B, 1, 4096, dtype=torch.float16, device="meta").nbytes()
print(f"predicted {predicted / 2**30:.2f} GiB (2 x {LLAMA2_7B.n_layers} x {LLAMA2_7B.n_kv_heads} x "
      f"{LLAMA2_7B.head_dim} x 2 B x 4096), measured {reserved / 2**30:.2f} GiB reserved by KVCache, because the "
      f"cache holds exactly one K and one V vector per layer, KV head and position: nothing else grows with context")

contexts = [2**i for i in range(7, 16)]
fig, ax = plt.subplots(figsize=(6.4, 4))
for name, cfg in (("SmolLM2-135M", SMOLLM2_135M), ("Llama-2-7B (MHA)", LLAMA2_7B), ("Llama-2-70B (GQA-8)", LLAMA2_70B)):
    ax.plot(contexts, [kv_bytes(cfg, c) / 2**30 for c in contexts], marker="o", label=name)
ax.axhline(weight_bytes(model) / 2 / 2**30, color="gray", ls="--", label="SmolLM2-135M weights (fp16)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("context length (tokens, batch 1)")
ax.set_ylabel("KV cache, GiB (fp16)")
ax.set_title("KV cache size vs context")
ax.legend()
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The cache grows linearly with context and batch; the weights do not. Even for this small model the cache overtakes
# the weights at a modest batch × context (printed above), and from there on memory for the cache, not for the model,
# decides how many sequences fit. Llama-2-7B (32 layers × 32 KV heads × 128 dims) needs 2 GiB for a single
# 4096-token sequence. Llama-2-70B has 2.5x more layers but only 8 KV heads (grouped-query attention, lesson 02), so
# it needs *less* cache per token than the 7B.
#
# ## 5. Why decode is memory-bound
#
# With the cache, a decode step at batch 1 multiplies one token's activations by every weight matrix: each weight is
# read from memory to do 2 FLOPs (one multiply, one add). In float32 that is 0.5 FLOP per byte; a CPU (or GPU) can
# do tens to hundreds of FLOPs in the time it reads one byte. So the step's time is set by *bytes moved*, not FLOPs:
# the roof is bandwidth / (weight bytes + KV bytes read).
#
# **MBU** (model bandwidth utilisation) measures how close a step gets to that roof: *achieved bytes/s over peak
# bytes/s*, where achieved = the bytes the step must read (weights + K/V) / the step's time. The peak on a GPU is its
# datasheet figure; on this CPU it is the bandwidth `hardware_info` measured above (a large copy), the one figure
# every lesson, `minillm generate` and every bench divide by. MFU is the same for FLOP/s.

# %%
ctx = 32 + n_new // 2
bytes_tok = decode_bytes_per_token(model, ctx)
flops_tok = model_flops_per_token(model.config, ctx)
bw, peak = hw["bandwidth_GBps"] * 1e9, peak_flops(torch.float32)
measured_s = sorted(lat["contiguous"])[len(lat["contiguous"]) // 2] / 1e3
print(f"per decode step at context {ctx}: {bytes_tok / 1e6:.0f} MB read, {flops_tok / 1e9:.2f} GFLOP "
      f"-> arithmetic intensity {flops_tok / bytes_tok:.2f} FLOP/byte")
print(f"time if bandwidth-bound: {bytes_tok / bw * 1e3:.1f} ms; if compute-bound: {flops_tok / peak * 1e3:.1f} ms; "
      f"measured (median step): {measured_s * 1e3:.1f} ms")
print(f"MBU = achieved {bytes_tok / measured_s / 1e9:.1f} GB/s / peak {bw / 1e9:.1f} GB/s = "
      f"{bytes_tok / measured_s / bw:.0%}; MFU = {flops_tok / measured_s / peak:.1%} of the measured matmul FLOP/s")
# what fills the gap, measured: one decode step at the same context, timed and then profiled op by op
step = step_breakdown(model, "decode", context=ctx, bandwidth=bw, repeat=pick(7, 3))
print(step.gap_line())
print(f"(its {step.n_ops} ops: {step.terms['else'] / step.n_ops * 1e3:.1f} us of Python/dispatch per op)")

# %% [markdown]
# The bandwidth-bound time is several times the compute-bound time: whatever the implementation, a batch-1 decode step
# cannot beat the time it takes to stream the weights from memory, and the FLOPs are nearly free. The measured step is
# slower than that roof; the ratio is the MBU. What fills the gap is measured, not assumed: the last lines time one
# decode step again, profile it op by op (`minillm.measure.breakdown`), and split its distance from the byte floor
# into the matmuls' own time past the floor, attention, norms/RoPE/elementwise ops, sampling, and everything else
# (Python and dispatch: the ~2,000 ops a step issues), naming the largest. Other processes on a shared machine
# compete for the same cores and memory bus and lengthen every term.
# That a decode step's floor is its bytes is why the next lessons attack *bytes*: fewer KV heads (lesson 02), no wasted
# cache slots (lesson 04), more sequences sharing each weight read (batching, lesson 05). The cache itself also trades
# compute for memory: it removes the recomputation, and in exchange every sequence holds its K/V for its whole life.
#
# **On this machine** (a shared 2-core CPU; see the hardware line above) absolute times move with other processes'
# load, so read ratios measured in the same run.
#
# **A roofline model: when does the cache pay?** (`minillm/measure/roofline.py`; a model, not a measurement.) A step
# takes max(bytes / bandwidth, FLOPs / FLOP/s) plus a fixed cost per op: dispatch on this CPU (measured now), a kernel
# launch on a GPU, where launches overlap the GPU's work and the largest term sets the time. The H100's figures are
# from its datasheet. Without the cache the step at position *t* does *t* tokens' FLOPs; with it, one token's. The
# cache saves FLOPs, so it pays exactly as much as FLOPs were what the step waited for.

# %%
cpu, ops = roofline.this_cpu(torch.float32), roofline.eager_ops(model)
t = 32 + n_new  # the last position of section 3's run; and a long context, where the recomputed FLOPs pile up
for machine in (cpu, roofline.H100_SXM):
    cases = {}
    for name, cfg in (("SmolLM2-135M", SMOLLM2_135M), ("Llama-2-7B", LLAMA2_7B)):
        n_ops = ops * cfg.n_layers // SMOLLM2_135M.n_layers  # the same code per block
        for pos in (t, 4096):
            cases[f"{name} at position {pos}"] = (
                roofline.forward_step(cfg, machine, tokens=pos, context=pos // 2, ops=n_ops),  # no cache
                roofline.forward_step(cfg, machine, tokens=1, context=pos, ops=n_ops))  # KV cache
    rows = roofline.table(cases, machine)
    roofline.print_table(rows)  # before = recompute everything, after = KV cache
    if machine is cpu:
        predicted = rows[0]["speedup"]
    else:
        idle = [r["case"] for r in rows if r["speedup"] < 1.05 and r["bound_before"] == "ops"]
print(f"({cpu.source}, {cpu.op_seconds * 1e6:.1f} us per op, {ops} ops per step; H100: {roofline.H100_SXM.source})")
measured = lat["none"][-1] / lat["contiguous"][-1]
mfu_recompute = t * model_flops_per_token(model.config, t // 2) / (lat["none"][-1] / 1e3) / peak
mbu_cached = decode_bytes_per_token(model, t) / (lat["contiguous"][-1] / 1e3) / bw
print(f"predicted {predicted:.1f}x at position {t} on this CPU, measured {measured:.1f}x (section 3's last step), "
      f"because the model puts both steps on their roofs, and here the recompute step reached {mfu_recompute:.0%} "
      f"of the FLOP/s roof and the cached step {mbu_cached:.0%} of the bandwidth roof (MBU): measured / predicted "
      f"~ {mbu_cached:.2f} / {mfu_recompute:.2f}")
if idle:
    print(f"on the H100 model the cache buys nothing for {', '.join(idle)}: those steps wait for their ~{ops:,} "
          f"kernel launches, not for bytes or FLOPs; it pays once the recomputed FLOPs outgrow the launches, or once "
          f"the launches are gone (one CUDA graph per step, lesson 06)")

# %% [markdown]
# **Exercise 01** (`exercises/ex01_kv_cache.py`): write the cache's write (`append_kv`) and one decode step's
# attention over the filled cache (`decode_attention`). `minillm grade 01` grades them, its last task decoding SmolLM2
# through a cache built from your two functions; `minillm hint 01 [task] --level 1|2|3` when you are stuck.
