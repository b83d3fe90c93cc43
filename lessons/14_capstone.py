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
# # Lesson 14 — The capstone: every technique in one engine, what compounds, what interferes, and the edge
#
# Lessons 00-13 each measured one technique against the step before it, alone. A deployment runs them all at once,
# and the question changes: not "does int8 KV help?" but "does int8 KV still help once the weights are 4-bit, the
# batch is full and the drafts are verified in the same step?". Each technique removes one cost:
#
# | rung | lesson | the cost it removes |
# |---|---|---|
# | KV cache | 01 | recomputing the past: O(n²) work per sequence becomes O(n) |
# | paged KV + continuous batching | 04, 05 | a weight read per sequence: B sequences share one read per step |
# | fusion | 06 | per-op overhead: dispatches per decode step |
# | 4-bit weights | 07 | bytes per weight: 4-bit codes (and an 8-bit tied head) in place of 32-bit floats |
# | int8 KV | 07 | bytes per cached token: the KV half of a decode step's reads |
# | prefix caching | 12 | recomputing shared prompt prefixes |
# | chunked prefill | 12 | decodes stalled behind one long prefill |
# | speculative decoding | 10 | one sequential step per token |
#
# Two removed costs multiply only when they are independent. When two techniques attack the same cost, or one needs the
# slack the other removed, their gains *interfere*: speculation makes a step wider, which is nearly free only while the
# step's time is set by something other than its arithmetic, and a full batch has already spent that slack. This lesson
# serves one fixed workload with the rungs switched on one by one (`minillm bench ladder`), draws the waterfall,
# measures three pairs for interference, prices each technique in quality, and ends at the edge: the smallest
# configuration that still serves (`minillm bench edge`, `minillm generate --profile edge`).

# %%

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.measure import roofline
from minillm.measure.breakdown import step_breakdown
from minillm.course.lesson import hardware_line, pick, recorded

torch.set_num_threads(1)  # one thread: on a shared 2-core machine a second thread mostly measures the neighbours
print(hardware_line())


# %% [markdown]
# ## 1. One engine, every seam
#
# Every technique is a keyword of the same two calls. The weight-side ones happen at load, in the one order that
# composes: prune the float weights (2:4, lesson 08), quantize them (lesson 07), fuse (lesson 06). The rest are the
# engine's: the KV pool's dtype, prefix caching, the step's token budget (chunked prefill), the batch size and a
# drafter. `tests/test_compose.py` runs every pair of them, and all at once, on a tiny model: greedy tokens equal to
# the plain engine's on the same weights (and on SmolLM2 in its slow set).

# %%
from minillm.engine import LLM
from minillm.sampling import SamplingParams
from minillm.speculative.decoding import SpeculativeConfig

llm = LLM("smollm2-135m", weights="q4", fuse=True, kv_cache_dtype="int8", enable_prefix_caching=True,
          max_num_batched_tokens=128, max_num_seqs=8, speculative=SpeculativeConfig("ngram", k=3))
questions = ["What is the capital of France?", "Name three primary colors.", "What is 12 plus 30?"]
for q, out in zip(questions, llm.generate(questions, SamplingParams(max_tokens=pick(24, 8)), chat=True)):
    print(f"{q!r} -> {out.text!r}")
print(f"{llm.spec_stats.acceptance_rate:.2f} of the drafted tokens accepted; "
      f"{minillm.model.model_bytes(llm.model) / 2**20:.0f} MiB of weights, "
      f"{llm.cache.nbytes() / 2**20:.0f} MiB KV pool")

# %% [markdown]
# What cannot compose is refused, with the reason, never silently dropped:

# %%
from minillm.api import check_weights, generate

refusals = [
    ("the file's 4-bit bytes, then 2:4 pruning", lambda: check_weights("q4", "2:4")),
    ("torch.compile with an int8 KV cache", lambda: generate(llm.model, llm.tokenizer, "Hi", max_new_tokens=2,
                                                           compile=True, kv_cache_dtype="int8")),
    ("torch.compile with speculation", lambda: generate(llm.model, llm.tokenizer, "Hi", max_new_tokens=2,
                                                      compile=True, speculative=SpeculativeConfig("ngram", k=2))),
]
for what, attempt in refusals:
    try:
        attempt()
        print(f"{what}: accepted?!")
    except ValueError as e:
        print(f"{what}:\n    {e}")
