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
# # Lesson 06 — Eager → fused → compiled: batch-1 decode against the bandwidth roof
#
# Lesson 00 said batch-1 decode is **memory bound**: every step reads all the weights once for one token, so the
# fastest a step can be is *bytes per token / memory bandwidth*. That is a roof, not a promise. A decode step of
# SmolLM2-135M is also about **two thousand small ops**: 30 blocks × (three q/k/v matmuls, two gate/up matmuls, two
# RMSNorms of ~8 elementwise ops each, RoPE on q and on k, reshapes, the cache write, attention...). Each op costs a
# dispatch (a few microseconds of Python and C++ on a CPU; a kernel launch on a GPU) *whatever its size*. How much of
# a step that per-op cost is, is a measurement, not a given: section 1 splits one step into its matmuls, attention,
# elementwise ops, sampling and Python/dispatch, and the answer says which lever is longer here — fewer ops (this
# lesson) or fewer bytes (quantization, lesson 07).
#
# Two ways to remove ops without changing the math:
# - **Operator fusion** (`minillm/compile/fusion.py`): transformations of a loaded model. The q, k and v projections
#   become one matmul whose output is split (GQA sizes: q is 9×64 wide, k and v 3×64 each); gate and up become one;
#   RoPE rotates q and k in one call; the residual add is folded into the RMSNorm that follows it.
# - **Compilation** (`minillm/compile/torch_compile.py`): `torch.compile` traces the whole decode step into a graph and
#   *generates* code for it (C++ loops on a CPU, Triton kernels on a GPU): each chain of elementwise ops becomes one
#   loop, and the Python walk over 30 blocks disappears. It needs a step whose shapes never change — a **static KV
#   cache** (preallocated, written at the token's position, attended with a mask) — or it would recompile every token.
#   On a GPU, **CUDA graphs** (mode="reduce-overhead") also replay the whole step's kernel launches as one.
#
# A third way removes the ops altogether: **one native step** (`minillm/compile/native.py`,
# `kernels/cpu/native_step.cpp`) runs every decoder layer of a step in one C++ call — the same math on the same KV
# cache, the matmuls and attention split over the threads inside one parallel region — which is what llama.cpp does
# for its whole graph. It reads float32 weights where they lie with its own matrix-vector kernel
# (`kernels/cpu/f32_matmul.cpp`, the LM head too) or lesson 07's low-bit ones: section 4 puts it on the float32
# ladder, section 6 on the file's 4-bit model.
#
# This lesson: (1) where a decode step's time goes (profiler); (2) fusion: fewer ops, identical logits; (3) compiling
# the step: compile time, zero recompiles; (4) the ladder — eager fp32 → fused → compiled, and bf16 — against the
# roofs measured in the same run, and the native step; (5) what the compiler generated; (6) the last rung on 4-bit
# weights: eager → fused → compiled → one native step; (7) what a GPU adds.

# %%
import copy
import dataclasses
import time

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.measure import roofline
from minillm.measure.breakdown import step_breakdown
from minillm.bench.fusion import first_divergence, ladder
from minillm.measure.hardware import bf16_status
from minillm.compile.fusion import count_ops, fuse
from minillm.kv_cache import KVCache
from minillm.course.lesson import hardware_line, pick

torch.set_num_threads(1)  # one thread: on a shared 2-core machine a second thread mostly measures the neighbours
print(hardware_line())
print(bf16_status("cpu"))
model, tok = minillm.load_model("smollm2-135m", dtype="float32", device="cpu")
prompt_ids = tok.encode("The history of the printing press begins with " * 8)[:32]

# %% [markdown]
# ## 1. Where the time of one decode step goes
#
# The profiler records every op of one batch-1 decode step (after a 32-token prefill into a KV cache).

# %%
def one_decode_step(m):
    cache = KVCache.for_model(m, 1, len(prompt_ids) + 1)
    with torch.inference_mode():
        m(torch.tensor([prompt_ids]), kv_cache=cache)

    def step():
        cache.truncate(len(prompt_ids))  # every call decodes the same position
        return m(torch.tensor([prompt_ids[:1]]), kv_cache=cache, last_only=True)
    return step


