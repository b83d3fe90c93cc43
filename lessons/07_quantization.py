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
# # Lesson 07 — Quantization: fewer bytes per weight (int8, LLM.int8(), int4, AWQ) and an int8 KV cache
#
# A batch-1 decode step reads every weight once to produce one token: about 2 flops per bf16 weight byte, far below
# what any chip computes per byte it loads, so the step is **memory-bound** and its best time is
# *weight bytes / memory bandwidth*. Fewer bits per weight is therefore the first lever of inference at small
# batch: int8 halves the bytes of bf16, int4 quarters them — **if the matmul kernel reads the small integers and
# dequantizes in registers** (`minillm/compress/quant.py` on CPU with torch's int8/int4 kernels;
# `kernels/quant_matmul.py` in Triton on a GPU). The price is quality, which this lesson measures three ways against the
# reference model:
# perplexity, KL divergence per token, and top-1 agreement.
#
# The same idea applies to the **KV cache**: at large batch and long context it, not the weights, fills memory
# (lesson 04), and int8 keys/values with a scale per token and head fit ~2x the sequences in the same bytes.
#
# Sections: (1) the model file is already 4-bit; (2) the formats on one real weight; (3) LLM.int8() and the outlier
# features of a 135M model; (4) the benchmark — bytes, speed and quality of every scheme in one run, and the Pareto
# plot; (5) the int8 KV cache in the engine; (6) on a GPU.

# %%
import collections

import matplotlib.pyplot as plt
import torch
from gguf import GGUFReader

import minillm
from minillm.bench import run_entry
from minillm.bench.hardware import bf16_status
from minillm.course.lesson import QUICK, hardware_line, pick
from minillm.compress.llm_int8 import outlier_profile
from minillm.compress.quality import eval_ids
from minillm.compress.quant import Int4Linear, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from minillm.gguf.weights import gguf_path

torch.set_num_threads(1)  # one thread: on a shared 2-core machine a second thread mostly measures the neighbours
print(hardware_line())
print(bf16_status("cpu"))

# %% [markdown]
# ## 1. The "full-precision" model is a dequantized 4-bit model
#
# SmolLM2 reaches us as a GGUF file, and GGUF files are usually quantized. Count the tensor types:

# %%
reader = GGUFReader(str(gguf_path()))
kinds = collections.Counter(t.tensor_type.name for t in reader.tensors)
print(dict(kinds), "of", len(reader.tensors), "tensors")
print("token_embd:", next(t.tensor_type.name for t in reader.tensors if t.name == "token_embd.weight"))

# %% [markdown]
# Q4_1 stores 32 weights in 20 bytes: a float16 scale *d*, a float16 minimum *m*, and 32 four-bit codes *q*, with
# weight = q·d + m (5 bits per weight). Q8_0 stores 32 int8 values and one scale. Every lesson so far *expanded* these
# to float32/bf16 at load. So the fp32 model of lessons 00-06 is the dequantized Q4_1 model, and it is the reference
# for every quality number below: "lossless" here means "equal to the file".
#
# `load_model(weights="q4")` does not expand: each Q4_1 tensor becomes an `Int4Linear` holding the file's codes, d
# and m bit for bit. Round-to-nearest from the dequantized weights, with the same rule as llama.cpp's quantizer,
# finds the same codes again:

# %%
q4_model, tok = minillm.load_model(dtype="bfloat16", weights="q4")
fp32_model, _ = minillm.load_model(dtype="float32")
layer = q4_model.layers[5].mlp.down
codes, scale, minimum = quantize_int4(fp32_model.layers[5].mlp.down.weight, 32)
print(f"{type(layer).__name__} {tuple(layer.qweight.shape)} uint8 + scale/minimum {tuple(layer.scale.shape)} fp16")
print(f"dequantized file layer == fp32 model's weight: "
      f"{torch.equal(layer.dequantize(), fp32_model.layers[5].mlp.down.weight)}")
print(f"codes re-derived by round-to-nearest equal to the file's: {(codes == layer.codes()).float().mean():.2%}")
print(f"weight bytes: fp32 {minillm.model.model_bytes(fp32_model) / 1e6:.0f} MB, "
      f"file layers kept 4-bit {minillm.model.model_bytes(q4_model) / 1e6:.0f} MB "
      f"(the tied Q8_0 embedding/LM head stays {q4_model.dtype})")
del q4_model

