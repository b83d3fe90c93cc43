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
# # Lesson 05 — Static → continuous batching
#
# A decode step's floor is **memory**: each step reads every weight once (513 MiB for SmolLM2-135M in float32) to
# produce one token per sequence. Put 16 sequences in the batch and the same weight read produces 16 tokens; the extra
# matmul work is small next to the read until the batch is large. So a server's throughput comes from keeping the batch
# full.
#
# **Static batching** takes requests `max_batch` at a time and runs the batch until its *longest* request is done.
# Output lengths of real traffic are long-tailed: most answers are short, a few are long. A request that finishes early
# leaves an idle slot — a **bubble** — until the whole batch ends, and the requests behind it wait in the queue.
#
# **Continuous (in-flight) batching** (Orca, Yu et al. 2022; vLLM) decides the batch again at *every step*: finished
# sequences leave at once and waiting ones take their slots. It needs three things this course already has or builds
# here: a KV cache where any sequence can grow or leave without moving the others (the paged cache, lesson 04); a
# forward that mixes prefills and decodes of different lengths in one batch (packed tokens, AttentionMetadata); and a
# scheduler that decides who runs. When KV blocks run out, the scheduler **preempts** the most recently admitted
# sequence: it frees its blocks and later **recomputes** it (prompt + tokens so far become one prefill).
#
# This lesson: (1) why batching pays: step time vs batch size; (2) the two policies on a fake model; (3) the engine's
# pieces; (4) both on the real model with latency percentiles, next to transformers' padded `generate`; (5) the
# occupancy timeline; (6) preemption under a small KV budget.

# %%
import inspect
import time

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.measure import roofline
from minillm.bench.batching import hf_padded_generate
from minillm.measure.harness import time_fn
from minillm.engine import LLM
from minillm.engine import scheduler as sched_mod
from minillm.engine.static import StaticBatchEngine, continuous_batching_loop, static_batching_loop
from minillm.course.lesson import hardware_line, pick
from minillm.measure.metrics import summarize
from minillm.measure.workload import make_workload, occupancy_timeline

print(hardware_line())
model, tok = minillm.load_model("smollm2-135m", dtype="float32", device="cpu")

# %% [markdown]
# ## 1. Why batching pays: one decode step at batch 1, 4, 16
#
# One step of `B` sequences, each one new token (no cache needed for the weight-read cost we want to see).
#
# *Predict before you run the next cell:* a decode step reads every weight once whatever the batch. How much longer do
# you expect a step of 16 sequences to take than a step of 1: 16x, 4x, or under 2x? Write your number down.

# %%
rows = []
for batch in pick([1, 4, 16], [1, 4]):
    ids = torch.randint(0, 1000, (batch, 1))
    with torch.inference_mode():
        t = time_fn(lambda ids=ids: model(ids), warmup=1, repeat=pick(5, 2))
    rows.append((batch, t.median * 1e3, batch / t.median))
print(f"{'batch':>5} {'step ms':>8} {'tokens/s':>9}")
for b, ms, tps in rows:
    print(f"{b:5d} {ms:8.1f} {tps:9.1f}")
print(f"batch {rows[-1][0]} makes {rows[-1][2] / rows[0][2]:.1f}x the tokens/s of batch 1 "
      f"for {rows[-1][1] / rows[0][1]:.2f}x the step time")

# the prediction, from a roofline model (minillm/measure/roofline.py): max(weight bytes / bandwidth, FLOPs / FLOP/s)
# plus a fixed cost per op, with this CPU's roofs measured now and an H100's datasheet figures
cpu, ops = roofline.this_cpu(torch.float32), roofline.eager_ops(model)
big = rows[-1][0]


def step_ratio(machine) -> float:
    one, many = (roofline.forward_step(model.config, machine, batch=b, ops=ops) for b in (1, big))
    return machine.seconds(many) / machine.seconds(one)


def knee(machine, launches: bool = True) -> float:
    """The batch at which the step's FLOPs take as long as its weight reads (and, on a GPU, its launches)."""
    one = machine.terms(roofline.forward_step(model.config, machine, ops=ops))
    floor = max(one["memory"], one["ops"]) if machine.overlaps_ops and launches else one["memory"]
    return floor / one["compute"]


