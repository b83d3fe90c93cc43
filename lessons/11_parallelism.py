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
# # Lesson 11 — Tensor, sequence and pipeline parallelism on torch.distributed
#
# Everything so far ran on one device. Models outgrow it in three ways: the **weights** do not fit (Llama-2-70B is
# 140 GB in bf16; an H100 has 80), the **KV cache** for the batch you want does not fit, or one device is too
# **slow** for the latency you promised. Splitting the model across devices answers all three, in different ways:
#
# - **tensor parallelism** (Megatron-LM): every device holds a slice of *every* weight matrix and computes a slice of
#   every layer; two all-reduces per block put the pieces together. Cuts weights, KV and per-token latency, at the
#   price of communication inside every block — so it lives inside one node, on NVLink;
# - **sequence parallelism** (Megatron-SP): the regions between the tensor-parallel matmuls (norms, residual adds)
#   are split along the sequence instead of replicated; same bytes on the wire, less activation memory;
# - **pipeline parallelism** (GPipe): each device holds a contiguous *stage* of the blocks and passes hidden states
#   on; cheap point-to-point traffic that crosses nodes well, but an idle **bubble** while the pipe fills and drains.
#
# This lesson runs all three for real: one process per rank, `torch.distributed` process groups (gloo on CPU, NCCL on
# GPU), started by `minillm.parallel.distributed.launch` (or `torchrun`). Sections: (1) column- and row-parallel
# linears; (2) tensor parallelism on the real model, and the head-count constraint; (3) what every collective moves;
# (4) sequence parallelism; (5) the pipeline and its bubble; (6) the benchmark, and what it would be on a GPU node.

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.bench import run_entry
from minillm.course.lesson import QUICK, hardware_line, pick
from minillm.api import generate_ids
from minillm.gguf.loader import load_spec
from minillm.parallel.launch import generate_parallel
from minillm.sampling import SamplingParams
from minillm.parallel.pipeline import bubble_fraction, gpipe_schedule
from minillm.parallel.sequence import residual_bytes
from minillm.parallel.tensor import TPPlan, column_slice, row_slice, tp_bytes_per_token

torch.set_num_threads(1)
print(hardware_line())

# %% [markdown]
# ## 1. Column-parallel and row-parallel linears
#
# y = x Wᵀ with W of shape (out, in). Split W's **rows** (output features) over p ranks and each rank computes its
# slice of y from the whole x — *column parallel*, no communication. Split W's **columns** (input features) and each
# rank multiplies its slice of x by its slice of W: a *partial sum* of the whole y — *row parallel*, one all-reduce.
# A column-parallel layer followed by a row-parallel one needs no communication in between, because the first one's
# split output is exactly the second one's split input. Simulate three ranks in one process:

# %%
torch.manual_seed(0)
x = torch.randn(4, 12)
w1, w2 = torch.randn(24, 12), torch.randn(12, 24)  # x -> 24 features (column parallel) -> 12 (row parallel)
full = (x @ w1.T).relu() @ w2.T
p = 3
partials = [(x @ column_slice(w1, r, p).T).relu() @ row_slice(w2, r, p).T for r in range(p)]  # no talk in between
print(f"rank 0 holds {tuple(column_slice(w1, 0, p).shape)} of W1 and {tuple(row_slice(w2, 0, p).shape)} of W2")
print(f"one partial alone is off by {float((partials[0] - full).abs().max()):.2f}; "
      f"after the all-reduce (the sum) by {float((sum(partials) - full).abs().max()):.1e}")

# %% [markdown]
# An elementwise function between the two (ReLU here, SwiGLU in the model) is fine on the column-split output: each
# rank applies it to whole features. That is the MLP: gate/up column parallel, down row parallel. Attention is the
# same pattern with heads: q/k/v column parallel (each rank gets whole heads), attention on the local heads, the output
# projection row parallel. Two all-reduces per block, whatever p is. The embedding and the tied LM head split along
# the vocabulary (an all-reduce of the lookups, an all-gather of the logits).
#
# ## 2. Tensor parallelism on SmolLM2, and the head-count constraint
#
# A rank must hold whole KV heads and the query heads that read them. SmolLM2-135M has 9 query heads and 3 KV heads:

# %%
cfg = minillm.load_model(dtype="float32")[0].config
for degree in (1, 2, 3, 4, 6):
    try:
        print(TPPlan.for_config(cfg, degree).describe(cfg))
    except ValueError as e:
        print(f"tp={degree}: refused: {e}")

# %% [markdown]
# So tp = 3 splits everything; tp = 2 is allowed but replicates attention (each rank computes all heads, and only
# the MLP and vocabulary are split). Now real ranks: three processes, gloo, each loading the model and keeping its
# shard, greedy decoding. Every rank computes the same next token (the all-gathered logits are identical everywhere),
# and the output must equal the single process's.

