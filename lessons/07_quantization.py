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
# A batch-1 decode step reads every weight once to produce one token: about 2 flops per bf16 weight byte, far below what
# any chip computes per byte it loads, so its floor is **memory**: *weight bytes / memory bandwidth*. Where a step runs
# near that floor, fewer bits per weight is the first lever of inference at small batch (section 4 measures how near
# each kernel runs here, and what else the step spends): int8 halves the bytes of bf16, int4 quarters them — **if the
# matmul kernel reads the small integers and dequantizes in registers** (`minillm/compress/quant.py`; on a CPU
# `kernels/cpu/`, section 5; on a GPU `kernels/quant_matmul.py` in Triton). The price is quality, which this lesson
# measures three ways against the reference model:
# perplexity, KL divergence per token, and top-1 agreement.
#
# The same idea applies to the **KV cache**: at large batch and long context it, not the weights, fills memory
# (lesson 04), and int8 keys/values with a scale per token and head fit ~2x the sequences in the same bytes.
#
# Sections: (1) the model file is already 4-bit; (2) the formats on one real weight; (3) LLM.int8() and the outlier
# features of a 135M model; (4) the benchmark — bytes, speed and quality of every scheme in one run, and the Pareto
# plot; (5) a low-bit CPU kernel: int8 activations and integer dot products, against torch's kernels and llama.cpp;
# (6) the int8 KV cache in the engine; (7) on a GPU.

# %%
import collections
import dataclasses
import json
import pathlib
import types

import matplotlib.pyplot as plt
import torch
from gguf import GGUFReader

import minillm
from minillm.bench import run_entry
from minillm.measure import roofline
from minillm.measure.breakdown import step_breakdown
from minillm.measure.hardware import bf16_status
from minillm.model import model_bytes
from minillm.config import LLAMA2_7B, SMOLLM2_135M
from minillm.course.lesson import QUICK, hardware_line, pick, recorded, spread_line
from minillm.compress.llm_int8 import outlier_profile
from minillm.compress.quality import eval_ids
from minillm.compress.quantize import quantize
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
      f"(with the tied Q8_0 embedding/LM head kept 8-bit where minillm's CPU kernels load)")
del q4_model

# %% [markdown]
# ## 2. The formats on one real weight
#
# **int8 per output channel, symmetric**: each row gets a scale max|w|/127 and w ≈ q·scale with q in [-127, 127].
# **int4 group-wise, asymmetric**: each group of g inputs gets its own scale and minimum; smaller groups follow the
# local range (less error) but store more scale bytes per weight. Error is relative to the weight's RMS. Beside the
# measured error, a prediction: rounding to a grid of step Δ leaves an error spread evenly within ±Δ/2, Δ/√12 RMS;
# and the same formats on a weight that was never quantized (a Gaussian of the same shape and RMS).
#
# *Predict before you run the next cell:* int8 has 255 levels per row, int4 has 16 per group. Roughly how many times
# larger do you expect int4 g64's relative error to be than int8's on this weight? Write your number down.

# %%
w = fp32_model.layers[12].attn.wq.weight.detach()
fresh = torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.pow(2).mean().sqrt()