h100 = roofline.H100_SXM
measured, predicted = rows[-1][1] / rows[0][1], step_ratio(cpu)
print(f"predicted {predicted:.2f}x the step time for batch {big} (this CPU: reading the weights takes as long as "
      f"the FLOPs of ~{knee(cpu):.0f} sequences), measured {measured:.2f}x, because "
      + ("the model's roofs are best cases: at these shapes torch's matmuls reach only part of the measured FLOP/s, "
         "and a step's other ops (norms, RoPE, attention) also grow with the batch" if measured > predicted else
         "a fixed part of the measured step (per-op dispatch, matmuls below the bandwidth roof) does not grow with "
         "the batch, and the model counts it at its floor"))
print(f"the same model for an H100 (datasheet, bf16): {step_ratio(h100):.2f}x for batch {big}; its FLOPs catch up "
      f"with its weight reads at batch ~{knee(h100, launches=False):,.0f}, and with {ops} eager kernel launches only "
      f"at ~{knee(h100):,.0f} ({cpu.source}; {h100.source})")

# %% [markdown]
# ## 2. The two policies, with the model abstracted away
#
# `static_batching_loop` and `continuous_batching_loop` take `step_fn(active) -> finished flags`. With a fake model
# where request `r` needs exactly `n_r` steps, they count steps and show the occupancy (busy slots per step).

# %% [markdown]
# As pseudocode (exercise 05 asks you to write both):
#
# ```text
# static:      for each batch of max_batch requests, in arrival order:
#                  while any request of the batch is unfinished: step the unfinished ones
# continuous:  before every step, refill free slots from the waiting queue (arrival order); step; drop the finished
# both return the occupancy timeline: busy slots at each step
# ```

# %%
n_req, max_batch = pick(64, 6), pick(16, 3)
workload = make_workload(tok, n_req, prompt_len=pick((16, 128), (8, 24)), output_len=pick((8, 256), (2, 12)),
                         output_dist="lognormal", seed=0)
lengths = [r.max_tokens for r in workload]


def fake_step_fn():
    left = {}

    def step(active):
        for r in active:
            left[r] = left.get(r, lengths[r]) - 1
        return [left[r] == 0 for r in active]
    return step


sim_static = static_batching_loop(list(range(n_req)), max_batch, fake_step_fn())
sim_cont = continuous_batching_loop(list(range(n_req)), max_batch, fake_step_fn())
print(f"output lengths: min {min(lengths)}, median {sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}, "
      f"total {sum(lengths)}")
for name, occ in [("static", sim_static), ("continuous", sim_cont)]:
    print(f"{name:>10}: {len(occ):4d} steps, mean occupancy {sum(occ) / len(occ) / max_batch:.0%}")
print(f"step ratio static/continuous: {len(sim_static) / len(sim_cont):.2f}")

# %% [markdown]
# ## 3. The engine: sequence, block manager, scheduler, model runner
#
# `minillm/engine/` is split by job (after nano-vllm): `Sequence` holds one request's state; `BlockManager` gives
# sequences KV blocks (`can_allocate`, `allocate`, `can_append`, `may_append`, `deallocate`); the scheduler decides
# each step on plain Python data; `ModelRunner` is the only place that builds tensors. Here is one scheduler step:

# %% [markdown]
# The policy of one step, in words (exercise 05 asks you to write `schedule_step`):
#
# ```text
# 1. running sequences, oldest first: give each its next tokens (within the step's token budget);
#    when the pool has no block for one, preempt the youngest running sequence (its blocks are freed, it goes back
#    to the head of the waiting queue) — itself if it is the youngest
# 2. then, only if nothing was preempted this step: admit waiting sequences strictly in arrival order while the
#    budget, max_num_seqs and the free blocks allow; stop at the first one that does not fit (never skip it)
# ```
#
# The engine's `Scheduler` wraps it and its twin `postprocess_step`:

# %%
print(inspect.getsource(sched_mod.Scheduler.schedule))
print(inspect.getsource(sched_mod.Scheduler.postprocess))

# %% [markdown]
# The runner packs every scheduled sequence's new tokens into one row `(1, N_total)`: a prompt chunk of 40 tokens and
# 15 decodes of 1 token are 55 rows, each with its own position; the paged cache's metadata says which slots they write
# and which blocks each sequence reads. Only each sequence's last row goes through the LM head (`logits_at`).

# %% [markdown]
# ## 4. Both schedulers on the real model, and transformers as an outside reference
#
# Same model, same greedy sampler, same runner and paged cache; only the policy differs. All requests arrive at
# t=0 and generate exactly their drawn length (`ignore_eos`).

# %%
prompts, params = [r.prompt_ids for r in workload], [r.params() for r in workload]
slo = {"slo_ttft_s": 5.0, "slo_tpot_s": 0.25}

