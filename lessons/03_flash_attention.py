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
# # Lesson 03 — Naive → flash attention: never materialise N×N
#
# Attention is `softmax(q kᵀ / √d) v`. The textbook way computes the whole score matrix `q kᵀ`: for a prompt of
# N tokens that is an N × N matrix *per head*. At N = 4096 with SmolLM2's 9 heads it is 604 MB in float32 for one
# layer, written to memory, read back for the softmax, written again, read again for the product with `v`. The
# arithmetic is modest; the **memory traffic and the memory footprint grow as O(N²)**, and on a GPU that traffic
# to main memory (HBM) is what bounds attention at long context.
#
# **FlashAttention** (Dao et al., 2022) computes exactly the same result without ever building the matrix. It
# rests on one trick, the **online softmax**: a softmax over a row can be computed block by block if we carry three
# running numbers per row (the maximum score so far `m`, the sum of `exp(score − m)` so far `l`, and the
# unnormalised output `o`) and *rescale* them whenever a later block brings a larger maximum. Then attention is a
# loop over tiles: for each block of queries, stream the keys and values through in blocks, update `(o, m, l)`, and
# divide by `l` at the end. Memory becomes O(N) — one tile at a time — and on a GPU each tile lives in on-chip
# SRAM, so K and V are read from HBM once per query tile instead of the scores making round trips.
#
# This lesson: (1) the online softmax on a small example, (2) the tiled algorithm in torch (`minillm.attention.flash`),
# (3) peak memory vs N, measured, (4) identical results on the real model, (5) honest CPU times, (6) the Triton
# kernel (`minillm_kernels.flash_attn`) and its GPU numbers.

# %%
import inspect
import json
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.attention import naive_attention, sdpa_attention
from minillm.bench.attention import BATCH, HEAD_DIM, N_HEADS, make_inputs, measure_cpu_peaks
from minillm.measure.harness import time_fn
from minillm.attention.flash import flash_attention, merge_partials
from minillm.course.lesson import hardware_line, pick

torch.manual_seed(0)
print(hardware_line())

# %% [markdown]
# ## 1. The online softmax, by hand
#
# One query, eight keys with scores `s` and one-dimensional values `v`. Split the keys into two blocks. Each block
# gives a *partial*: its own max `m`, its sum `l = Σ exp(s − m)`, and `o = Σ exp(s − m) · v`. The two partials are
# relative to *different* maxima, so before adding we rescale each by `exp(m_block − m_new)`. That rescale is the
# whole idea; `merge_partials` does it:

# %% [markdown]
# In symbols, for partials `(o₁, m₁, l₁)` and `(o₂, m₂, l₂)` over disjoint key sets:
#
# ```text
# m = max(m₁, m₂)
# l = exp(m₁ − m)·l₁ + exp(m₂ − m)·l₂
# o = exp(m₁ − m)·o₁ + exp(m₂ − m)·o₂          (output = o / l)
# an empty key set is (o=0, m=−inf, l=0); two empty sets must not produce exp(−inf − (−inf)) = nan
# ```
#
# Exercise 03 asks for `merge_partials`; here it is at work on eight scores:

# %%
s = torch.tensor([1.0, 3.0, 0.5, 2.0, 6.0, 1.5, 4.0, 0.0])  # scores of one query against 8 keys
v = torch.tensor([[10.0], [20.0], [30.0], [40.0], [50.0], [60.0], [70.0], [80.0]])  # (keys, head_dim=1)


def partial(scores, values):
    m = scores.max()
    p = torch.exp(scores - m)
    return p @ values, m, p.sum()


o1, m1, l1 = partial(s[:4], v[:4])
o2, m2, l2 = partial(s[4:], v[4:])
print(f"block 1: m={m1.item():.1f}  l={l1.item():.4f}  o={o1.item():.4f}   (alone: o/l = {(o1 / l1).item():.4f})")
print(f"block 2: m={m2.item():.1f}  l={l2.item():.4f}  o={o2.item():.4f}   (alone: o/l = {(o2 / l2).item():.4f})")
print(f"rescale block 1 by exp({m1.item():.0f} - {max(m1, m2).item():.0f}) = {torch.exp(m1 - max(m1, m2)).item():.4f}")
o, m, l = merge_partials(o1, m1, l1, o2, m2, l2)
print(f"merged : m={m.item():.1f}  l={l.item():.4f}  o/l = {(o / l).item():.6f}")
print(f"full softmax(s) @ v          = {(s.softmax(0) @ v).item():.6f}")
naive_sum = (o1 + o2) / (l1 + l2)
print(f"adding without rescaling gives {naive_sum.item():.6f}  <- wrong: the partials use different maxima")