print("tensor parallelism with fused or quantized layers: refused by shard_tensor_parallel (lesson 11)")
del llm

# %% [markdown]
# ## 2. The ladder, one workload
#
# The workload (`minillm.bench.ladder.ladder_workload`, seeded): chats that share one of two system prompts, a few
# long documents to summarize, Poisson arrivals replayed against the clock (time to first token counts from
# arrival), fixed output lengths. Each rung adds one technique to everything below it, and the same requests are
# served again.
#
# **Predict before you run the next cell:** which rung gives the largest step up in throughput on this workload,
# and by what factor? Think about what each removes: rung 0 recomputes every prefix at every token; rung 2 turns B
# sequences' weight reads into one; rung 4 replaces 32-bit weights by 4-bit codes (the tied embedding/LM head
# stays 8-bit: the table's memory column says how many bytes that leaves) and runs every layer of a step in one
# native call (lesson 06's last rung: the per-op cost goes too).

# %%
ladder = recorded("ladder", quick_run=False)  # its quick run: tests/test_bench.py (-m slow)
rows = {str(r["rung"]): r for r in ladder["rows"]}
order = [k for k in ["0", "1", "2", "3", "4", "5", "6", "7", "8"] if k in rows]
print(f"{'rung':<5}{'technique':<34}{'tok/s':>8}{'x rung 0':>10}{'x prev':>8}{'TTFT p50':>10}{'TPOT p50':>10}"
      f"{'memory':>9}{'agree':>7}")
for k in order:
    r = rows[k]
    prev = r.get("gain_vs_prev")
    print(f"{k:<5}{r['technique'][:33]:<34}{r['tok_per_s']:>8.1f}{r.get('gain_vs_rung0') or 1:>10.1f}"
          f"{(prev if prev else float('nan')):>8.2f}{r['ttft_p50_ms']:>8.0f}ms{r['tpot_p50_ms']:>8.0f}ms"
          f"{r['memory_MiB']:>7.0f}Mi{r['agree_fp32']:>7.2f}")
steps = {k: rows[k]["gain_vs_prev"] for k in order[1:] if rows[k].get("gain_vs_prev")}
best = max(steps, key=steps.get)
print(f"\nmeasured: the largest step is rung {best} ({rows[best]['technique']}), x{steps[best]:.2f} over the rung "
      f"below; all on: x{rows[order[-1]]['gain_vs_rung0']:.0f} over rung 0 and "
      f"x{rows[order[-1]]['tok_per_s'] / rows['1']['tok_per_s']:.1f} over the KV-cache loop")
w_before, w_after = rows["3"]["weights_MiB"], rows["4"]["weights_MiB"]
# the same batched decode step as rung 3 (float32, fused) and as rung 4 (q4 in the native step), measured now term
# by term (one thread, the ladder's batch): which terms the 4-bit weights and the native call shrank, which they left
width = round((ladder["series"].get("interference", {}).get("speculation_x_batching", {}).get("rows_per_step") or
               {}).get("batch", ladder["settings"]["max_num_seqs"]))
split = {}
for weights, kw in (("dequantized", {"fuse": True}), ("q4", {"native": True})):
    m, _ = minillm.load_model(weights=weights, **kw)
    split[weights] = step_breakdown(m, "batch", batch=width, context=pick(256, 64), repeat=pick(5, 2))
    del m
f32, q4 = split["dequantized"], split["q4"]
print(f"predicted for rung 4 from its weight bytes alone: at most x{w_before / w_after:.1f} ({w_before:.0f} -> "
      f"{w_after:.0f} MiB of weights per step); measured x{rows['4']['gain_vs_prev']:.2f} in the ladder, because "
      f"a {width}-sequence step measured now goes {f32.wall_ms:.0f} -> {q4.wall_ms:.0f} ms (x"
      f"{f32.wall_ms / q4.wall_ms:.2f}): its matmuls {f32.terms['matmul']:.0f} -> {q4.terms['matmul']:.0f} ms (x"
      f"{f32.terms['matmul'] / q4.terms['matmul']:.2f} where the bytes shrank x{w_before / w_after:.1f}), the other "
      f"terms " + ", ".join(f"{k} {f32.terms[k]:.0f} -> {q4.terms[k]:.0f} ms" for k in f32.terms if k != "matmul"))
for note in ladder["notes"][:2]:
    print("-", note)