def rel_error(w, bits=None, g=None) -> float:
    """Round-to-nearest's RMS error relative to the weight's RMS: int8 per channel (bits None) or int<bits> g<g>."""
    if bits is None:
        back = dequantize_int8(*quantize_int8(w))
    else:
        back = dequantize_int4(*quantize_int4(w, g, bits), g)
    return float((back - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt())


def step_error(w, bits=None, g=None) -> float:
    """The prediction, Δ/√12 relative to the weight's RMS: Δ = max|w| / 127 per row for int8, (max - min) /
    (2^bits - 1) per group for int<bits>."""
    if bits is None:
        step = w.abs().amax(1) / 127
    else:
        groups = w.reshape(w.shape[0], -1, g)
        step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
    return float((step.pow(2).mean() / 12).sqrt() / w.pow(2).mean().sqrt())


formats = [("int8 per channel", None, None, 8 + 32 / w.shape[1])]
formats += [(f"int{bits} g{g}", bits, g, bits + 32 / g) for g in (32, 64) for bits in (4, 3)]
err = {name: (step_error(w, bits, g), rel_error(w, bits, g), rel_error(fresh, bits, g))
       for name, bits, g, _ in formats}
print(f"{'format':<18}{'bits/weight':>12}{'predicted':>11}{'this weight':>13}{'never quantized':>17}")
for name, _, _, bpw in formats:
    print(f"{name:<18}{bpw:>12.2f}" + "".join(f"{e:>{n}.2%}" for e, n in zip(err[name], (11, 13, 17))))
(p8, m8, _), (p64, m64, _), (p32, m32, f32) = err["int8 per channel"], err["int4 g64"], err["int4 g32"]
print(f"predicted int4 g64 / int8 = {p64 / p8:.0f}x, measured {m64 / m8:.0f}x, because the error follows the rounding "
      f"step (16 levels across a group's range against 255 across a row's: int4 g64's step/sqrt(12) is {p64 / p8:.1f}x "
      f"int8's), and each format's measured error is {m64 / p64:.2f} (int4 g64) and {m8 / p8:.2f} (int8) of its "
      f"step/sqrt(12): their quotient {m64 / p64 / (m8 / p8):.2f} is measured / predicted")
if m32 < 0.1 * p32:
    print(f"int4 g32: predicted {p32:.1%}, measured {m32:.2%}, because this weight already is a 4-bit g32 weight: the "
          f"file stores it as Q4_1 codes in groups of 32 (section 1), round-to-nearest finds the same codes, and only "
          f"the fp16 rounding of each group's scale and minimum is left. A weight that was never quantized loses "
          f"{f32:.1%}.")

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
# the fp32 reference on the head of the pydoc text. AWQ calibrates on the text's tail. 3-bit rows are quality only:
# there is no 3-bit kernel, so they run in float, and their size is computed for the packed format (hollow markers).

# %%
ops = roofline.eager_ops(fp32_model)  # for section 4's roofline model
del fp32_model
if QUICK:  # the recorded full run (`minillm bench quant` writes results/quant.json; its quick run: tests/test_bench.py)
    result = types.SimpleNamespace(**recorded("quant", quick_run=False))
else:  # measured now, shown here
    result = run_entry("quant", save=False)
bench = [r for r in result.rows if "ppl" in r]

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
for r in bench:
    computed = "size" in r  # quality-only rows: bytes of the packed format, computed (the bench's "size" column)
    a1.scatter(r["weight_MB"], r["ppl"], facecolors="none" if computed else None, edgecolors="k" if computed else None)
    a1.annotate(r["variant"] + (" (size computed)" if computed else ""), (r["weight_MB"], r["ppl"]), fontsize=7)
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
emb = SMOLLM2_135M.vocab_size * SMOLLM2_135M.dim
print(f"\nWhich weights each row shrinks: the int8/int4 rows (RTN and AWQ) quantize every Linear and the tied "
      f"embedding/LM head ({emb / 1e6:.1f}M of the {SMOLLM2_135M.n_params() / 1e6:.1f}M parameters); 'Q4_1 from the "
      f"file' keeps the file's Q8_0 (8-bit) embedding/LM head; the 3-bit rows keep it in float.")
if "int4 g32 RTN" in by and "Q4_1 from the file" in by:
    g32 = by["int4 g32 RTN"]
    print(f"int4 g32 RTN finds the file's own codes for every block Linear (section 1 showed one layer), so its "
          f"{f4['weight_MB'] - g32['weight_MB']:.1f} MB fewer and its perplexity {g32['ppl']:.2f} against the file's "
          f"{f4['ppl']:.2f} (KL {g32['kl']:.4f} against {f4['kl']:.4f}) are the LM head at 4 bits instead of 8.")

# %% [markdown]
# **A roofline model: where fewer bytes pay** (`minillm/measure/roofline.py`; a model, not a measurement). A step takes
# max(bytes / bandwidth, FLOPs / FLOP/s) plus its ops × a fixed cost per op (on a GPU the launches overlap the work,
# so the largest term sets the time). Quantization changes only the first term's bytes: it pays where that term sets
# the time. The model takes each row's measured weight bytes, FLOPs at this CPU's measured float32 rate for every
# format, and leaves out the work of unpacking the weights, so it is a best case for the quantized rows. This CPU's
# numbers are measured now; the H100's are its datasheet's (bf16 weights before quantization).

# %%
cpu, h100 = roofline.this_cpu(torch.float32), roofline.H100_SXM
ref_mb = ref["weight_MB"]  # the fp32 model: 4 bytes per parameter


def step(machine, cfg, mb, tokens):
    """One batch-1 step of `tokens` with the weights at `mb` MB of SmolLM2's fp32 size scaled to the machine's."""
    scale = mb / ref_mb * 4 / machine.bytes_per_weight
    return roofline.forward_step(cfg, machine, tokens=tokens, context=64 if tokens == 1 else tokens // 2,
                                 ops=ops * cfg.n_layers // SMOLLM2_135M.n_layers, weight_scale=scale)


def model_ratio(machine, mb, tokens, cfg=SMOLLM2_135M, base_mb=None):
    before = step(machine, cfg, ref_mb / 2 if base_mb is None else base_mb, tokens)  # bf16 unless told otherwise
    return machine.seconds(before) / machine.seconds(step(machine, cfg, mb, tokens))


print(f"speedup over {base['variant']} (H100 model: over bf16)")
print(f"{'':<28}{'decode (1 token)':^32}{'prefill (128 tokens)':^32}")
print(f"{'variant':<22}{'MB':>6}{'CPU model':>11}{'measured':>10}{'H100 model':>11}{'CPU model':>11}{'measured':>10}"
      f"{'H100 model':>11}")
quantized = [r for r in timed if r is not ref and r is not base]
for r in quantized:
    print(f"{r['variant']:<22}{r['weight_MB']:>6.0f}"
          f"{model_ratio(cpu, r['weight_MB'], 1, base_mb=base['weight_MB']):>10.2f}x"
          f"{r['decode_tok_s'] / base['decode_tok_s']:>9.2f}x{model_ratio(h100, r['weight_MB'], 1):>10.2f}x"
          f"{model_ratio(cpu, r['weight_MB'], 128, base_mb=base['weight_MB']):>10.2f}x"
          f"{r['prefill_tok_s'] / base['prefill_tok_s']:>9.2f}x{model_ratio(h100, r['weight_MB'], 128):>10.2f}x")
print(f"({cpu.source}, {cpu.op_seconds * 1e6:.1f} us per op; H100: {h100.source}, ~{ops} launches per step)")
best_prefill = max(model_ratio(cpu, r["weight_MB"], 128, base_mb=base["weight_MB"]) for r in quantized)
measured_prefill = ", ".join(f"{r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x" for r in quantized)
slower = [r["variant"] for r in quantized if r["prefill_tok_s"] < base["prefill_tok_s"]]
faster = [r["variant"] for r in quantized if r["prefill_tok_s"] > 1.02 * best_prefill * base["prefill_tok_s"]]
print(f"prefill: predicted at most {best_prefill:.2f}x for every format, measured {measured_prefill}, because 128 "
      f"tokens make the step compute-bound: fewer bytes buy nothing, and unpacking the weights costs work the model "
      f"leaves out" + (f" (slower here: {', '.join(slower)})" if slower else "")
      + (f"; above the model: {', '.join(faster)}, whose kernels compute in integers, at a rate of their own that the "
         f"model (this CPU's float32 FLOP/s) does not know" if faster else ""))
i8 = by["int8 weight-only"]
mbu_base, mbu_i8 = (r["weight_MB"] * 1e6 * r["decode_tok_s"] / cpu.bandwidth for r in (base, i8))
# the model puts every format on the bandwidth roof; whether the step waits for its bytes is measured: one decode
# step of fp32, bf16 and int8 split into matmuls, attention, elementwise ops, sampling and Python/dispatch
steps = {"fp32": minillm.load_model(dtype="float32")[0], "bf16": minillm.load_model(dtype="bfloat16")[0]}
steps["int8"] = quantize(minillm.load_model(dtype="bfloat16")[0], "int8")
split = {name: step_breakdown(m, "decode", context=64, bandwidth=cpu.bandwidth, repeat=pick(7, 2))
         for name, m in steps.items()}
mm_GBps = {name: model_bytes(steps[name]) / (b.terms["matmul"] / 1e3) / 1e9 for name, b in split.items()}
for name, b in split.items():
    print(f"{b.line().replace('decode b=1', name)}\n    matmuls: {model_bytes(steps[name]) / 1e6:.0f} MB of weights at "
          f"{mm_GBps[name]:.1f} GB/s ({mm_GBps[name] * 1e9 / cpu.bandwidth:.0%} of copy bandwidth), "
          f"{b.terms['matmul'] / b.op_counts['matmul'] * 1e3:.0f} us per matmul call")
bb, b8, b32 = split["bf16"], split["int8"], split["fp32"]
saved = bb.wall_ms - b8.wall_ms
diff = {t: bb.terms[t] - b8.terms[t] for t in bb.terms}
print(f"int8 decode: predicted {model_ratio(cpu, i8['weight_MB'], 1, base_mb=base['weight_MB']):.2f}x on this CPU, "
      f"measured {i8['decode_tok_s'] / base['decode_tok_s']:.2f}x over {base['variant']} (the breakdown's own steps, "
      f"over bf16: {bb.wall_ms / b8.wall_ms:.2f}x), because the model puts both on the bandwidth roof and bf16's "
      f"step is not there: its matmuls take {bb.terms['matmul']:.1f} ms ({bb.shares['matmul']:.0%} of its step) at "
      f"{mm_GBps['bf16']:.1f} GB/s while fp32's, over twice the bytes, take {b32.terms['matmul']:.1f} ms "
      f"(bf16/fp32 step time {bb.wall_ms / b32.wall_ms:.2f}x for half the bytes); of the {saved:.1f} ms int8 saves, "
      f"the matmul term is {diff['matmul']:.1f} ms ({diff['matmul'] / saved:.0%})"
      + ("" if diff["matmul"] >= 0.5 * saved else f", under half: the largest term is {max(diff, key=diff.get)} "
         f"({max(diff.values()):.1f} ms)") + f". MBU: {base['variant']} {mbu_base:.0%}, int8 {mbu_i8:.0%}. On the "
      f"H100 model {model_ratio(h100, i8['weight_MB'], 1):.2f}x, because this small model's eager step waits for its "
      f"~{ops} launches there.")
del steps
# a bigger model with its launches gone (lesson 06's CUDA-graph model: ~2 kernels per matmul at ~1 us each)
graph = dataclasses.replace(h100, name="H100 SXM, CUDA graph (model)", op_seconds=1e-6)
llama_ops = 2 * (7 * LLAMA2_7B.n_layers + 1)  # q, k, v, o, gate, up, down per block, and the LM head
llama = {mb: roofline.forward_step(LLAMA2_7B, graph, context=64, ops=llama_ops, weight_scale=mb / (ref_mb / 2))
         for mb in (ref_mb / 2, i8["weight_MB"], ref_mb / 8)}
t_llama = {mb: graph.seconds(st) for mb, st in llama.items()}
print(f"Llama-2-7B in one CUDA graph per step (H100 model): bound by {graph.bound(llama[ref_mb / 2])} in bf16; int8 "
      f"{t_llama[ref_mb / 2] / t_llama[i8['weight_MB']]:.2f}x, a quarter of bf16's bytes (int4) "
      f"{t_llama[ref_mb / 2] / t_llama[ref_mb / 8]:.2f}x: where the bytes set the time, fewer bytes pay on a GPU too.")

# %% [markdown]
# ## 5. A low-bit kernel for the CPU: fewer bytes become less time
#
# torch's CPU int4/int8 kernels widen every weight to a float (and round the activations to bf16) before the
# multiply-add, so how much of their fewer bytes becomes less time depends on that work per byte against what memory
# delivers per byte; the benchmark above ran the file's Q4_1 on torch's int4 kernel too (its `q4 (torch int4 kernel)`
# row), and the next cell prints what that kernel bought over bf16 in this run. Fewer bytes only become less time if
# the kernel's work per byte stays below what memory delivers per byte.
#
# llama.cpp's answer, which `kernels/cpu/` implements in a few hundred readable lines: **quantize the activations
# too**, per block of 32, to int8 (scale dx = max|x|/127). Then a block of the Q4_1 dot product is
#
# $$\sum_i w_i x_i \approx d\,dx \sum_i \mathrm{code}_i\, q_i \;+\; m\, dx \sum_i q_i$$
#
# The first sum is bytes times bytes, an *integer* dot product: one AVX2 `vpmaddubsw` + `vpmaddwd` or one VNNI
# `vpdpbusd` multiplies 32 byte pairs; the second is the block sum of the activations, computed once per row of x,
# so the minimum costs one multiply-add per block. The scales are applied once per 32 weights, not per weight.
# One real block, by hand:

# %%
from minillm.compress.quant import cpu_kernels_disabled  # noqa: E402
from minillm.compress.quantize import describe_arithmetic  # noqa: E402
from minillm_kernels import cpu_lowbit  # noqa: E402

q4_model, _ = minillm.load_model(dtype="float32", weights="q4")
down = q4_model.layers[5].mlp.down
codes_b = down.codes()[0, :32].double()
d, m = down.scale[0, 0].double(), down.minimum[0, 0].double()
x = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
dx = x.abs().max() / 127
q = torch.round(x / dx)
exact = ((codes_b * d + m) * x).sum()
integer_part = (codes_b * q).sum()  # what the SIMD instruction computes, in int32
via_int8 = d * dx * integer_part + m * dx * q.sum()
print(f"float dot product {exact:.5f}; integer form {via_int8:.5f} (int32 sum {integer_part:.0f}); "
      f"error {abs(via_int8 - exact):.1e} = the rounding of x to int8, at most {dx / 2:.4f} per element")
lowbit = {(r["variant"], r["threads"]): r for r in result.rows if "threads" in r and "decode_tok_s" in r}
names_1t = ("bf16", "q4 (torch int4 kernel)", "q4 (minillm kernels)")
if all((n, 1) in lowbit for n in names_1t):
    b16, tq4, mq4 = (lowbit[n, 1] for n in names_1t)
    print(f"this run, 1 thread, over bf16 ({b16['weight_MB']:.0f} MB/token): the file's Q4_1 on torch's int4 kernel "
          f"({tq4['weight_MB']:.0f} MB/token) decodes at {tq4['decode_tok_s'] / b16['decode_tok_s']:.2f}x, on "
          f"minillm's kernels ({mq4['weight_MB']:.0f} MB/token) at {mq4['decode_tok_s'] / b16['decode_tok_s']:.2f}x")

# %% [markdown]
# **The layout.** A dot product ends in a horizontal sum (add the lanes of a register together), which costs as
# much as the multiply when rows are short (576 inputs = 18 blocks). So the kernel repacks the weights once, at the
# first call, into groups of R rows (R = 8 lanes of a 256-bit register, 16 of a 512-bit one): lane r of a vector
# holds 4 codes of row r, and one broadcast of 4 activation bytes feeds R rows at once. R sums stay in R lanes to
# the end and the scales of R rows load as one vector. Same 5 bits per weight. One file per kernel
# (`q4_1_matmul.cpp`, `int8_matmul.cpp`), the plain loops beside the SIMD ones (`reference=True` runs them), built on
# first use for the instruction set this CPU lists, probed once in a child process (a CPU may list a feature its VM
# did not enable):

# %%
print("kernels:", cpu_lowbit.status())
print("arithmetic of this model:", describe_arithmetic(q4_model))
packed = down._kernel_pack()
print(f"mlp.down {tuple(down.qweight.shape)} packed codes -> repacked {tuple(packed.shape)}: "
      f"{packed.numel() / down.out_features / down.in_features * 8:.2f} bits per weight")

# %% [markdown]
# One real layer, rows of x per call from 1 (decode) to 16 (a verify or a batch): minillm's kernel, torch's int4
# kernel on the same layer (`cpu_kernels_disabled()`: what runs where ours cannot build), and a bf16 matmul of the
# dequantized weight. At one row the kernel should stream the weights near the machine's copy bandwidth; with more
# rows the bytes stay the same, so the time should grow much slower than the rows.

# %%
from minillm.measure.harness import time_fn  # noqa: E402
from minillm.measure.hardware import bandwidth  # noqa: E402

w_bf16 = down.dequantize().bfloat16()
layer_bytes = down.qweight.numel() + 2 * down.scale.numel() * 2
kernel_rows = []
for n_rows in pick((1, 2, 4, 8, 16), (1, 4, 16)):
    xr = torch.randn(n_rows, down.in_features)
    ours = time_fn(lambda: down(xr), warmup=2, repeat=pick(50, 10)).median
    with cpu_kernels_disabled():
        theirs = time_fn(lambda: down(xr), warmup=2, repeat=pick(50, 10)).median
    xb = xr.bfloat16()
    bf16 = time_fn(lambda: xb @ w_bf16.T, warmup=2, repeat=pick(50, 10)).median
    kernel_rows.append((n_rows, ours, theirs, bf16))
print(f"{'rows':>5}{'minillm µs':>12}{'torch int4 µs':>15}{'bf16 µs':>10}")
for n_rows, ours, theirs, bf16 in kernel_rows:
    print(f"{n_rows:>5}{ours * 1e6:>12.1f}{theirs * 1e6:>15.1f}{bf16 * 1e6:>10.1f}")
one = kernel_rows[0][1]
print(f"1 row: {layer_bytes / one / 1e9:.1f} GB/s of packed weights (copy probe: {bandwidth('cpu') / 1e9:.1f} GB/s; "
      f"the layer is {layer_bytes / 1e6:.2f} MB, so part of it may come from cache); "
      f"{kernel_rows[-1][0]} rows cost {kernel_rows[-1][1] / one:.1f}x one row")
fig, ax = plt.subplots(figsize=(6, 3.5))
for i, label in ((1, "minillm q4 kernel"), (2, "torch int4 kernel"), (3, "bf16 matmul")):
    ax.plot([r[0] for r in kernel_rows], [r[i] * 1e6 for r in kernel_rows], marker="o", label=label)
ax.set_xlabel("rows of x per call")
ax.set_ylabel("µs per call (mlp.down, 576x1536)")
ax.set_title(hardware_line()[:60], fontsize=8)
ax.legend()
plt.tight_layout()
plt.show()
del q4_model

# %% [markdown]
# **Decode, side by side** (from the benchmark of section 4, `bench lowbit`'s part): every variant decodes the same
# prompt at 1 and 2 threads, round-robin, best round; llama.cpp runs on the same file where llama-cpp-python is
# installed. *of_roofline* is decode tok/s over (copy bandwidth / weight bytes per token): the share of the memory
# bound it reaches.

# %%
decode = [r for r in result.rows if "threads" in r and "decode_tok_s" in r]
print(f"{'variant':<30}{'threads':>8}{'tok/s':>8}{'MB/token':>10}{'of roofline':>13}{'greedy = fp32':>15}")
for r in decode:
    print(f"{r['variant']:<30}{r['threads']:>8}{r['decode_tok_s']:>8.1f}{r.get('weight_MB', float('nan')):>10.0f}"
          f"{r.get('of_roofline', float('nan')):>13.0%}{r['greedy_same_as_fp32']:>15.0%}")
fig, ax = plt.subplots(figsize=(8, 3.5))
names = list(dict.fromkeys(r["variant"] for r in decode))
for i, th in enumerate(sorted({r["threads"] for r in decode})):
    vals = {r["variant"]: r["decode_tok_s"] for r in decode if r["threads"] == th}
    ax.barh([j + 0.4 * i for j in range(len(names))], [vals.get(n, 0) for n in names], height=0.4,
            label=f"{th} thread{'s' * (th > 1)}")
ax.set_yticks([j + 0.2 for j in range(len(names))], names, fontsize=8)
ax.set_xlabel("batch-1 decode tok/s")
ax.legend()
plt.tight_layout()
plt.show()
rt = result.ratios
for key in sorted(k for k in rt if "_vs_" in k and k.endswith("t") and k[-2].isdigit()):
    print(f"{key:<34}{rt[key]:.2f}")

# %% [markdown]
# What stands between the kernel and the whole step: a decode step is more than its matmuls. Time the 4-bit
# matmuls of one step alone (the same layers, one row each) against a whole step:

# %%
q4_model, _ = minillm.load_model(dtype="float32", weights="q4")
layers_q = [mod for mod in q4_model.modules() if hasattr(mod, "_kernel_pack")]
inputs = [torch.randn(1, 1, mod.in_features) for mod in layers_q]
matmuls = time_fn(lambda: [mod(xi) for mod, xi in zip(layers_q, inputs)], warmup=2, repeat=pick(10, 3)).median
cache = minillm.kv_cache.KVCache.for_model(q4_model, 1, 64)
with torch.inference_mode():
    q4_model(torch.tensor([tok.encode("The history of the printing press")]), kv_cache=cache)
    pos = cache.seq_len

    def one_step():
        q4_model(torch.tensor([[42]]), kv_cache=cache, last_only=True)
        cache.truncate(pos)

    step = time_fn(one_step, warmup=2, repeat=pick(10, 3)).median
q4_split = step_breakdown(q4_model, "decode", context=pos, bandwidth=cpu.bandwidth, repeat=pick(7, 2))
rest = {t: v for t, v in q4_split.terms.items() if t != "matmul"}
print(f"{len(layers_q)} quantized matmuls: {matmuls * 1e3:.2f} ms of a {step * 1e3:.2f} ms step "
      f"({matmuls / step:.0%}); the step's breakdown ({q4_split.wall_ms:.2f} ms, {q4_split.n_ops} ops): matmul "
      f"{q4_split.terms['matmul']:.2f} ms, and the rest " + ", ".join(f"{t} {v:.2f} ms ({q4_split.shares[t]:.0%})"
                                                                       for t, v in rest.items())
      + f"; largest of the rest: {max(rest, key=rest.get)} (else = Python and dispatch between ops)")
native_model, _ = minillm.load_model(dtype="float32", weights="q4", native=True)  # lesson 06's last rung
n_split = step_breakdown(native_model, "decode", context=pos, bandwidth=cpu.bandwidth, repeat=pick(7, 2))
print(f"the same step in one native call (every layer in C++, lesson 06): {n_split.wall_ms:.2f} ms, "
      f"{n_split.n_ops} ops, {q4_split.wall_ms / n_split.wall_ms:.2f}x faster; its matmuls "
      f"{n_split.terms['matmul']:.2f} ms ({n_split.shares['matmul']:.0%} of it), the rest "
      f"{n_split.wall_ms - n_split.terms['matmul']:.2f} ms; byte floor {n_split.byte_floor_ms:.2f} ms")
del q4_model, native_model

# %% [markdown]
# **Beyond batch 1.** A forward of q new tokens reads the weights once for all q rows: a speculative verify of q-1
# drafts (lesson 10) or a step of a batch. Below, the q4 model on our kernels and bf16, from this run, beside what
# lesson 10's benchmark recorded for its q = 5 verify step (`results/speculative.json`, read with its hardware and
# date). Each extra row costs integer multiply-adds: the layer table of section 5 printed how much, per row count.

# %%
for r in (r for r in result.rows if "forward_ms" in r):
    print(f"{r['variant']:<28}{r['forward_ms']:>8.2f} ms {r['vs_decode_step']:>6.2f}x a decode step")
spec_path = pathlib.Path("../results/speculative.json")
if spec_path.exists():
    spec = json.loads(spec_path.read_text())
    hw_s = spec["hardware"]
    print(f"lesson 10's record ({hw_s['cpu']}, {hw_s['threads']} thread(s), torch {hw_s['torch']}, "
          f"{spec.get('timestamp', 'no date')}): " + "; ".join(spread_line(spec, key) for key in
                                                               ("verify_k4_vs_decode", "q4_verify_k4_vs_decode")
                                                               if key in spec["ratios"]))
fwd = {r["variant"]: r["vs_decode_step"] for r in result.rows if "forward_ms" in r}
rows_cost = {n: ours / kernel_rows[0][1] for n, ours, _, _ in kernel_rows}
if "q4 forward of 5 tokens" in fwd:
    print(f"q = 5 in this run: q4 {fwd['q4 forward of 5 tokens']:.2f}x a decode step, bf16 "
          f"{fwd.get('bf16 forward of 5 tokens', float('nan')):.2f}x; one q4 layer alone (section 5): "
          + ", ".join(f"{n} rows {c:.2f}x one row" for n, c in rows_cost.items()))
for r in (r for r in result.rows if r["variant"].startswith("continuous batching")):
    print(f"{r['variant']:<40}{r['engine_tok_s']:>8.1f} tok/s")

# %% [markdown]
# ## 6. The int8 KV cache in the engine
#
# Same byte budget, two pools: bf16 keys/values, or int8 with one float16 scale per token and head
# (2·64 bytes + 4 bytes of scales per token, head and layer, against 256). The engine serves the same requests.
# The model computes in float32 here (bf16 GEMMs are slow on CPUs without bf16 instructions); the pools *store*
# bf16 or int8, which is what the comparison is about.

# %%
for r in (r for r in result.rows if r["variant"].startswith("engine,")):
    print(f"{r['variant']:<18} blocks {r['kv_blocks']:>5}  peak running sequences {r['peak_running_seqs']:>3}  "
          f"{r['engine_tok_s']:.1f} tok/s")
rt = {k.rsplit("_vs_", 1)[0]: v for k, v in result.ratios.items() if k.startswith("int8_kv")}
print(f"int8 KV: {rt['int8_kv_blocks']:.2f}x the blocks, {rt['int8_kv_peak_seqs']:.2f}x the peak "
      f"concurrent sequences, {rt['int8_kv_throughput']:.2f}x the throughput; "
      f"{rt['int8_kv_requests_same_greedy_tokens']:.0%} of requests kept every greedy token.")

# %% [markdown]
# ## 7. On a GPU
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
