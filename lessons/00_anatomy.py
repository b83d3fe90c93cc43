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
# # Lesson 00 — Anatomy of inference: prefill vs decode, the roofline, the KV cache
#
# Before optimising anything we take the plain model apart and measure it on this machine. Three questions:
#
# 1. **What is the model?** A file of weights (GGUF) plus a handful of numbers (layers, heads, dims).
# 2. **Where does the time go?** Generation has two phases. *Prefill* runs the whole prompt through the model at
#    once: every weight is used for many tokens, so it is **compute-bound** and judged by **MFU** (model FLOP/s
#    utilisation). *Decode* produces one token per step: every weight is read from memory to do just 2 FLOPs,
#    so it is **memory-bound** and judged by **MBU** (model bandwidth utilisation). The **roofline** puts both on
#    one picture.
# 3. **What does remembering the past cost?** The KV cache: bytes per token = 2 × layers × kv_heads × head_dim ×
#    bytes per value.
#
# The course's model is SmolLM2-135M-Instruct, loaded from a GGUF file by `minillm.load_model`.

# %%
import inspect
import time
from collections import Counter

import matplotlib.pyplot as plt
import torch
from gguf import GGUFReader

import minillm
from minillm.bench import time_fn
from minillm.bench.decode import cast_model, measure_decode, measure_prefill
from minillm.measure.breakdown import step_breakdown
from minillm.measure.hardware import bf16_status, hardware_info, hardware_summary, native_bf16
from minillm.measure.metrics import decode_bytes_per_token, model_flops_per_token, prefill_flops, weight_bytes
from minillm.config import LLAMA2_7B
from minillm.kv_cache import kv_bytes, kv_bytes_per_token
from minillm.course.lesson import QUICK, hardware_line, pick
from minillm.gguf.weights import gguf_path

print(hardware_line())
hw = hardware_info("cpu")
print("measured roofs:", hardware_summary(hw))

t0 = time.perf_counter()
model, tok = minillm.load_model("smollm2-135m", dtype="float32", device="cpu")
print(f"loaded in {time.perf_counter() - t0:.1f} s (read + dequantize the GGUF, build the model)")

# %% [markdown]
# ## 1. What is in the GGUF file
#
# GGUF holds metadata (architecture numbers, the tokenizer's vocabulary) and the tensors, here mostly quantized to
# 4 bits (Q4_1: blocks of 32 weights sharing a scale and a minimum). `load_model` dequantizes them to the dtype we
# ask for. The config is all we need to count parameters, FLOPs and cache bytes.

# %%
path = gguf_path()
reader = GGUFReader(str(path))
print(f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB on disk, {len(reader.tensors)} tensors:",
      dict(Counter(t.tensor_type.name for t in reader.tensors)))
cfg = model.config
print(cfg)
n_params = cfg.n_params()
print(f"parameters: {n_params:,} (config formula) vs {sum(p.numel() for p in model.parameters()):,} (in the model;"
      " the LM head is tied to the embedding, so it is counted once)")
for dtype, size in (("float32", 4), ("bfloat16", 2)):
    print(f"  weights in {dtype:9s}: {n_params * size / 2**20:6.0f} MiB")
print(f"  weights as stored (mostly Q4_1): {path.stat().st_size / 2**20:6.0f} MiB")

# %% [markdown]
# The decoder itself is short; this is one attention layer (the `kv_cache` branch is the seam lessons 01 and 04
# plug into):

# %%
print(inspect.getsource(minillm.model.Attention.forward))

# %% [markdown]
# ## 2. Tokens, not characters
#
# The model reads token ids from a byte-level BPE vocabulary of 49,152 entries. Common English words are one token;
# digits are always split one per token by this tokenizer; rarer scripts cost several tokens per character. Every
# cost below (FLOPs, cache bytes, time) is per *token*.