# %%
gains = [rows[k].get("gain_vs_rung0") or 1.0 for k in order]
fig, ax = plt.subplots(figsize=(10, 4))
bottom = 1.0
for i, k in enumerate(order):
    top = gains[i]
    colour = "tab:gray" if i == 0 else ("tab:green" if top >= bottom else "tab:red")
    ax.bar(i, abs(top - bottom) if i else top, bottom=min(top, bottom) if i else 0, color=colour)
    ax.text(i, max(top, bottom) * 1.08, f"x{top:.1f}", ha="center", fontsize=8)
    bottom = top
ax.set_yscale("log")
ax.set_xticks(range(len(order)))
ax.set_xticklabels([f"{k}\n{rows[k]['technique'][:14]}" for k in order], fontsize=7)
ax.set_ylabel("throughput, x rung 0 (log)")
ax.set_title("The ladder: cumulative throughput gain, one workload (green: a rung that paid, red: one that cost)")
plt.tight_layout()
plt.show()

# %% [markdown]
# Read the waterfall in the field's terms. The first steps are algorithmic (recompute → cache) and structural (one
# weight read per sequence → one per step): they remove work, so they pay on any hardware. The later ones trade one
# roof for another, and whether they pay depends on which roof binds *after* the rungs below them: a 4-bit weight
# read only helps while the step waits for weight bytes; int8 KV only while the KV share of the bytes is large;
# speculation only while a step has idle arithmetic to verify drafts with.

# %% [markdown]
# ## 3. Interference: gain(A+B) against gain(A) × gain(B)
#
# Three pairs were served on their own, each over rung 2: a ratio of 1 means the two gains multiply, below 1 that
# they compete for the same saving, above 1 that one makes room for the other.

# %%
pairs = ladder["series"].get("interference", {})
if not pairs:
    print("interference pairs are measured in full mode only (each pair serves the workload three more times)")
for name, p in pairs.items():
    print(f"{name}: gain(A) {p['gain_a']:.2f} x gain(B) {p['gain_b']:.2f} = {p['product']:.2f}; gain(A+B) "
          f"{p['gain_ab']:.2f}; ratio {p['interference']:.2f}\n    {p['why']}")

# %% [markdown]
# A roofline model of why speculation and batching can interfere. Verifying k drafts for every sequence turns a step
# of B rows into one of B·(k+1) rows. While the step is memory-bound (it waits for the weights), the extra rows ride
# on the same bytes and cost little; once the rows push the step past the ridge point, every draft is paid in
# arithmetic, and a rejected one is pure loss. The model below (lesson 06's: bytes / bandwidth, FLOPs / FLOP/s and a
# fixed cost per op; this CPU measured, the H100 from its datasheet and labelled as a model) prices a verify step of
# k+1 = 4 tokens against a plain decode step, at growing batch sizes. The cell after it checks the model against
# the steps the ladder really ran: how many rows speculation added, and what such a step costs here, measured.

# %%
cfg = minillm.config.ModelConfig()
cpu = roofline.this_cpu()
for machine in (cpu, roofline.H100_SXM):
    print(f"{machine.name}: {machine.source}")
    for batch in (1, 4, 16, 64):
        plain = roofline.forward_step(cfg, machine, tokens=1, context=512, batch=batch)
        verify = roofline.forward_step(cfg, machine, tokens=4, context=512, batch=batch)
        cost = machine.seconds(verify) / machine.seconds(plain)
        print(f"  batch {batch:>3}: a 4-token verify step costs x{cost:.2f} a 1-token step ({machine.bound(plain)}-"
              f"bound -> {machine.bound(verify)}-bound); with 1.5 tokens accepted per step it pays if x < 1.5: "
              f"{'yes' if cost < 1.5 else 'no'}")

# %%
# the steps the ladder really ran, priced by measurement: the float32 model the pairs were served with, at the
# ladder's thread count, one plain step and one as wide as speculation made it (every row costs the same matmul)
spec = pairs.get("speculation_x_batching", {})
widths = spec.get("rows_per_step") or {"alone": 1.0, "alone + speculation": 1.0 + ladder["settings"]["spec_k"],
                                       "batch": float(ladder["settings"]["max_num_seqs"]),
                                       "batch + speculation": float(ladder["settings"]["max_num_seqs"])
                                       * (1 + ladder["settings"]["spec_k"])}