llm = LLM.from_model(model, tok, max_num_seqs=max_batch, max_num_batched_tokens=512)
llm.generate([prompts[0]], [params[0]])  # warm-up
llm.step_log.clear()
t0 = time.perf_counter()
cont_out = llm.generate(prompts, params)
cont = summarize(cont_out, time.perf_counter() - t0, **slo)

static_engine = StaticBatchEngine(model, tok, max_batch=max_batch)
t0 = time.perf_counter()
static_out = static_engine.generate(prompts, params)
static = summarize(static_out, time.perf_counter() - t0, **slo)

# quick: transformers runs on this model's weights instead of reading the GGUF itself (~15 s)
hf_wall, hf_tokens = hf_padded_generate(workload, max_batch, "float32", model=pick(None, model))
print(hardware_line())
print(f"{n_req} requests, max batch {max_batch}, {cont['output_tokens']} output tokens, float32, greedy")
cols = ["output_tok_per_s", "requests_per_s", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90",
        "tpot_p99", "e2e_p50", "e2e_p90", "e2e_p99", "goodput_req_per_s"]
print(f"{'':>26}" + "".join(f"{c:>18}" for c in cols))
for name, s in [("continuous (LLM)", cont), ("static (same runner)", static)]:
    print(f"{name:>26}" + "".join(f"{s[c]:18.3f}" for c in cols))
print(f"{'transformers generate':>26}{hf_tokens / hf_wall:18.3f}{n_req / hf_wall:18.3f}")
print(f"continuous vs static: {cont['output_tok_per_s'] / static['output_tok_per_s']:.2f}x output tokens/s; "
      f"vs transformers padded batches: {cont['output_tok_per_s'] / (hf_tokens / hf_wall):.2f}x")
same = sum(a.token_ids == b.token_ids for a, b in zip(cont_out, static_out))
print(f"identical greedy tokens, continuous vs static: {same}/{n_req} requests")

# %% [markdown]
# What continuous batching traded for its throughput, in this run's own numbers: its per-token latency (TPOT) beside
# the cost and width of its steps, and goodput — the requests per second that met *both* latency bounds — split by
# which bound each engine's requests missed.

# %%
def weighted_ms(steps, rows):  # mean step time as a decoding row sees it: each step weighted by its decode rows
    return 1e3 * sum((s["t_end"] - s["t_start"]) * rows(s) for s in steps) / max(sum(rows(s) for s in steps), 1)


pure = [[s for s in log if s["num_tokens"] == s["num_seqs"]] for log in (llm.step_log, static_engine.step_log)]
c_ms, s_ms = (weighted_ms(p, lambda s: s["num_seqs"]) for p in pure)
mixed = [s for s in llm.step_log if s["num_prefill_tokens"] and s["num_decodes"]]
mixed_rows = sum(s["num_decodes"] for s in mixed) / max(sum(s["num_decodes"] for s in llm.step_log), 1)
tpot_ratio = cont["tpot_p50"] / static["tpot_p50"]
print(f"TPOT p50: continuous {cont['tpot_p50'] * 1e3:.0f} ms vs static {static['tpot_p50'] * 1e3:.0f} ms "
      f"({tpot_ratio:.2f}x); pure decode steps as a row sees them: {c_ms:.0f} ms vs {s_ms:.0f} ms ({c_ms / s_ms:.2f}x: "
      f"{sum(s['num_seqs'] for s in pure[0]) / len(pure[0]):.1f} vs "
      f"{sum(s['num_seqs'] for s in pure[1]) / len(pure[1]):.1f} rows per step)")
mixed_ms = weighted_ms(mixed, lambda s: s["num_decodes"])
print(f"in continuous batching {mixed_rows:.0%} of decode rows shared a step with newcomers' prefills, and those "
      f"steps took {mixed_ms:.0f} ms (pure decode: {c_ms:.0f} ms); static batching never mixes them")
print(f"predicted continuous TPOT from that mix: {(1 - mixed_rows) * c_ms + mixed_rows * mixed_ms:.0f} ms, "
      f"measured p50 {cont['tpot_p50'] * 1e3:.0f} ms")
for name, out, summary in (("continuous", cont_out, cont), ("static", static_out, static)):
    late = sum(o.metrics["ttft"] > slo["slo_ttft_s"] for o in out)
    slow = sum(o.metrics["tpot"] > slo["slo_tpot_s"] for o in out)
    print(f"{name}: goodput {summary['goodput_req_per_s']:.3f} req/s; of {len(out)} requests {late} missed "
          f"TTFT <= {slo['slo_ttft_s']} s and {slow} missed TPOT <= {slo['slo_tpot_s']} s")