step = one_decode_step(model)
with torch.inference_mode():
    step()  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
events = prof.key_averages()
total_us = sum(e.self_cpu_time_total for e in events)
n_events = sum(e.count for e in events if e.key.startswith("aten::"))
print(f"one eager decode step: {total_us / 1e3:.1f} ms of CPU time, {n_events} aten profiler events (an op that "
      f"calls others, like linear -> matmul -> mm, is counted at every level; section 2 counts dispatched ops)")
print(events.table(sort_by="self_cpu_time_total", row_limit=8))
# the same kind of step, split by term (minillm.measure.breakdown): which lever is longer on this machine
split = step_breakdown(model, "decode", context=len(prompt_ids), repeat=pick(7, 3))
print(split.table())
per_op = split.terms["else"] + split.terms["elementwise"]
print(f"per-op work (Python/dispatch {split.terms['else']:.1f} ms + small elementwise ops "
      f"{split.terms['elementwise']:.1f} ms) is {per_op / split.wall_ms:.0%} of the step, the weight matmuls "
      f"{split.shares['matmul']:.0%}: "
      + ("removing ops is the longer lever here" if per_op > split.terms["matmul"] else
         f"reading fewer bytes (lesson 07) is the longer lever here; removing every op could win at most "
         f"{split.wall_ms / (split.wall_ms - per_op):.2f}x"))

# %% [markdown]
# The matmuls (`aten::addmm`/`aten::mm`/`aten::linear`) read the weights; everything else is the overhead this lesson
# attacks, and the last line says how large a share of this machine's step it is. The table's "# of Calls" column
# is the count that matters: hundreds of RMSNorm pieces (`pow`, `mean`, `rsqrt`, `mul`, `to`), RoPE pieces (`cat`,
# `neg`, `mul`, `add`), and reshapes.

# %% [markdown]
# ## 2. Fusion: fewer ops, the same logits
#
# `fuse(model)` swaps each block's attention, MLP and norm wiring for fused versions that reuse the same weights
# (concatenated once, the originals dropped). *Predict before you run the next cell:* SmolLM2 has 30 blocks; q/k/v
# fusion removes 2 matmul calls per block, gate/up 1, rotating q and k together ~6 elementwise ops, the folded
# residual ~1. About how many of the ~2,000 ops per step should be left? Write your number down.

# %%
fused = fuse(copy.deepcopy(model))
ops_step = {}
for name, m in (("eager", model), ("fused", fused)):
    cache = KVCache.for_model(m, 1, len(prompt_ids) + 1)
    with torch.inference_mode():
        m(torch.tensor([prompt_ids]), kv_cache=cache)
    ops_step[name] = count_ops(m, torch.tensor([prompt_ids[:1]]), kv_cache=cache)
with torch.inference_mode():
    x = torch.tensor([prompt_ids])
    diff = float((fused(x) - model(x)).abs().max())
print(f"aten ops per decode step: eager {ops_step['eager']}, fused {ops_step['fused']} "
      f"({ops_step['fused'] / ops_step['eager']:.0%} of eager); max |logit difference| fused vs eager: {diff:.2e}")
n_blocks = len(model.layers)
predicted_ops = ops_step["eager"] - n_blocks * (2 + 1 + 6 + 1)  # the question's arithmetic, per block
added_back = (ops_step["fused"] - predicted_ops) / n_blocks
print(f"predicted {predicted_ops} ops ({n_blocks} blocks x 10 fewer), measured {ops_step['fused']}, because "
      + (f"fusion adds {added_back:.0f} op(s) per block back: each fused matmul's output is split into its parts "
         f"(q, k, v; gate, up), one split_with_sizes per fused matmul" if added_back > 0 else
         f"fusion removed {-added_back:.0f} more op(s) per block than the estimate counted"))

# %% [markdown]
# ## 3. Compiling the decode step
#
# `minillm.generate(..., compile=True)` prefills eagerly into a `StaticKVCache` (length rounded up to a power of
# two, so many requests share one compiled program) and runs every decode step through `torch.compile(fullgraph=True)`.
# The first call pays for tracing and code generation; inductor keeps the generated code in an on-disk cache, so a
# second *process* compiles faster (`minillm bench fusion` measures both). We count recompiles while decoding.