# %% [markdown]
# ## 2. The formats on one real weight
#
# **int8 per output channel, symmetric**: each row gets a scale max|w|/127 and w ≈ q·scale with q in [-127, 127].
# **int4 group-wise, asymmetric**: each group of g inputs gets its own scale and minimum; smaller groups follow the
# local range (less error) but store more scale bytes per weight. Error is relative to the weight's RMS.
#
# *Predict before you run the next cell:* int8 has 255 levels per row, int4 has 16 per group. Roughly how many times
# larger do you expect int4 g64's relative error to be than int8's on this weight? Write your number down.

# %%
w = fp32_model.layers[12].attn.wq.weight
rms = w.pow(2).mean().sqrt()
q, s = quantize_int8(w)
rows = [("int8 per channel", 8 + 32 / w.shape[1], (dequantize_int8(q, s) - w).pow(2).mean().sqrt() / rms)]
for g in (32, 64):
    for bits in (4, 3):
        c, sc, mn = quantize_int4(w, g, bits)
        rows.append((f"int{bits} g{g}", bits + 32 / g, (dequantize_int4(c, sc, mn, g) - w).pow(2).mean().sqrt() / rms))
print(f"{'format':<18}{'bits/weight':>12}{'rel. RMS error':>16}")
for name, bits, err in rows:
    print(f"{name:<18}{bits:>12.2f}{err:>16.2%}")

# %% [markdown]
# ## 3. LLM.int8() and outlier features
#
# LLM.int8() (Dettmers et al., 2022) quantizes the *activations* too, one scale per token, so the matmul runs as
# int8 × int8 → int32. Its finding: from ~6.7B parameters on, a few hidden-state feature columns hold values of
# 20-100 in almost every token; one of them sets the whole row's scale and flattens everything else to zero. The fix
# multiplies the columns with any |x| > 6 in float and the rest in int8. How many such columns does each Linear's
# input have in a 135M model?

# %%
ids = eval_ids(tok, pick(512, 64))
profile = outlier_profile(fp32_model, ids)
by_kind = collections.defaultdict(list)
for name, p in profile.items():
    by_kind[name.split(".")[-1]].append(p["outlier_columns"] / p["in_features"])
print(f"{'input of':<10}{'layers':>8}{'mean outlier cols':>20}{'max':>8}")
for kind, fr in by_kind.items():
    print(f"{kind:<10}{len(fr):>8}{sum(fr) / len(fr):>20.2%}{max(fr):>8.2%}")
worst = max(profile.items(), key=lambda kv: kv[1]["max_abs"])
print(f"largest activation: {worst[1]['max_abs']:.0f} at the input of {worst[0]}")
down = [profile[f"layers.{i}.mlp.down"]["outlier_columns"] for i in range(len(fp32_model.layers))]
fig, ax = plt.subplots(figsize=(8, 3))
ax.bar(range(len(down)), down)
ax.set_xlabel("block")
ax.set_ylabel("outlier columns (|x| > 6)")
ax.set_title("Input of mlp.down: feature columns LLM.int8() keeps in float")
plt.tight_layout()
plt.show()
n_attn = sum(v for k, v in profile.items() if k.endswith("attn.wq") for v in [v["outlier_columns"]])
print(f"the residual stream (q/k/v input) has {n_attn} outlier columns summed over {len(fp32_model.layers)} blocks; "
      f"the wide input of mlp.down has {sum(down)} — outliers here live inside the MLP, not in the hidden state "
      f"the paper saw them emerge in.")

# %% [markdown]
# ## 4. The benchmark: bytes, speed and quality of every scheme in one run
#
# `minillm bench quant` loads each variant fresh, counts its weight bytes from its tensors, decodes the same prompt
# greedily (variants round-robin, best round), times a prefill, and scores perplexity, KL and top-1 agreement against
# the fp32 reference on the head of the pydoc text. AWQ calibrates on the text's tail. 3-bit rows are quality only.

# %%
del fp32_model
result = run_entry("quant", quick=QUICK, save=True, out="../results")
bench = [r for r in result.rows if "ppl" in r]

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
for r in bench:
    a1.scatter(r["weight_MB"], r["ppl"])
    a1.annotate(r["variant"], (r["weight_MB"], r["ppl"]), fontsize=7)
a1.set_xlabel("weight MB")
a1.set_ylabel("perplexity (pydoc head)")
a1.set_yscale("log")
a1.set_title("size vs quality (lower-left is better)")
timed = [r for r in bench if "decode_tok_s" in r]
a2.barh([r["variant"] for r in timed], [r["decode_tok_s"] for r in timed])
a2.set_xlabel("batch-1 decode tok/s")
a2.set_title(hardware_line()[:60], fontsize=8)
plt.tight_layout()
plt.show()