# %% [markdown]
# ## 5. The bubbles: batch occupancy over time
#
# Each point is one step: running sequences / max batch. Static batching's occupancy decays inside every batch as
# its short requests finish, and stays low while the longest one runs alone; continuous batching stays full while
# requests wait, and only the end of the run (no more requests to admit) drains it.

# %%
fig, ax = plt.subplots(figsize=(10, 3.5))
for name, log in [("static", static_engine.step_log), ("continuous", llm.step_log)]:
    t, occ = occupancy_timeline(log)
    ax.step(t, occ, where="post", label=f"{name} (mean {sum(occ) / len(occ):.0%}, {len(occ)} steps)")
ax.set_xlabel("seconds since the first step")
ax.set_ylabel("batch occupancy")
ax.set_ylim(0, 1.05)
ax.set_title(f"Batch occupancy, {n_req} requests, max batch {max_batch} ({hardware_line()[:40]}...)")
ax.legend()
plt.show()

# %% [markdown]
# ## 6. Preemption: a KV budget too small for the whole batch
#
# With only a few blocks, decodes run out of room. The scheduler evicts the most recently admitted sequence
# (frees its blocks, puts it back at the head of the queue) and recomputes it later. Nothing is lost, and greedy
# outputs are the same as with an ample budget.

# %%
few = workload[: pick(8, 3)]
need = max(len(r.prompt_ids) + r.max_tokens for r in few)
# a pool that holds exactly the largest request's peak, in small blocks of 4 tokens
tight = LLM.from_model(model, tok, num_blocks=-(-need // 4), block_size=4, max_num_seqs=max_batch)
tight_out = tight.generate([r.prompt_ids for r in few], [r.params() for r in few])
print(f"{tight.block_manager.num_blocks} blocks of 4 tokens; preemptions: {tight.scheduler.num_preemptions}; "
      f"per request: {[o.metrics['num_preemptions'] for o in tight_out]}")
print("outputs equal the ample-budget run:",
      all(a.token_ids == b.token_ids for a, b in zip(tight_out, cont_out[: len(few)])))
print("free blocks after the run:", tight.num_free_blocks(), "of", tight.block_manager.num_blocks)

# %% [markdown]
# ## What the numbers say
#
# * **Section 1**: a bigger batch costs little extra time per step while the step is dominated by reading the
#   weights (and, on a GPU, by launching its kernels); the roofline model printed there says up to which batch that
#   holds on this CPU and on an H100. Everything below builds on it.
# * **Static batching's loss is the bubbles**, not a slower step: its steps are *cheaper* (fewer live rows), but
#   there are many more of them, at low occupancy, and the requests of later batches wait for every earlier batch
#   (see its TTFT percentiles).
# * **Continuous batching** keeps occupancy high while there is work, so the same weight reads produce more tokens.
#   The price is per-token latency: each step carries more rows, so it costs more, and the printed TPOT and step
#   ratios show how much of that cost each request sees, and which latency bound (TTFT or TPOT) decides each
#   engine's goodput on this machine. Chunked prefill (`max_num_batched_tokens`) bounds the prefill part of it.
# * **On this CPU** the step time grows with the batch sooner than on a GPU (section 1's model: a few cores reach
#   their FLOP/s limit at a small batch), so the measured throughput ratio is below the step-count ratio of
#   section 2. Numbers come from a noisy shared machine: the ratios, measured side by side in one run, are what to
#   read.
# * **transformers' `generate`** pads every batch to its longest prompt and runs every row until the longest output
#   is done (it cannot stop a row without an EOS). It loads the same GGUF file by dequantizing every tensor to
#   float32 at load ("Converting and de-quantizing GGUF tensors" in the cell's log), so it computes on the same
#   float weights as minillm here. It is the outside reference, not a tuned server.
# * **Preemption by recompute** trades compute for memory: the evicted sequence's KV is thrown away and rebuilt by a
#   prefill, which is cheap next to its decode steps. vLLM can also swap blocks to host memory instead.
#
# Exercise 05 (`exercises/ex05_batching.py`, `minillm grade 05`, hints: `minillm hint 05`): write one scheduler step
# and the two loops; the last task serves a seeded workload on SmolLM2 through `minillm.LLM` with your scheduler.