# %%
texts = {
    "English": "The quick brown fox jumps over the lazy dog.",
    "Python": "def add(a, b):\n    return a + b",
    "number": "3.14159265358979",
    "French": "Où est la gare, s'il vous plaît ?",
    "Japanese": "東京は日本の首都です。",
}
print(f"{'text':9s} {'chars':>5s} {'tokens':>6s} {'chars/token':>11s}  pieces")
for name, text in texts.items():
    ids = tok.encode(text)
    # a token is a byte string; one character may span several tokens (shown as escaped bytes)
    pieces = [tok.token_bytes(i).decode("utf-8", "backslashreplace") for i in ids][:8]
    print(f"{name:9s} {len(text):5d} {len(ids):6d} {len(text) / len(ids):11.2f}  {pieces}")

# %% [markdown]
# ## 3. Prefill vs decode, measured
#
# Prefill of `n` tokens does about `2 × params × n` FLOPs while reading the weights once; a decode step does
# `2 × params` FLOPs for the same weight bytes (plus the KV cache). We time both on the real model, in float32 and
# bfloat16, with the benchmark's own functions (`minillm bench decode` runs the same measurements).
#
# *Predict before you run the next cell:* prefill pushes 512 tokens through each weight it reads, decode one. How many
# times more tokens per second do you expect float32 prefill of 512 tokens to reach than float32 decode on this CPU:
# about 2x, 10x or 500x? Write your number down; the MFU and MBU columns will say why.

# %%
prefill_sizes = pick([128, 512], [16, 32])
prompt_len, new_tokens = pick(128, 16), pick(64, 8)
repeat = pick(3, 1)
model_bf16 = cast_model(model, torch.bfloat16)  # same weights, rounded to bf16
# A CPU without bf16 instructions emulates bf16 GEMMs tens of times slower than fp32: there, prefill (a GEMM) runs in
# float32 only, while bf16 decode (matrix-vector products, bound by bytes) is still measured.
bf16_gemm = native_bf16("cpu")
if not bf16_gemm:
    print(bf16_status("cpu") + "; so bf16 prefill is skipped here")
rows = []
for dtype, m in (("float32", model), ("bfloat16", model_bf16)):
    for n in prefill_sizes if dtype == "float32" or bf16_gemm else []:
        rows.append({"dtype": dtype, **measure_prefill(m, n, repeat)})
    rows.append({"dtype": dtype, **measure_decode(m, prompt_len, new_tokens, "contiguous", repeat)})
print(hardware_line())
print(f"{'dtype':9s} {'phase':8s} {'tokens':>6s} {'ms':>9s} {'tokens/s':>9s} {'MFU':>6s} {'MBU':>6s}")


def fmt(v):
    return f"{v:6.1%}" if v is not None else "     -"


for r in rows:
    print(f"{r['dtype']:9s} {r['phase']:8s} {r['tokens']:6d} {r['ms']:9.1f} {r['tokens_per_s']:9.1f} "
          f"{fmt(r['MFU'])} {fmt(r['MBU'])}")
by = {(r["dtype"], r["phase"], r["tokens"]): r for r in rows}
fp32_prefill = by["float32", "prefill", prefill_sizes[-1]]
fp32_decode = by["float32", "decode", new_tokens]
bf16_decode = by["bfloat16", "decode", new_tokens]
print(f"\nper token, prefill ({prefill_sizes[-1]} tokens) is "
      f"{fp32_prefill['tokens_per_s'] / fp32_decode['tokens_per_s']:.0f}x faster than decode (float32)")
# the prediction from the roofline alone: each phase runs at max(bytes / bandwidth, FLOPs / peak) per step
n_pre, bw_Bps = prefill_sizes[-1], hw["bandwidth_GBps"] * 1e9
roof_prefill_s = max((weight_bytes(model) + kv_bytes(cfg, n_pre, dtype=model.dtype)) / bw_Bps,
                     prefill_flops(cfg, n_pre, logits_for=1) / hw["flops_float32"]) / n_pre