# %%
prompt = "The capital of France is"
model, tok = minillm.load_model(dtype="float32")
n_new = pick(24, 8)
if QUICK:  # CI: a small random model through the same code path (3 ranks loading SmolLM2 take a minute there)
    spec = {"tiny": {"n_layers": 4, "n_heads": 6, "n_kv_heads": 3, "dim": 96, "ffn_dim": 192, "vocab_size": 384},
            "seed": 0}
    ref_model, ids = load_spec(spec)[0], list(range(1, 13))
else:
    spec, ref_model, ids = "smollm2-135m", model, tok.encode(prompt)
single = list(generate_ids(ref_model, ids, SamplingParams(max_tokens=n_new, ignore_eos=True)))
(par,) = generate_parallel(spec, [ids], SamplingParams(max_tokens=n_new, ignore_eos=True), tp=3, threads=1)
if not QUICK:
    print(repr(tok.decode(par.token_ids)))
with torch.inference_mode():
    ref_logits = ref_model(torch.tensor([ids]))[0, -1]
print(f"tp=3 tokens identical to one process: {par.token_ids == single}; first-step logits differ by "
      f"{float((par.metrics['first_logits'] - ref_logits).abs().max()):.1e} (the partial sums are added in another "
      f"order)")

# %% [markdown]
# ## 3. What every collective moves
#
# `minillm.parallel.distributed.Comm` counts each collective: calls, the bytes handed to it and the bytes a ring
# algorithm sends per rank — 2(p−1)/p × size for an all-reduce (reduce-scatter, then all-gather), (p−1)/p × the full
# tensor for an all-gather. Per decoded token, tensor parallelism on this model all-reduces (2 × 30 + 1) vectors of 576
# floats and all-gathers the logits. The counts from the run above, against the formula:
#
# *Predict before you run the next cell:* per decoded token at tp = 3, how many bytes does each rank send for one
# all-reduce of 576 float32 values, and how many all-reduces does a token need? Write both down.

# %%
plan = TPPlan.for_config(ref_model.config, 3)
formula = tp_bytes_per_token(ref_model.config, plan)
steps = par.metrics["decode_steps"]
for op, stats in par.metrics["comm_decode"].items():
    per_token = stats["bytes"] / steps
    f = formula.get(op)
    print(f"{op:<11} {stats['calls'] / steps:5.0f} calls/token, {per_token / 1024:7.2f} KiB/token handed in, "
          f"{stats['ring_bytes'] / steps / 1024:7.2f} KiB/token sent per rank"
          + (f"  (formula {f / 1024:.2f} KiB: {'exact' if f == per_token else 'DIFFERENT'})" if f else ""))
print(f"{par.metrics['comm_decode_s'] / par.metrics['decode_s']:.0%} of this decode's time was spent inside "
      f"collectives")
p_tp, ar = plan.degree, par.metrics["comm_decode"]["all_reduce"]
per_block = 2 if plan.split_attention else 1
want_calls, want_ring = ref_model.config.n_layers * per_block + 1, 2 * (p_tp - 1) / p_tp * ref_model.config.dim * 4
all_calls = sum(v["calls"] for v in par.metrics["comm_decode"].values())
per_call_us = par.metrics["comm_decode_s"] / all_calls * 1e6
print(f"predicted (ring formula, tp = {p_tp}): {want_ring / 1024:.2f} KiB sent per rank per all-reduce, "
      f"{want_calls} all-reduces per token; measured {ar['ring_bytes'] / ar['calls'] / 1024:.2f} KiB and "
      f"{ar['calls'] / steps:.0f} per token, because Comm charges each call the ring's 2(p-1)/p x its bytes; the "
      f"time is another matter: {all_calls / steps:.0f} collectives per token at {per_call_us:.0f} us each on "
      f"average, for {sum(v['ring_bytes'] for v in par.metrics['comm_decode'].values()) / all_calls / 1024:.1f} KiB "
      f"each, are {par.metrics['comm_decode_s'] / par.metrics['decode_s']:.0%} of the decode")

# %% [markdown]
# ## 4. Sequence parallelism
#
# Between the tensor-parallel regions every rank holds the whole residual stream (tokens × dim) and runs the same
# RMSNorm and residual add on it: p copies of the same work and memory. Megatron-SP splits those regions along the
# sequence. Before a region: all-gather the tokens (each rank holds s/p of them); after its row-parallel matmul:
# reduce-scatter instead of all-reduce. An all-reduce *is* a reduce-scatter plus an all-gather, so the bytes on the
# wire are the same — the all-gather just moves to the other side of the norm. What shrinks is the activation memory
# of the residual stream (for training, the activations kept for backward):