# %%
torch._dynamo.reset()
t0 = time.perf_counter()
minillm.generate(fused, None, prompt_ids, max_new_tokens=4, ignore_eos=True, compile=True)
compile_s = time.perf_counter() - t0
n_new = pick(128, 16)
with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile would raise here
    eager_out = minillm.generate(model, None, prompt_ids, max_new_tokens=n_new, ignore_eos=True)
    compiled_out = minillm.generate(fused, None, prompt_ids, max_new_tokens=n_new, ignore_eos=True, compile=True)
graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
print(f"first compiled call (trace + codegen + 4 tokens): {compile_s:.1f} s; graphs compiled: {graphs}; "
      f"{n_new} more compiled steps ran with error_on_recompile=True: no recompile")
print("greedy tokens, compiled vs eager (float32):",
      "identical" if compiled_out.token_ids == eager_out.token_ids else
      f"differ from token {first_divergence(compiled_out.token_ids, eager_out.token_ids)}")

# %% [markdown]
# ## 4. The ladder, against the roofs measured in this run
#
# Each variant decodes the same 32-token prompt greedily; tok/s counts the tokens after the first. **MBU** is lesson
# 01's: achieved bytes/s over peak bytes/s, achieved = bytes read per token (weights + K/V) × tok/s, peak = the copy
# probe (`hardware.probe_bandwidth`, the figure every lesson and bench divides by; a GPU's datasheet figure there).
# Two more roofs, measured here and now, each as a share: the **read probe** (a large reduction: a decode step only
# *reads* weights, and reads alone may stream faster than a copy), and the **matmul ceiling** — torch's own batch-1
# matrix-vector products over this model's weights with nothing else in the step, i.e. what torch's kernels can
# reach on this machine at all. bf16 halves the bytes; whether it is faster depends on whether this CPU has bf16
# instructions (above).

# %%
repeat = pick(3, 1)
# quick mode (CI) compiles nothing more here: section 3 showed compilation, and each compile takes half a minute
rows, tokens, extra = ladder(model, prompt_ids, n_new, repeat,
                             compiled_dtypes=pick((torch.float32, torch.bfloat16), ()))
print(f"peak (copy probe) {extra['copy_GBps']:.1f} GB/s, read probe {extra['read_GBps']:.1f} GB/s; {n_new} new tokens, "
      f"best of {repeat} round-robin rounds")
print(f"{'variant':<18}{'tok/s':>8}{'ops/step':>10}{'MBU':>7}{'of read':>9}{'of ceiling':>12}{'roof tok/s':>12}"
      f"{'ceiling tok/s':>15}")
for r in rows:
    print(f"{r['variant']:<18}{r['decode_tok_s']:>8.1f}{r['ops_per_step'] or '-':>10}{r['mbu']:>7.0%}"
          f"{r['of_read_probe']:>9.0%}{r['of_matmul_ceiling']:>12.0%}{r['roof_tok_s']:>12.1f}{r['ceiling_tok_s']:>15.1f}")

# %%
fig, ax = plt.subplots(figsize=(8, 3.8))
names = [r["variant"] for r in rows]
ax.bar(names, [r["decode_tok_s"] for r in rows], color=["#4c72b0" if "float32" in n else "#dd8452" for n in names])
for i, r in enumerate(rows):
    ax.hlines(r["ceiling_tok_s"], i - 0.4, i + 0.4, colors="k", linestyles="--",
              label="matmul ceiling" if i == 0 else None)
    ax.hlines(r["roof_tok_s"], i - 0.4, i + 0.4, colors="r", linestyles=":",
              label="bandwidth roof (MBU 100%)" if i == 0 else None)
ax.set_ylabel("decode tokens/s (batch 1)")
ax.set_title("SmolLM2-135M decode: eager → fused → compiled → native")
ax.legend(loc="upper left")
plt.xticks(rotation=20)
plt.tight_layout()
plt.show()