roof_decode_s = max(decode_bytes_per_token(model, fp32_decode["context"]) / bw_Bps,
                    model_flops_per_token(cfg, fp32_decode["context"]) / hw["flops_float32"])
reach_pre = roof_prefill_s / (fp32_prefill["ms"] / 1e3 / n_pre)  # share of its roof each phase reached
reach_dec = roof_decode_s / (fp32_decode["ms"] / 1e3)
print(f"predicted {roof_decode_s / roof_prefill_s:.0f}x from the roofline (prefill at the FLOP roof, decode at the "
      f"byte roof), measured {fp32_prefill['tokens_per_s'] / fp32_decode['tokens_per_s']:.0f}x, because prefill "
      f"reached {reach_pre:.0%} of its roof and decode {reach_dec:.0%} of its (measured / predicted = "
      f"{reach_pre / reach_dec:.2f} = the ratio of the two)")
decode_split = step_breakdown(model, "decode", context=fp32_decode["context"], bandwidth=bw_Bps, repeat=pick(5, 2))
print("where the decode step's time goes:", decode_split.gap_line())
print(f"bfloat16 decode vs float32 decode: {bf16_decode['tokens_per_s'] / fp32_decode['tokens_per_s']:.2f}x "
      f"(bytes per token: {decode_bytes_per_token(model_bf16, prompt_len) / 2**20:.0f} vs "
      f"{decode_bytes_per_token(model, prompt_len) / 2**20:.0f} MiB)")

# %% [markdown]
# ## 4. The roofline
#
# A kernel that does `F` FLOPs while moving `B` bytes has **arithmetic intensity** `I = F / B`. It cannot run
# faster than `min(peak FLOP/s, I × bandwidth)`: the roof. Left of the ridge point (`peak / bandwidth`) the
# bandwidth caps it (memory-bound), right of it the ALUs do (compute-bound). Both roofs below are *measured* on this
# machine (a large matmul and a large copy), and both phases of the real model are plotted on it.

# %%
bandwidth_Bps = hw["bandwidth_GBps"] * 1e9
peak = {"float32": hw["flops_float32"], "bfloat16": hw["flops_bfloat16"] or hw["flops_float32"]}
points = []
for dtype, m in (("float32", model), ("bfloat16", model_bf16)):
    if r := by.get((dtype, "prefill", prefill_sizes[-1])):
        n = r["tokens"]
        flops = prefill_flops(cfg, n, logits_for=1)  # measured with last_only=True: one row through the LM head
        moved = weight_bytes(m) + kv_bytes(cfg, n, dtype=m.dtype)  # weights once, plus writing the new K/V
        points.append((f"prefill {n} ({dtype})", flops / moved, flops / (r["ms"] / 1e3)))
    r = by[dtype, "decode", new_tokens]
    flops = model_flops_per_token(cfg, r["context"])
    moved = decode_bytes_per_token(m, r["context"])
    points.append((f"decode ({dtype})", flops / moved, flops * r["tokens_per_s"]))
print(f"ridge point: {peak['float32'] / bandwidth_Bps:.1f} FLOP/byte (fp32)"
      + (f", {peak['bfloat16'] / bandwidth_Bps:.1f} (bf16)" if bf16_gemm else "; no bf16 compute roof (emulated)"))
for name, intensity, attained in points:
    print(f"{name:24s} intensity {intensity:8.2f} FLOP/byte, attained {attained / 1e9:8.1f} GFLOP/s")