# %% [markdown]
# ## 2. The tiled algorithm
#
# `flash_attention` applies that merge once per (query block, key block) tile, inline: keep `m`, `l`, `acc` for a
# block of queries; for each key block compute the score *tile*, update the running max, rescale, accumulate.
# Two details matter:
#
# * **causal skipping** — with the causal mask, a key block entirely above the diagonal contributes nothing, so the
#   loop stops at the last key the block's last query may see (about half of the tiles at q_len = kv_len); only
#   tiles that straddle the diagonal need a mask;
# * **GQA without copies** — the queries are viewed as `(batch, kv_heads, group, q_len, d)` so each KV head is read
#   once for its whole group (lesson 02), never repeated in memory.

# %% [markdown]
# The loop, as pseudocode (exercise 03 asks you to write it in torch):
#
# ```text
# for each query tile Qᵢ (block_q rows):
#     m = −inf, l = 0, acc = 0                       one of each per query row
#     for each key tile (Kⱼ, Vⱼ) that some row of Qᵢ may see:
#         S = Qᵢ Kⱼᵀ / √d                            mask the part above the causal diagonal with −inf
#         m_new = max(m, rowmax(S))
#         P = exp(S − m_new)
#         l = exp(m − m_new)·l + rowsum(P)
#         acc = exp(m − m_new)·acc + P Vⱼ
#         m = m_new
#     Oᵢ = acc / l
# ```

# %%
rows = []
for (h, hkv, q_len, kv_len, causal) in [(9, 3, 200, 200, True), (9, 3, 1, 300, True), (9, 3, 37, 300, True),
                                        (4, 4, 130, 130, False)]:
    q = torch.randn(1, h, q_len, HEAD_DIM)  # decode (q_len 1) and chunked prefill (q_len < kv_len) included
    k, v = torch.randn(1, hkv, kv_len, HEAD_DIM), torch.randn(1, hkv, kv_len, HEAD_DIM)
    ref = sdpa_attention(q, k, v, causal=causal)
    rows.append((h, hkv, q_len, kv_len, causal, (naive_attention(q, k, v, causal) - ref).abs().max().item(),
                 (flash_attention(q, k, v, causal) - ref).abs().max().item()))
print(f"{'heads':>6s} {'kv':>3s} {'q_len':>6s} {'kv_len':>7s} {'causal':>7s} "
      f"{'|naive-sdpa|':>13s} {'|flash-sdpa|':>13s}")
for r in rows:
    print(f"{r[0]:6d} {r[1]:3d} {r[2]:6d} {r[3]:7d} {r[4]!s:>7s} {r[5]:13.2e} {r[6]:13.2e}")

n_blocks = 4096 // 64
print(f"\nN=4096, 64x64 tiles: {n_blocks * n_blocks} tiles without the mask, "
      f"{n_blocks * (n_blocks + 1) // 2} with causal skipping ({n_blocks * (n_blocks + 1) / 2 / n_blocks**2:.0%}); "
      f"{n_blocks} of those straddle the diagonal")

# %% [markdown]
# ## 3. Peak memory vs sequence length, measured
#
# SmolLM2's attention shape (batch 1, 9 query heads, 3 KV heads, head_dim 64), causal prefill of N tokens, float32.
# Peak memory is *measured*: in a fresh worker process, the resident-set high-water mark is reset before each call
# and read after it (`minillm.bench.attention`; on a GPU the benchmark uses `torch.cuda.max_memory_allocated`).
# The output itself (N × 9 × 64 floats) is included for every method.
#
# *Predict before you run the next cell:* naive attention materialises a 9 × N × N float32 score matrix. At N = 4096,
# how many MiB is that alone, and roughly how much lower do you expect flash's peak to be? Write both down.