# %%
by = {r["variant"]: r for r in rows}
tps = {k: r["decode_tok_s"] for k, r in by.items()}
best32 = max((k for k in ("eager float32", "fused float32", "compiled float32") if k in tps), key=tps.get)
print(f"float32 in torch: the fastest variant here is {best32} at {tps[best32]:.1f} tok/s, "
      f"{by[best32]['of_matmul_ceiling']:.0%} of what torch's bare matvecs allow; "
      f"compiled/eager = {tps.get('compiled float32', float('nan')) / tps['eager float32']:.2f}x, "
      f"fused/eager = {tps['fused float32'] / tps['eager float32']:.2f}x.")
if "compiled bfloat16" in by:
    print(f"bfloat16: compiled/eager = {tps['compiled bfloat16'] / tps['eager bfloat16']:.2f}x.")
print(f"bf16/fp32 eager = {tps['eager bfloat16'] / tps['eager float32']:.2f}x.")
gap = 1 - by["eager float32"]["of_matmul_ceiling"]
won = max(tps["fused float32"], tps.get("compiled float32", 0.0)) / tps["eager float32"] - 1
print(f"eager float32 runs at {1 - gap:.0%} of the matmul ceiling: at most {gap:.0%} of the step is overhead that "
      f"removing ops could recover; the best of fused/compiled recovered {won:+.0%} of eager's speed here"
      + (", so torch's matmuls themselves bound this CPU's decode." if won < 0.1 else "."))
if "native float32" in by:
    nat = by["native float32"]
    print(f"native float32: {tps['native float32']:.1f} tok/s = {tps['native float32'] / tps['eager float32']:.2f}x "
          f"eager, {nat['ops_per_step']} ops per step (eager {by['eager float32']['ops_per_step']}), "
          f"{nat['of_matmul_ceiling']:.0%} of torch's matvec ceiling and {nat['mbu']:.0%} of the copy probe (MBU); "
          "greedy tokens " + ("identical to eager's" if tokens["native float32"] == tokens["eager float32"] else
                              f"differ from eager's at new token "
                              f"{first_divergence(tokens['native float32'], tokens['eager float32'])}"))

# %% [markdown]
# How to read this on your machine. When eager decode is already close to the matmul ceiling, the step is bound by
# the matrix-vector products, and removing ops cannot help much; inductor's CPU code also calls matvec kernels of its
# own, which need not be faster than eager's. That is what a CPU with few cores and a 135M-parameter model tends to
# show, and why gpt-fast's big wins (eager 25 → compiled 107 tok/s on Llama-7B) are GPU numbers, where each of those
# ~2,000 ops is a kernel launch of several microseconds. The ceiling itself is not the bandwidth roof either: torch's
# matvec kernels reach only part of the memory bandwidth at these shapes. The native row shows both at once: the same
# float32 weights read by a kernel written for one row (4 weight rows at a time, every load a full vector, the threads
# splitting rows inside one parallel region) with no op around it — its share of "torch's ceiling" above 100% is the
# part of the gap that was torch's kernels, not the memory. The next lesson's quantized kernels are measured against
# both roofs.
#
# **A roofline model: why the sign flips on a GPU** (`minillm/measure/roofline.py`; a model, not a measurement). A step
# takes max(bytes / bandwidth, FLOPs / FLOP/s) plus its ops × a fixed cost per op. On this CPU the same core
# dispatches and computes, so the op cost adds to the roofline time; on a GPU the CPU queues launches while earlier
# kernels run, so the larger of the launches and the roofline time sets the pace. This CPU's numbers are measured
# now (the per-op cost: a multiply of two 576-wide rows, the floor of what an eager op costs); the H100's are its
# datasheet's, with ~5 µs per kernel launched from eager PyTorch. Compiled is modelled at its best: no per-op cost
# on this CPU; on the GPU one CUDA graph per step, whose replay still runs ~2 kernels per matmul (the matmul and one
# fused elementwise kernel) at ~1 µs each with no CPU launch (an assumption, stated here, not a datasheet figure).