# %%
by = {r["variant"]: r for r in bench}
ref = by["fp32 (reference)"]
base = by.get("bf16", ref)
i8 = by["int8 weight-only"]
print(f"int8 weight-only: {i8['weight_MB'] / base['weight_MB']:.2f}x the bytes of {base['variant']}, decode "
      f"{i8['decode_tok_s'] / base['decode_tok_s']:.2f}x, perplexity {i8['ppl'] / ref['ppl'] - 1:+.2%} "
      f"vs the reference.")
r4, a4 = by["int4 g64 RTN"], by["int4 g64 AWQ"]
print(f"int4 g64: round-to-nearest perplexity {r4['ppl']:.2f}, AWQ {a4['ppl']:.2f} (reference {ref['ppl']:.2f}); "
      f"AWQ {'lowers' if a4['ppl'] < r4['ppl'] else 'does not lower'} it by {1 - a4['ppl'] / r4['ppl']:.1%}.")
if "3-bit g64 AWQ" in by:
    r3, a3 = by["3-bit g64 RTN"], by["3-bit g64 AWQ"]
    print(f"3-bit g64: round-to-nearest {r3['ppl']:.1f}, AWQ {a3['ppl']:.1f}.")
if "Q4_1 from the file" in by:
    f4 = by["Q4_1 from the file"]
    print(f"Q4_1 from the file: KL to the reference {f4['kl']:.4f} (bf16's own: {by['bf16']['kl']:.4f}): the same "
          f"weights, only the arithmetic differs; decode {f4['decode_tok_s'] / base['decode_tok_s']:.2f}x bf16.")
fastest = max(timed, key=lambda r: r["decode_tok_s"])
print(f"fastest decode here: {fastest['variant']} at {fastest['decode_tok_s']:.1f} tok/s.")

# %% [markdown]
# How to read the speed column on your machine. On a CPU whose torch int8/int4 kernels convert every weight to
# float before the multiply-add (AVX2 without VNNI/AMX, as the line at the top says), the step is bound by that
# conversion work, not by memory: halving the bytes then buys much less than 2x, and LLM.int8()'s int8 × int8
# matmul (torch._int_mm) is *slower* than float. llama.cpp reaches ~111 tok/s on this very file on the same kind of
# 2-core machine (FACTS.md) because its Q4_1 kernel multiplies 4-bit codes by int8-quantized activations with
# integer SIMD instructions — the kernel, not the format, decides whether fewer bytes become speed. On a GPU (section
# 6) the Triton dequant-matmul kernels read int8/int4 straight into registers.

# %% [markdown]
# ## 5. The int8 KV cache in the engine
#
# Same byte budget, two pools: bf16 keys/values, or int8 with one float16 scale per token and head
# (2·64 bytes + 4 bytes of scales per token, head and layer, against 256). The engine serves the same requests.
# The model computes in float32 here (bf16 GEMMs are slow on CPUs without bf16 instructions); the pools *store*
# bf16 or int8, which is what the comparison is about.

# %%
for r in (r for r in result.rows if r["variant"].startswith("engine")):
    print(f"{r['variant']:<18} blocks {r['kv_blocks']:>5}  peak running sequences {r['peak_running_seqs']:>3}  "
          f"{r['engine_tok_s']:.1f} tok/s")
rt = {k.rsplit("_vs_", 1)[0]: v for k, v in result.ratios.items() if k.startswith("int8_kv")}
print(f"int8 KV: {rt['int8_kv_blocks']:.2f}x the blocks, {rt['int8_kv_peak_seqs']:.2f}x the peak "
      f"concurrent sequences, {rt['int8_kv_throughput']:.2f}x the throughput; "
      f"{rt['int8_kv_requests_same_greedy_tokens']:.0%} of requests kept every greedy token.")

# %% [markdown]
# ## 6. On a GPU
#
# `Int8Linear` and `Int4Linear` call the Triton kernels of `kernels/quant_matmul.py` on CUDA (dequantize in
# registers, fp32 accumulation); `scripts/gpu_check.sh` tests them against a float oracle and times them against a
# bf16 matmul at the model's shapes. No GPU was available when this notebook was executed: its numbers are the CPU
# named at the top.
#
# **Exercise 07** (`exercises/ex07_quant.py`, graded by `minillm grade 07`): per-channel int8 quantize/dequantize,
# int4 groups packed two per byte (bit-exact on adversarial groups), and the LLM.int8() matmul with the outlier
# split; the last task quantizes the real model with your functions. Next, lesson 08 removes weights instead of
# shrinking them (sparsity and pruning).