if not spec.get("rows_per_step"):
    print("(this run recorded no rows per step: pricing the model's case, every sequence verifying k drafts)")
m32, _ = minillm.load_model(dtype="float32")
ctx = pick(256, 64)  # about the ladder's mean context (quick: shorter)
for where in ("alone", "batch"):
    b0, b1 = max(1, round(widths[where])), max(1, round(widths[f"{where} + speculation"]))
    plain = step_breakdown(m32, "batch", batch=b0, context=ctx, repeat=pick(5, 2))
    wide = step_breakdown(m32, "batch", batch=b1, context=ctx, repeat=pick(5, 2))
    cost = wide.wall_ms / plain.wall_ms
    model_cost = cpu.seconds(roofline.forward_step(cfg, cpu, tokens=1, context=ctx, batch=b1)) / cpu.seconds(
        roofline.forward_step(cfg, cpu, tokens=1, context=ctx, batch=b0))
    extra = {k: wide.terms[k] - plain.terms[k] for k in wide.terms}
    grew = max(extra, key=extra.get)
    print(f"{where}: speculation widened the decode step from {widths[where]:.1f} to "
          f"{widths[f'{where} + speculation']:.1f} rows; a {b1}-row step costs x{cost:.2f} a {b0}-row step here "
          f"(the model: x{model_cost:.2f}); {wide.wall_ms - plain.wall_ms:.1f} ms more, most of it {grew} "
          f"(+{extra[grew]:.1f} ms)")
    if spec.get("tokens_per_verify"):
        tpv = spec["tokens_per_verify"][where]
        measured = spec["gain_b"] if where == "alone" else spec["gain_ab"] / spec["gain_a"]
        print(f"  predicted x{tpv / cost:.2f} from {tpv:.2f} tokens per verify over that cost, measured "
              f"x{measured:.2f} in the ladder's pair, because the rest of a served step (scheduling, drafting, "
              f"prefill mixed in) was not priced: measured / predicted = {measured / (tpv / cost):.2f}")
del m32

# %% [markdown]
# ## 4. What each technique costs in quality
#
# In exact arithmetic the KV cache, batching, paging, prefix caching, chunking and greedy speculation change how
# tokens are computed, not which; weight-changing ones (4-bit, 2:4) and the int8 KV cache change the numbers. Real
# arithmetic rounds, so the table checks both: each rung against rung 1's float32 greedy tokens (`agree fp32`), the
# q4 rungs also against the same q4 weights run one at a time (`agree q4 serial`), and the perplexity of its weights.

# %%
print(f"{'rung':<5}{'technique':<34}{'agree fp32':>11}{'agree q4 serial':>16}{'ppl':>8}")
for k in order:
    r = rows[k]
    q4s = r.get("agree_q4_serial")
    print(f"{k:<5}{r['technique'][:33]:<34}{r['agree_fp32']:>11.3f}"
          f"{(q4s if q4s is not None else float('nan')):>16.3f}{(r.get('ppl') or float('nan')):>8.2f}")
fp32_exact = [rows[k]["agree_fp32"] for k in ("1", "2", "3") if k in rows]
q4_exact = [rows[k]["agree_q4_serial"] for k in ("6", "7", "8") if rows.get(k, {}).get("agree_q4_serial") is not None]
print(f"\nexact rungs over float32 weights (1-3): agreement {min(fp32_exact):.3f}..{max(fp32_exact):.3f}"
      + (f"; exact rungs over the q4 weights (6-8) against q4 run one at a time: {min(q4_exact):.3f}.."
         f"{max(q4_exact):.3f}" + (f": with the 4-bit kernel they changed which tokens came out at up to "
                                   f"{1 - min(q4_exact):.0%} of positions (next cells: why)" if min(q4_exact) < 1
                                   else ": the same tokens in this run") if q4_exact else ""))

# %% [markdown]
# One finding the column `agree q4 serial` carries: with the file's 4-bit weights, rungs 4-8 do not reproduce the
# same weights' own one-at-a-time tokens. minillm's CPU kernel rounds each block of 32 activations to int8 before
# its integer dot products (as llama.cpp does), and rounding is a step function: a 1e-7 change upstream can land on
# the other side of a rounding boundary. Batching, chunking and prefix reuse change the order in which attention
# sums, and that is enough. The next cell shows it on the first 20 positions of one prompt, run alone and as the
# start of a 40-token prompt: causally those 20 rows cannot see the rest, so every difference is summation order.
# It also prints the two best first tokens of section 1's France question: a near-tie in float32 that the 4-bit
# weights and int8 activations tip the other way, which is why section 1 answered as it did.