# %%
for n_tok in (96, 2048, 8192):
    tp_b, sp_b = residual_bytes(cfg, n_tok, 3, False), residual_bytes(cfg, n_tok, 3, True)
    print(f"{n_tok:>5} tokens: residual stream per rank {tp_b / 2**20:6.2f} MiB with TP, {sp_b / 2**20:6.2f} MiB with "
          f"TP+SP (x{tp_b / sp_b:.0f})")
(sp,) = generate_parallel(spec, [ids], SamplingParams(max_tokens=n_new, ignore_eos=True), tp=3, sp=True, threads=1)
print(f"tp=3 + sp tokens identical to one process: {sp.token_ids == single}; prefill collectives: "
      + ", ".join(f"{op} {s['calls']}x {s['bytes'] / 1024:.0f} KiB" for op, s in sp.metrics["comm_prefill"].items()))

# %% [markdown]
# ## 5. The pipeline and its bubble
#
# Stage r holds blocks [a_r, b_r); stage 0 embeds, the last stage computes logits. One input visits the stages one
# after another, so the others idle. GPipe cuts the input into m micro-batches (here consecutive chunks of the
# prompt, which each stage's KV cache needs in order) and streams them: at time step t stage r runs micro-batch t − r.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 2.6))
for ax, m in zip(axes, (1, 4)):
    grid = gpipe_schedule(4, m)
    for t, row in enumerate(grid):
        for r, mb in enumerate(row):
            ax.add_patch(plt.Rectangle((t, 3 - r), 0.95, 0.9, color=f"C{mb}" if mb is not None else "0.9"))
            if mb is not None:
                ax.text(t + 0.45, 3 - r + 0.4, str(mb), ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(grid))
    ax.set_ylim(0, 4)
    ax.set_yticks([0.45, 1.45, 2.45, 3.45], ["stage 3", "stage 2", "stage 1", "stage 0"])
    ax.set_xlabel("time step")
    ax.set_title(f"p = 4 stages, m = {m}: bubble {bubble_fraction(4, m):.0%} = (p-1)/(m+p-1)", fontsize=9)
plt.tight_layout()
plt.show()

# %% [markdown]
# The grey slots are the bubble: p·(p−1) of the p·(m+p−1). More micro-batches shrink it until each is too small to
# keep a device busy. For decoding one sequence a pipeline is a relay: one token's hidden state goes through every
# stage each step, so it makes a model *fit*, not a single sequence faster (with many sequences in flight, each stage
# works on a different one). The benchmark below measures the bubble from when each real stage computed.
#
# ## 6. The benchmark, and the honest limit
#
# `minillm bench parallel` runs one process (1 and 2 threads) and tp = 2, tp = 3, tp = 3 + SP, pp = 2 and pp = 3 on
# the same prompt, one thread per rank. On this 2-core CPU the ranks share the two cores a single process could use
# on its own: a pipeline's stages take turns on one sequence, and tensor-parallel ranks add collectives, so no split
# adds compute to one sequence's step. The line under the table names the best split, its ratio to the best single
# process and its share of time inside collectives. (On a shared machine even the single process's second thread can
# lose to its first: an OpenMP thread that waits for a core held by someone else stalls the whole matmul. Both rows
# are printed.) The full run takes several minutes, so this lesson reads the run recorded in `results/parallel.json`
# (set `RERUN = True` to measure your machine).

# %%
RERUN = False
recorded = Path("../results/parallel.json")
if RERUN or not recorded.exists():
    result = run_entry("parallel", quick=QUICK, save=True, out="../results").to_dict()
else:
    result = json.loads(recorded.read_text())
    print(f"the run recorded in {recorded} ({result['timestamp']}), on: {result['hardware'].get('cpu', '')}, "
          f"one thread per rank, torch {result['versions'].get('torch', '')}")
rows = result["rows"]
print(f"\n{'configuration':<22}{'ranks':>6}{'decode tok/s':>14}{'identical':>11}{'in collectives':>16}"
      f"{'bytes vs formula':>18}")
for r in rows:
    share = f"{r['comm_share']:.0%}" if "comm_share" in r else "-"
    exact = f"{r['bytes_vs_formula']:.3f}" if "bytes_vs_formula" in r else "-"
    print(f"{r['config']:<22}{r['ranks']:>6}{r['decode_tok_s']:>14.1f}{str(r['identical']):>11}{share:>16}{exact:>18}")
ra = result["ratios"]
print(f"\nThe best parallel configuration decoded at {ra['best_parallel_vs_best_one_process']:.2f}x the tok/s of "
      f"the best single-process run (1 or 2 threads); every configuration produced the single process's tokens: "
      f"{bool(ra['tokens_identical'])}; collective bytes equal the formula: "
      f"{bool(ra['collective_bytes_equal_formula'])}.")