# %%
cpu, h100 = roofline.this_cpu(torch.float32), roofline.H100_SXM
graph = dataclasses.replace(h100, name="H100 SXM, CUDA graph (model)", op_seconds=1e-6)
n_mm = sum(isinstance(mod, torch.nn.Linear) for mod in model.modules())
ctx = len(prompt_ids) + n_new // 2
predicted = {}
print(f"{'machine':<30}{'eager ms':>10}{'fused ms':>10}{'compiled ms':>13}{'fused':>8}{'compiled':>10}  eager bound by")
# compiled at its best: no per-op cost on this CPU; on the GPU a graph replay of ~2 kernels per matmul
for machine, compiled_on, compiled_ops in ((cpu, cpu, 0), (h100, graph, 2 * n_mm)):
    steps = {k: roofline.forward_step(model.config, machine, context=ctx, ops=n) for k, n in ops_step.items()}
    steps["compiled"] = roofline.forward_step(model.config, machine, context=ctx, ops=compiled_ops)
    ms = {k: (compiled_on if k == "compiled" else machine).seconds(v) * 1e3 for k, v in steps.items()}
    predicted[machine.name] = {k: ms["eager"] / ms[k] for k in ("fused", "compiled")}
    print(f"{machine.name[:29]:<30}{ms['eager']:>10.2f}{ms['fused']:>10.2f}{ms['compiled']:>13.3f}"
          f"{predicted[machine.name]['fused']:>7.2f}x{predicted[machine.name]['compiled']:>9.1f}x  "
          f"{machine.bound(steps['eager'])}")
for machine in (cpu, h100):  # the launch-overhead arithmetic behind each eager row
    terms = machine.terms(roofline.forward_step(model.config, machine, context=ctx, ops=ops_step["eager"]))
    print(f"  eager on {machine.name}: {terms['memory'] * 1e3:.2f} ms to read the weights, "
          f"{terms['compute'] * 1e3:.3f} ms of FLOPs, {ops_step['eager']} ops x {machine.op_seconds * 1e6:.1f} us = "
          f"{terms['ops'] * 1e3:.2f} ms of per-op cost ({machine.source})")
removed_ms, step_ms = (ops_step["eager"] - ops_step["fused"]) * cpu.op_seconds * 1e3, 1e3 / tps["eager float32"]
measured = {k: tps[f"{k} float32"] / tps["eager float32"] for k in ("fused", "compiled") if f"{k} float32" in tps}
print(f"predicted fused/eager {predicted[cpu.name]['fused']:.2f}x on this CPU, measured {measured['fused']:.2f}x, "
      f"because the {ops_step['eager'] - ops_step['fused']} ops fusion removes cost ~{removed_ms:.2f} ms of a "
      f"{step_ms:.0f} ms step ({removed_ms / step_ms:.1%}): a change that small is inside a shared machine's noise, "
      f"either sign")
if "compiled" in measured:
    print(f"predicted compiled/eager at most {predicted[cpu.name]['compiled']:.2f}x on this CPU, measured "
          f"{measured['compiled']:.2f}x: removing every op's cost wins at most that much, "
          + (f"and here the generated step was {1 - measured['compiled']:.0%} slower than eager's; where that time "
             f"goes is not measured in this cell (the removed ops were worth ~{removed_ms:.1f} ms per step, fused)"
             if measured["compiled"] < 1 else "and the generated code kept the rest"))
lost = [k for k, v in measured.items() if v < 1]
print(f"on the H100 model: fused {predicted[h100.name]['fused']:.2f}x, "
      f"compiled {predicted[h100.name]['compiled']:.0f}x, because its eager step is launch-bound "
      f"({ops_step['eager']} launches take longer than reading the weights), so every op removed is time removed: "
      + (f"{' and '.join(lost)}, a loss on this CPU, is a gain there" if lost else
         "a few percent at most on this CPU becomes a multiple there"))

# %% [markdown]
# ## 5. What the compiler generated
#
# `torch._inductor.utils.run_and_get_code` returns the source inductor wrote. For RMSNorm (float32 upcast, mean of
# squares, rsqrt, scale: eight ops eagerly), the CPU backend emits one C++ loop nest that reads x once.