# the model's own matmul shape (the MLP's up projection over the prompt) against the square matmul that set the peak
a, w = torch.randn(prefill_sizes[-1], cfg.dim), torch.randn(cfg.ffn_dim, cfg.dim)
shape_s = time_fn(lambda: a @ w.T, repeat=pick(7, 2)).median
shape_rate = 2 * a.shape[0] * cfg.dim * cfg.ffn_dim / shape_s
fp32_rate = prefill_flops(cfg, prefill_sizes[-1], logits_for=1) / (fp32_prefill["ms"] / 1e3)
print(f"a [{a.shape[0]} x {cfg.dim}] x [{cfg.dim} x {cfg.ffn_dim}] matmul alone reaches {shape_rate / 1e9:.0f} GFLOP/s "
      f"({shape_rate / peak['float32']:.0%} of the fp32 peak); the whole float32 prefill {fp32_rate / 1e9:.0f} GFLOP/s "
      f"({fp32_rate / shape_rate:.0%} of that shape's rate: the rest of the forward's ops)")

fig, ax = plt.subplots(figsize=(7, 4.5))
xs = [2.0**e for e in range(-4, 13)]
for dtype, style in (("float32", "-"), ("bfloat16", "--")) if bf16_gemm else (("float32", "-"),):
    ax.plot(xs, [min(peak[dtype], x * bandwidth_Bps) / 1e9 for x in xs], style, color="gray",
            label=f"roof ({dtype}): min(peak, I x {hw['bandwidth_GBps']:.0f} GB/s)")
for name, intensity, attained in points:
    ax.plot(intensity, attained / 1e9, "o", markersize=8, label=name)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("arithmetic intensity (FLOP / byte)")
ax.set_ylabel("attained GFLOP/s")
ax.set_title("Roofline: decode sits on the bandwidth slope, prefill near the compute roof")
ax.legend(fontsize=8)
ax.grid(alpha=0.3, which="both")
plt.show()

# %% [markdown]
# **Reading the plot.** Decode's intensity is about 0.5 FLOP/byte in float32 (2 FLOPs per 4-byte weight): far left
# of the ridge, so its speed is set by bytes/second, and the way to speed it up is to move fewer bytes: bfloat16
# (half the bytes), quantization, or serving many sequences per weight read (batching, lesson 05). Prefill's
# intensity grows with the prompt length, so it runs against the compute roof; the last printed line splits its MFU
# below 100% into the model's matrix shape (576 wide, smaller than the square matmul that measured the peak) and the
# forward's other ops. On a shared CPU the measurements are noisy: compare the ratios, not the absolute numbers.

# %% [markdown]
# ## 5. The KV cache: what remembering costs
#
# To avoid recomputing the past, decode keeps every token's keys and values for every layer (lesson 01). Per token
# that is `2 (K and V) × n_layers × n_kv_heads × head_dim × bytes per value`. Grouped-query attention (lesson 02)
# shrinks `n_kv_heads`: SmolLM2 has 3 KV heads for 9 query heads.

# %%
print(inspect.getsource(kv_bytes_per_token))
for name, c, dtype_bytes, label in (("SmolLM2-135M", cfg, 2, "bf16"), ("SmolLM2-135M", cfg, 4, "fp32"),
                                    ("Llama-2-7B", LLAMA2_7B, 2, "fp16")):
    per_token = kv_bytes_per_token(c, dtype_bytes)
    print(f"{name:13s} {label}: 2 x {c.n_layers} x {c.n_kv_heads} x {c.head_dim} x {dtype_bytes} = "
          f"{per_token:,} bytes/token; {kv_bytes(c, 4096, dtype=dtype_bytes) / 2**30:.3f} GiB at 4096 tokens; "
          f"weights {c.n_params() * dtype_bytes / 2**30:.2f} GiB")
llama_kv, llama_weights = kv_bytes(LLAMA2_7B, 4096, dtype=2), LLAMA2_7B.n_params() * 2
print(f"Llama-2-7B: one 4096-token sequence's cache is {llama_kv / llama_weights:.0%} of the fp16 weights; "
      f"{-(-llama_weights // llama_kv)} such sequences need more memory than the weights themselves")