# %%
ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
for weights in ("dequantized", "q4"):
    m, tok = minillm.load_model(weights=weights)
    with torch.inference_mode():
        diff = (m(ids)[0, :20] - m(ids[:, :20])[0]).abs().max().item()
        chat = torch.tensor([tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])])
        top = m(chat)[0, -1].float().topk(2)
    first = ", ".join(f"{tok.decode([int(i)])!r} {v:.4f}" for v, i in zip(top.values.tolist(), top.indices))
    print(f"weights={weights:<12} logits of the same 20 positions, run as 20 or 40 tokens: max |diff| {diff:.2e}; "
          f"first answer token to 'What is the capital of France?': {first}")
    del m

# %% [markdown]
# That is the property vLLM's and SGLang's "batch-invariant" modes buy back at some speed: kernels whose reduction
# order does not depend on the batch. An engine that promises bit-identical answers across load levels needs it; one
# that promises the model's quality does not, as the agreement and perplexity columns show.
#
# ## 5. The edge: the smallest configuration that still serves
#
# Near the data, on weak hardware, the binding constraint is memory, not throughput: one thread, the file's 4-bit
# weights, an int8 KV cache and a pool for one or two contexts. `minillm bench edge` measures it in a fresh process
# (peak RSS is everything the process touched: torch itself, the weights, the pool), beside the default float32
# configuration and llama.cpp on the same GGUF file.
#
# A runtime also loads like one: the kernels read the 4-bit weights in their own interleaved layout, and building it
# from the file's blocks costs time and a transient copy of every layer at each load. So it is done once and
# written beside the download (`minillm/gguf/converted.py`, checked by sha256); every later load maps that file and
# its pages come from the OS's page cache. The "edge, converting" row is the same profile with that cache switched
# off, in the same run: the last note says what it saves.

# %%
edge = recorded("edge", quick_run=False)
for r in edge["rows"]:
    print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
for note in edge.get("notes", []):
    print("-", note)

# %% [markdown]
# What an on-device deployment needs beyond this: weights used where they lie in the file (llama.cpp maps the GGUF
# file, so its weights are page cache the OS can evict and share; minillm converts the file's blocks into its
# kernels' layout once and maps that converted file afterwards, page cache too, with the tokenizer kept beside it);
# no Python or torch runtime (the `torch floor` row above is what importing
# torch alone costs, which an on-device runtime such as llama.cpp, ExecuTorch or MLC does not carry); kernels for
# the device's own integer dot products (NEON `sdot` on phones) that read one copy of the weights (minillm's low-bit
# layers keep only their kernel layout, the tied 8-bit embedding/LM head included: its lookups read rows of that
# layout; the table's kernel_copy column would show a second copy); and a KV pool and RoPE tables sized to the
# context the application needs, which `minillm generate --profile edge` fixes at startup
# (`load_model(max_context=512)`, as llama.cpp's n_ctx: the model's own 8,192-position tables are 4 MiB).
#
# The exercise states such a deployment as a service-level objective: what it must deliver, never how.

# %%
from minillm.course.capstone import edge_slo

slo = edge_slo()
print(f"exercise 14's SLO on this machine: weights + KV pool within {slo.memory_bytes / 2**20:.0f} MiB; "
      f"{slo.min_seqs} sequences of {slo.context_tokens} tokens at once; at least {slo.min_quality:.0%} of the "
      f"float32 engine's greedy answer tokens; throughput at least x{slo.min_speedup} the float32 plain engine's")

# %% [markdown]
# ## Exercise 14
#
# Two tasks: `kv_blocks_for_budget` — how many KV blocks a memory budget holds once the weights are in, for the
# engine's exact pool layout (the edge's first calculation) — and `choose_config`: from candidates measured on the
# machine that serves them (bytes, quality, speed), the configuration that meets a stated SLO (memory, quality,
# concurrency, speed), or a ValueError when none does. It is graded on several SLOs over tables of candidates, then
# by measuring two candidates on SmolLM2, serving your choice and holding it to the edge SLO above against the
# float32 engine in interleaved pairs.
#
# ```
# minillm hint 14          # the tasks and their hints
# minillm grade 14         # grade exercises/ex14_capstone.py
# ```