# %%
from torch._inductor.utils import run_and_get_code

from minillm.model import rms_norm

torch._dynamo.reset()
xs, w = torch.randn(1, 576), torch.ones(576)
_, codes = run_and_get_code(torch.compile(lambda a, b: rms_norm(a, b, 1e-5)), xs, w)
kernel = next((c for c in codes if "cpp_fused" in c or "extern" in c or "def call" in c), codes[0])
start = kernel.find("cpp_fused")
print(kernel[start: start + 1500] if start >= 0 else kernel[:1500])

# %% [markdown]
# ## 6. The last rung: every layer in one native call
#
# The same four rungs on the file's 4-bit weights (lesson 07 explains the format and its kernels; here only the ops
# around them matter): eager, fused, compiled, and `load_model(..., native=True)`. First the eager 4-bit step's
# breakdown — its matmuls got 4x cheaper in bytes, so the per-op share grew. *Predict before you run the next cell:*
# the native step keeps the matmuls and attention and removes the Python/dispatch ("else") term and most of the
# elementwise term. From the eager q4 breakdown printed below, what is the most the native step can win?

# %%
q4 = {"eager": minillm.load_model(weights="q4")[0], "fused": minillm.load_model(weights="q4", fuse=True)[0],
      "native": minillm.load_model(weights="q4", native=True)[0]}
q4_split = {k: step_breakdown(m, "decode", context=len(prompt_ids), repeat=pick(7, 3)) for k, m in q4.items()}
for k, b in q4_split.items():
    print(f"q4 {k:<7}", b.line())
e, nat = q4_split["eager"], q4_split["native"]
bound = e.wall_ms / (e.terms["matmul"] + e.terms["attention"])
carried = e.terms["matmul"] - nat.terms["matmul"]
print(f"predicted: at most {bound:.2f}x (the eager q4 step's {e.wall_ms:.2f} ms over its matmul + attention "
      f"{e.terms['matmul'] + e.terms['attention']:.2f} ms); measured {e.wall_ms / nat.wall_ms:.2f}x "
      f"({nat.wall_ms:.2f} ms per step), because "
      + (f"eager's matmul term itself carried {carried:.2f} ms of per-call cost (Python, checks and allocation around "
         f"each of its {e.op_counts['matmul']} kernel calls): the same matmuls took {nat.terms['matmul']:.2f} ms "
         f"inside the native step" if carried > 0 else
         f"the native step's matmuls took {nat.terms['matmul']:.2f} ms (eager: {e.terms['matmul']:.2f} ms)")
      + f"; its per-token work took {nat.terms['elementwise']:.2f} ms and what is left outside the C++ call "
      f"(embedding, LM head, sampling, Python) {nat.terms['else'] + nat.terms['sampling']:.2f} ms; ops dispatched "
      f"per step: eager {e.n_ops}, native {nat.n_ops}")

# %% [markdown]
# Now the rungs' decode speed, round-robin in one run (best round each), and whether the native step's greedy
# tokens are eager's. Both round activations to int8 per block of 32 before each matmul (lesson 07), so a last-bit
# difference upstream can move a rounding: the cell measures how much the eager logits themselves move when the
# embeddings are scaled by (1 + 1e-7 · noise), the noise floor a native/eager difference is judged against.

# %%
from minillm.measure.metrics import decode_tok_s

rungs = dict(q4)
if pick(True, False):  # quick mode (CI) skips compiling: section 3 showed it
    rungs = {"eager": q4["eager"], "fused": q4["fused"], "compiled": q4["fused"], "native": q4["native"]}
    decode_tok_s(q4["fused"], prompt_ids, 4, 1, compile=True)  # compiled once, outside the timings
best, greedy = dict.fromkeys(rungs, 0.0), {}
for _ in range(repeat):
    for k, m in rungs.items():
        rate, greedy[k] = decode_tok_s(m, prompt_ids, n_new, 1, compile=(k == "compiled"))
        best[k] = max(best[k], rate)