smol_match = cfg.n_params() * 2 // kv_bytes_per_token(cfg, 2)
print(f"SmolLM2-135M: the bf16 cache equals the bf16 weights at {smol_match:,} tokens (batch x context)")

contexts = [256 * 2**i for i in range(6)]
fig, ax = plt.subplots(figsize=(6.5, 4))
for name, c, weights_gib in (("SmolLM2-135M (bf16)", cfg, cfg.n_params() * 2 / 2**30),
                             ("Llama-2-7B (fp16)", LLAMA2_7B, LLAMA2_7B.n_params() * 2 / 2**30)):
    line, = ax.plot(contexts, [kv_bytes(c, n, dtype=2) / 2**30 for n in contexts], "o-", label=f"{name}: KV cache")
    ax.axhline(weights_gib, color=line.get_color(), ls=":", label=f"{name}: weights")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tokens in the cache (one sequence)")
ax.set_ylabel("GiB")
ax.set_title("KV cache grows linearly with context")
ax.legend(fontsize=8)
ax.grid(alpha=0.3, which="both")
plt.show()

# %% [markdown]
# Llama-2-7B has 32 KV heads (no GQA): a single 4096-token sequence's cache is already a sizeable fraction of its
# weights, and a handful of such sequences outweigh the model (printed above). SmolLM2's cache is small per token
# thanks to GQA, but a batch of long sequences still reaches the size of the weights. Memory for the cache is what
# limits how many sequences a server can decode at once, which is why lessons 02 (fewer KV heads) and 04 (paged
# allocation, no over-reservation) matter.

# %% [markdown]
# ## 6. Inside one block: RMSNorm, RoPE, attention, and the sampler
#
# One decoder block is `h = h + attention(rms_norm(h))`, then `h = h + mlp(rms_norm(h))`; after the last block a final
# norm and the tied embedding matrix give the logits, and the sampler turns them into a token. Exercise 00 asks you
# to write four of these pieces; here is what each one computes and why.
#
# **RMSNorm.** Each block adds its output to a residual stream that would otherwise grow layer after layer. RMSNorm
# rescales a token's vector to unit root-mean-square, then applies a learned gain per dimension:
# `y = x / sqrt(mean(x²) + eps) * weight`. Unlike LayerNorm it subtracts no mean (one reduction instead of two). The
# mean of squares is taken in float32 even for a bf16 model: 576 squares summed in bf16 lose the low bits that
# decide the scale.
#
# **RoPE (rotary position embedding).** Attention scores are dot products, and a dot product knows nothing about
# order. RoPE rotates each query and key by an angle proportional to its position: dimension pair *i* (here dims
# *i* and *i + head_dim/2*, the "rotate half" layout of HF checkpoints) turns by `p · θ^(−2i/d)` at position *p*.
# Rotating both q (at position m) and k (at n) leaves their dot product depending only on *m − n*: relative
# position, for free, with no parameters. Low *i* turn fast (local order), high *i* slowly (long range).
#
# **Attention.** `softmax(q kᵀ / sqrt(d) + mask) v` per head; the causal mask hides future keys; with grouped-query
# attention each KV head serves a group of query heads (lesson 02). Subtract each row's maximum before `exp`:
# logits of a few hundred overflow float32 otherwise, and the result is mathematically the same.
#
# **Sampling.** Greedy takes the argmax. Otherwise: divide the logits by the temperature (below 1 sharpens, above 1
# flattens), keep the top-k, keep the smallest set of most likely tokens whose probability reaches top-p (nucleus
# sampling), renormalise, draw. The cell below shows these properties on the real model, using minillm's functions.
#
# *Predict before you run the next cell:* for the next token after the chat prompt, how many tokens does top-p = 0.9
# keep at temperature 0.7, and at 1.5? Write both numbers down.

# %%
from minillm.model import apply_rope, rope_tables  # the engine's versions (exercise 00 asks for yours)
from minillm.sampling import logits_to_probs

ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
with torch.inference_mode():
    logits = model(torch.tensor([ids]))[0, -1:].float()