# %%
lengths = pick([256, 512, 1024, 2048, 4096], [128, 256, 512])
t0 = time.perf_counter()
peaks = measure_cpu_peaks([(m, n) for n in lengths for m in ("naive", "flash", "sdpa")])
print(f"measured in {time.perf_counter() - t0:.1f} s")
peak = {(p["method"], p["N"]): p["peak_bytes"] / 2**20 for p in peaks}
print(f"{'N':>6s} {'naive MiB':>10s} {'flash MiB':>10s} {'sdpa MiB':>9s} {'scores MiB':>11s} {'naive/flash':>12s}")
for n in lengths:
    scores = BATCH * N_HEADS * n * n * 4 / 2**20
    print(f"{n:6d} {peak['naive', n]:10.1f} {peak['flash', n]:10.2f} {peak['sdpa', n]:9.2f} {scores:11.1f} "
          f"{peak['naive', n] / peak['flash', n]:12.1f}")
# the prediction from the shapes alone: naive holds the score matrix once plus the output; flash the output plus one
# 64 x 64 score tile per query head (flash_attention's default blocks)
n = lengths[-1]
scores_mib, out_mib = BATCH * N_HEADS * n * n * 4 / 2**20, BATCH * N_HEADS * n * HEAD_DIM * 4 / 2**20
tile_mib = BATCH * N_HEADS * 64 * 64 * 4 / 2**20
pred_naive, pred_flash = scores_mib + out_mib, out_mib + tile_mib
print(f"N = {n}: predicted naive {pred_naive:.0f} MiB (a {scores_mib:.0f} MiB score matrix + the {out_mib:.1f} MiB "
      f"output), flash {pred_flash:.1f} MiB (output + one {tile_mib:.2f} MiB tile), {pred_naive / pred_flash:.0f}x "
      f"lower; measured naive {peak['naive', n]:.0f} MiB, flash {peak['flash', n]:.1f} MiB, "
      f"{peak['naive', n] / peak['flash', n]:.0f}x lower, because naive held "
      f"{(peak['naive', n] - out_mib) / scores_mib:.2f} score matrices at once (scores, masked scores, probabilities) "
      f"and flash {(peak['flash', n] - out_mib) / tile_mib:.1f} tiles' worth beyond its output")

fig, ax = plt.subplots(figsize=(6.4, 4.0))
for method in ("naive", "flash", "sdpa"):
    ax.plot(lengths, [peak[method, n] for n in lengths], marker="o", label=method)
n0 = lengths[0]
ax.plot(lengths, [peak["naive", n0] * (n / n0) ** 2 for n in lengths], "k:", label="∝ N² (from the first point)")
ax.plot(lengths, [peak["flash", n0] * (n / n0) for n in lengths], "k--", label="∝ N")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("sequence length N")
ax.set_ylabel("peak memory of one attention call (MiB)")
ax.set_title("naive materialises N×N; flash keeps tiles")
ax.legend()
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The naive peak follows the N² line (a few copies of the score matrix: scores, masked scores, probabilities); the
# flash peak grows like N, because what remains is the output and one tile. torch's own SDPA on CPU is also a fused,
# tiled kernel, so it is O(N) too.
#
# ## 4. Identical results on the real model
#
# The backend is a name on the model (`model.attn_backend`). Same weights, same prompt, three backends: the logits
# agree to float32 rounding and greedy generation produces the same tokens.

# %%
model, tok = minillm.load_model("smollm2-135m", dtype="float32", device="cpu")
prompt = "Explain in two sentences why the sky is blue."
ids = torch.tensor([tok.encode_chat([{"role": "user", "content": prompt}])])
logits = {}
with torch.no_grad():
    for backend in ("sdpa", "naive", "flash"):
        model.attn_backend = backend
        logits[backend] = model(ids)
for backend in ("naive", "flash"):
    diff = (logits[backend] - logits["sdpa"]).abs().max().item()
    same = torch.equal(logits[backend].argmax(-1), logits["sdpa"].argmax(-1))
    print(f"{backend:5s} vs sdpa over {ids.shape[1]} tokens: max |logit diff| = {diff:.2e}, same argmax: {same}")