print("q4 decode tok/s (batch 1, 1 thread): " + ", ".join(f"{k} {v:.1f}" for k, v in best.items()))
print(f"native / eager = {best['native'] / best['eager']:.2f}x, native / fused = {best['native'] / best['fused']:.2f}x"
      + (f", compiled / eager = {best['compiled'] / best['eager']:.2f}x" if "compiled" in best else ""))
with torch.inference_mode():
    ids = torch.tensor([prompt_ids + greedy["eager"]])
    ref = q4["eager"](ids)[0]
    torch.manual_seed(0)
    h = q4["eager"].embed_tokens(ids)
    h = h * (1 + 1e-7 * torch.randn_like(h))
    nudged = q4["eager"].logits(q4["eager"].run_layers(h, torch.arange(ids.shape[1])[None]))[0]
    cache = KVCache.for_model(q4["native"], 1, ids.shape[1])
    native_logits = q4["native"](ids, kv_cache=cache)[0]
noise, diff = (nudged - ref).abs().mean().item(), (native_logits - ref).abs().mean().item()
first = first_divergence(greedy["native"], greedy["eager"])
top2 = ref[len(prompt_ids) - 1 + (first or 0)].topk(2).values
print(f"mean |logit difference|: native vs eager {diff:.3f}, eager vs eager nudged by 1e-7 {noise:.3f} "
      f"(the noise floor)")
print("greedy tokens native vs eager: " + ("identical" if first is None else
      f"first differ at new token {first} of {n_new}, where eager's top-2 margin is {float(top2[0] - top2[1]):.3f}"))

# %%
fig, ax = plt.subplots(figsize=(7, 3.4))
ax.bar(list(best), list(best.values()), color=["#4c72b0", "#55a868", "#c44e52", "#8172b2"][:len(best)])
ax.set_ylabel("decode tokens/s (batch 1, q4)")
ax.set_title("SmolLM2-135M q4: eager → fused → compiled → one native step")
plt.tight_layout()
plt.show()

# %% [markdown]
# Reading it: the native rung keeps the matmuls and attention and drops the per-op cost around them. The bound the
# prediction computed took eager's matmul term as pure matmul work; the breakdown above shows it was not (the same
# matmuls took less inside the native step: each eager kernel call also paid its Python, checks and allocation), so
# the measured gain can exceed that bound. What is left outside the C++ call is the embedding lookup, the LM head
# and sampling (the native step's op count above). The same call serves `generate()`, the engine's packed steps
# (decodes, verifies and prompt chunks in one forward) and the speculative verify; `minillm bench lowbit` measures
# it against llama.cpp at 1 and 2 threads,
# and lesson 14's edge profile runs it.

# %% [markdown]
# ## 7. On a GPU
#
# On CUDA, `compile=True` uses mode="reduce-overhead": the compiled step is recorded as a **CUDA graph** and replayed,
# so the ~hundreds of kernels of a step cost one launch. That is where the big ratios of this technique come from
# (section 4's roofline model: on an H100 the eager step of this model is launch-bound, several times longer than
# reading its weights); `scripts/gpu_check.sh` measures it when a GPU is available. This lesson's figures are from
# the CPU named at the top (no GPU was available when it was executed).
#
# **Exercise 06** (`exercises/ex06_fusion.py`, graded by `minillm grade 06`, hints one level at a time with
# `minillm hint 06`): the two halves of this lesson's technique. First fuse the residual add into the RMSNorm after it
# (`add_rms_norm`: the sum formed once, float32 statistics), graded against the unfused computation on random shapes
# and dtypes. Then write the `StaticKVCache` that section 3 compiled through: `begin_forward` places the tokens and
# builds the mask from *tensor* positions, `attend` writes k/v at those slots and attends over the whole buffer under
# the mask. It is graded against attention over a contiguous history, and by tracing a decode step with
# `torch.compile(fullgraph=True)` under `error_on_recompile`: one graph for every position. The last task fuses SmolLM2
# with your `add_rms_norm` and decodes it through your cache with the forward compiled once: the eager model's
# tokens, one graph. Next, lesson 07 (quantization) reads fewer bytes per token.