for t in (0.7, 1.5):
    kept = int((logits_to_probs(logits, temperature=t, top_p=0.9) > 0).sum())
    p = logits_to_probs(logits, temperature=t).flatten()
    effective = float(torch.exp(-(p * p.clamp_min(1e-30).log()).sum()))  # exp(entropy): the "effective" choices
    head = float(p.sort(descending=True).values[:max(1, round(effective))].sum())
    print(f"temperature {t}: top-p 0.9 keeps {kept} of {logits.shape[-1]:,} tokens; predicted from the entropy "
          f"~{effective:.1f} tokens, measured {kept}, because those {max(1, round(effective))} most likely tokens "
          f"hold {head:.0%} of the probability and top-p stops at the first count that reaches 90%")

block0 = model.layers[0]
seen = {}
hook = block0.attn_norm.register_forward_hook(lambda mod, args, out: seen.update(x=args[0], y=out))
with torch.inference_mode():
    model(torch.tensor([ids]))
hook.remove()


def rms(t):
    return t.float().pow(2).mean(-1).sqrt()


unit = seen["y"] / block0.attn_norm.weight  # the normalised vector, before the learned gain
print(f"block 0, per token: residual-stream RMS {rms(seen['x']).min():.3f}..{rms(seen['x']).max():.3f}; normalised "
      f"{rms(unit).min():.3f}..{rms(unit).max():.3f}; after the gain "
      f"{rms(seen['y']).min():.3f}..{rms(seen['y']).max():.3f}")

cos, sin = rope_tables(cfg.head_dim, 64, cfg.rope_theta)
q, k = torch.randn(1, 1, 1, cfg.head_dim), torch.randn(1, 1, 1, cfg.head_dim)


def rotated_dot(m: int, n: int) -> float:
    qm = apply_rope(q, cos[m].view(1, 1, 1, -1), sin[m].view(1, 1, 1, -1))
    kn = apply_rope(k, cos[n].view(1, 1, 1, -1), sin[n].view(1, 1, 1, -1))
    return float((qm * kn).sum())


print("RoPE: q.k at positions (5, 2), (15, 12), (40, 37) =", ", ".join(f"{rotated_dot(m, n):.4f}" for m, n in
                                                                          ((5, 2), (15, 12), (40, 37))),
      "(the same: only m - n matters);  (5, 4):", f"{rotated_dot(5, 4):.4f}")

# %% [markdown]
# ## 7. Putting it together: a short greedy generation
#
# `minillm.generate` = tokenize with the chat template, prefill, then decode greedily with the KV cache until the
# end-of-turn token. The time to first token (TTFT) is the prefill; the rest is decode.

# %%
res = minillm.generate(model, tok, "What is the capital of France?", max_new_tokens=pick(32, 12), chat=True)
print(repr(res.text))
print(f"prompt {res.prompt_tokens} tokens, generated {len(res.token_ids)}, TTFT {res.ttft_s * 1e3:.0f} ms, "
      f"decode {res.decode_tokens_per_s:.1f} tokens/s, finish_reason: {res.finish_reason}")
if QUICK:
    print("[QUICK mode: small sizes; run without MINILLM_QUICK for the numbers the text discusses]")

# %% [markdown]
# **Summary.** Decode at batch 1 is memory-bound by the roofline: its floor is the bytes per token divided by the
# bandwidth, which is why MBU, not MFU, is its figure of merit; section 3 printed how far this CPU's step is from
# that floor and which term holds it there. Prefill is compute-bound. The KV cache trades memory for not
# recomputing the past; its size per token follows directly from the config. Next, lesson 01 measures what that
# cache buys over the no-cache baseline (`minillm bench kv-cache`); exercise 00 has you write the decoder's
# pieces: `minillm grade 00` (its last task runs SmolLM2 on them), hints with `minillm hint 00`.