n_new = pick(24, 8)
texts = {}
for backend in ("sdpa", "flash"):
    model.attn_backend = backend
    texts[backend] = minillm.generate(model, tok, prompt, max_new_tokens=n_new, chat=True).text
model.attn_backend = "sdpa"
print(f"greedy, {n_new} tokens, sdpa : {texts['sdpa']!r}")
print(f"greedy, {n_new} tokens, flash: {texts['flash']!r}")
print("identical:", texts["sdpa"] == texts["flash"])

# %% [markdown]
# ## 5. Time on this CPU, honestly
#
# Same shapes, timed side by side in one run (the fastest of a few runs: this machine is shared).

# %%
time_lengths = pick([256, 1024, 2048], [128, 256])
fns = {"naive": naive_attention, "flash": flash_attention, "sdpa": sdpa_attention}
times = {}
for n in time_lengths:
    q, k, v = make_inputs(n)
    for name, fn in fns.items():
        times[name, n] = time_fn(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v, causal=True), warmup=1,
                                 repeat=pick(3, 2)).min * 1e3
print(f"{'N':>6s} " + " ".join(f"{name + ' ms':>10s}" for name in fns) + f" {'flash/naive':>12s} {'tiles':>6s}")
for n in time_lengths:
    tiles = (n // 64) * (n // 64 + 1) // 2
    print(f"{n:6d} " + " ".join(f"{times[name, n]:10.1f}" for name in fns)
          + f" {times['flash', n] / times['naive', n]:12.2f} {tiles:6d}")
nl = time_lengths[-1]
print(f"N = {nl}: tile loop / sdpa time = {times['flash', nl] / times['sdpa', nl]:.2f}, naive / sdpa = "
      f"{times['naive', nl] / times['sdpa', nl]:.2f}; fastest here: {min(fns, key=lambda name: times[name, nl])}")

# %% [markdown]
# The `flash/naive` column is the comparison of the two torch implementations in this run (below 1: the loop was
# faster). Two costs pull against each other: each 64×64 tile is a Python iteration issuing about ten small torch ops,
# and every op pays dispatch overhead that one big matmul pays once; naive attention instead writes and re-reads the
# whole N×N score matrix in memory. Both costs grow with N² (so does the `tiles` column): the loop pays per tile, naive
# per score written and read back. Which side wins depends on N and on the machine: read the column, not this
# paragraph. The loop shows the *algorithm* and its memory behaviour; it is not how anyone runs it. The speed comes
# from doing the whole loop inside **one kernel**: torch's `sdpa` on CPU is such a fused kernel (the last line above
# prints its time against both and names the fastest here), and on a GPU the Triton kernel below keeps each tile in
# SRAM and never sends the scores to HBM.
#
# ## 6. The Triton kernel
#
# `minillm_kernels.flash_attn` is the same algorithm as a GPU kernel: one program per (batch, query head, block of
# 128 queries); its KV head is `head // group`; it loops first over the key tiles every query may see (no masks),
# then over the tiles that cross the diagonal or the end of the keys (masked loads, `-inf` scores). The cell below
# prints that outer part of the kernel: the running max and sum start at `-inf` and 0, and both loops hand each key
# tile to `attend_key_block`, the inner step, which is the online softmax again in log2 units so that it can use the
# cheap `exp2` (exercise 03's optional task asks you to write it):

# %%
try:
    from minillm_kernels import flash_attn

    src = inspect.getsource(flash_attn._flash_fwd_kernel.fn)
    print(src[src.index("    m_i = tl.full"):src.index("    out = acc")])  # the kernel's use of attend_key_block
except ImportError as e:  # triton is optional
    flash_attn = None
    print(f"Triton is not installed ({e}); the kernel lives in kernels/flash_attn.py")

# %% [markdown]
# Without a GPU the kernel runs in Triton's **interpreter** (`TRITON_INTERPRET=1`, set automatically when torch sees
# no CUDA): every program of the grid is executed with numpy. That is slow but checks the very code that runs on a
# GPU, masks and all:

# %%
if flash_attn is not None:
    q, k, v = make_inputs(pick(256, 128))
    t0 = time.perf_counter()
    out = flash_attn.triton_attention(q, k, v, causal=True)
    print(f"{'interpreter' if flash_attn.INTERPRET else 'GPU'}: N={q.shape[2]}, {time.perf_counter() - t0:.2f} s, "
          f"max |triton - sdpa| = {(out - sdpa_attention(q, k, v)).abs().max().item():.2e}")

# %% [markdown]
# ## 7. On a GPU
#
# `scripts/gpu_check_flash.py` runs on a CUDA machine: it checks the kernel on GQA, decode and chunked shapes in
# bf16/fp16/fp32 and benchmarks the forward pass at B=4, H=16, N=4096, D=64, bf16, causal against torch SDPA (which
# dispatches to FlashAttention-2/cuDNN kernels) and naive attention, writing `results/attention_gpu.json`. The cell
# below shows that file if it exists.

# %%
gpu_json = Path(minillm.__file__).resolve().parent.parent / "results" / "attention_gpu.json"
if gpu_json.exists():
    gpu = json.loads(gpu_json.read_text())
    print(f"{gpu['gpu']}, torch {gpu['torch']}, triton {gpu['triton']} ({gpu['timestamp']})")
    corr = gpu.get("correctness", {})
    print(f"correctness: {corr.get('passed')}/{corr.get('total')} cases within tolerance")
    for key, res in gpu.get("bench", {}).items():
        print(f"\n{key}, B={gpu['shape']['batch']} H={gpu['shape']['n_heads']} N={gpu['shape']['seq_len']} "
              f"D={gpu['shape']['head_dim']} bf16:")
        for method, r in res.items():
            if "ms" in r:
                print(f"  {method:7s} {r['ms']:8.3f} ms  {r['tflops']:7.1f} TFLOP/s  peak {r['peak_MiB']:9.1f} MiB")
            else:
                print(f"  {method:7s} error: {r.get('error')}")
    if "triton_over_sdpa_tflops" in gpu:
        print(f"\nTriton / SDPA throughput (causal): {gpu['triton_over_sdpa_tflops']:.2f} (target >= 0.7)")
    if gpu.get("sweep"):
        sweep = [r for r in gpu["sweep"] if "triton_tflops" in r and "sdpa_tflops" in r]
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for method in ("triton", "sdpa"):
            ax.plot([r["N"] for r in sweep], [r[f"{method}_tflops"] for r in sweep], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N (batch x N = 16k tokens)")
        ax.set_ylabel("TFLOP/s, causal bf16 forward")
        ax.set_title(gpu["gpu"])
        ax.legend()
        ax.grid(alpha=0.3)
        plt.show()
else:
    print("no results/attention_gpu.json here: the GPU numbers come from `python scripts/gpu_check_flash.py` "
          "run on a CUDA machine (it writes results/attention_gpu.json, which this cell then shows)")

# %% [markdown]
# ## Takeaways
#
# * The online softmax makes attention decomposable over key blocks: `(o, m, l)` partials merge exactly, with a
#   rescale by `exp(m_old − m_new)`.
# * Tiling removes the N × N score matrix: peak memory goes from O(N²) to O(N) (measured above), and on a GPU the
#   HBM traffic for the scores disappears; causal attention also skips the tiles above the diagonal.
# * The result is the same attention, to float rounding — on random tensors and on the real model's logits and text.
# * The speed is a property of the *kernel*, not of the algorithm written in Python: fused (torch SDPA on CPU, the
#   Triton kernel on GPU) against the same algorithm as a Python loop, section 5's last line prints the ratio here.
#
# Exercise 03 (`exercises/ex03_flash.py`, `minillm grade 03`, hints: `minillm hint 03`): write `merge_partials`,
# `flash_attention`, and optionally the Triton kernel's inner step `attend_key_block`. Task 03.speed times your
# `flash_attention` against minillm's tile loop in interleaved pairs: the same algorithm lands near 1x, a loop per
# query row far above the 4x allowed. Benchmark: `minillm bench attention`.