best = max((r for r in rows if r["ranks"] > 1), key=lambda r: r["decode_tok_s"])
single = max((r for r in rows if r["ranks"] == 1), key=lambda r: r["decode_tok_s"])
edge = best["decode_tok_s"] / single["decode_tok_s"]
print(f"best split: {best['config']} at {edge:.2f}x {single['config']}, with {best['comm_share']:.0%} of its time "
      f"inside collectives (waiting for the other ranks)"
      + (f"; its ranks computed for {1 - best['comm_share']:.0%} of the step each, in turns, so this {edge - 1:.0%} "
         f"edge comes from one recorded run with no spread: rerun (RERUN = True) before reading it as a win"
         if edge > 1 else ""))

# %%
bubbles = result["series"]["bubbles"]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
for p_ in sorted({b["stages"] for b in bubbles}):
    bs = [b for b in bubbles if b["stages"] == p_]
    line, = a1.plot([b["micro_batches"] for b in bs], [b["measured_bubble"] for b in bs], "o-",
                    label=f"p={p_} measured")
    a1.plot([b["micro_batches"] for b in bs], [b["formula_bubble"] for b in bs], ":", color=line.get_color(),
            label=f"p={p_} (p-1)/(m+p-1)")
a1.set_xlabel("micro-batches m")
a1.set_ylabel("idle fraction")
a1.set_xscale("log", base=2)
a1.legend(fontsize=8)
show = max((b for b in bubbles), key=lambda b: (b["stages"], b["micro_batches"]))
t0 = min(e[1] for ev in show["events"] for e in ev)
for r, ev in enumerate(show["events"]):
    for mb, s, e in ev:
        a2.barh(r, e - s, left=s - t0, color=f"C{mb}")
a2.set_yticks(range(len(show["events"])), [f"stage {r}" for r in range(len(show["events"]))])
a2.invert_yaxis()
a2.set_xlabel("seconds")
a2.set_title(f"measured schedule, p={show['stages']}, m={show['micro_batches']}", fontsize=9)
plt.tight_layout()
plt.show()
for b in bubbles:
    print(f"p={b['stages']} m={b['micro_batches']}: measured bubble {b['measured_bubble']:.2f}, formula "
          f"{b['formula_bubble']:.2f}")

# %% [markdown]
# ### What it would be on a GPU node (an analytic model, not a measurement)
#
# The same byte formulas, applied to Llama-2-7B and -70B at tp = 8 with bf16 weights and a 4,096-token KV cache per
# sequence: memory per device, the all-reduce traffic of one decode step, and its time over NVLink and over PCIe
# (rough public figures: per-GPU bandwidth plus a fixed latency per all-reduce, 2 per block) next to the time to read
# the device's share of weights and KV from HBM (3.35 TB/s), what a decode step costs when nothing else limits it.

# %%
print(f"{'model':<12}{'batch':>6}  {'link':<20}{'weights GB/dev':>15}{'KV GB/dev':>11}{'all-reduce MB':>15}"
      f"{'comm ms':>9}{'HBM ms':>8}")
for a in result["series"]["analytic"]:
    print(f"{a['model']:<12}{a['batch']:>6}  {a['link']:<20}{a['weights_GB_per_device']:>15.1f}"
          f"{a['kv_GB_per_device']:>11.2f}{a['allreduce_MB_per_step']:>15.2f}{a['comm_ms_per_step']:>9.3f}"
          f"{a['hbm_read_ms_per_step']:>8.2f}")

# %% [markdown]
# Read it per row: where the communication time is small next to the HBM time, tensor parallelism divides the step
# time by about p; where it is comparable or larger, the links, not the GPUs, set the pace — which is why tensor
# parallelism stays inside an NVLink domain and pipelines (a few KB per token per stage boundary) cross PCIe and
# the network. 70B's weights do not fit one 80 GB device at all: splitting is not an optimisation there, it is the
# only way to run it.
#
# **Fail fast.** Every process group here has a timeout, and `launch` watches the ranks: when one raises or is
# killed, the others are stopped and the error names the rank (tests/test_parallel.py kills a rank and times it).
#
# **Exercise 11** (`exercises/ex11_parallel.py`, graded by `minillm grade 11`, hints one level at a time with
# `minillm hint 11`): shard a linear column- and row-wise; then write the communication of a tensor-parallel forward
# yourself: the all-reduce that makes a row-parallel layer's partial sums whole (`RowParallelLinear.forward`), the
# vocabulary-parallel embedding (a masked lookup of the rank's slice, then an all-reduce) and the LM head (an
# all-gather of the ranks' logit blocks). They are graded on ranks simulated by threads with a counting `Comm`: every
# rank's output equals the single-process layer, and a forgotten or a doubled all-reduce fails. Then the GPipe
# schedule. The last task shards SmolLM2 with your slices and collectives, on 3 thread ranks and then on 3 real gloo
# processes: the single-process logits and greedy tokens, Paris included. Next, lesson 12: serving.
