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
# # Lesson 13 — Disaggregated prefill/decode, routing across replicas, and a small→large cascade
#
# Lesson 12 served one engine on one machine. A fleet serves many, and three decisions then shape latency and cost:
#
# - **where prefill and decode run.** Prefill processes a whole prompt per forward: about 2 × parameters FLOPs per
#   token, compute bound. Decode processes one token per sequence per step and reads every weight and the whole KV
#   cache to do it: its floor is memory, not arithmetic (section 1 measures both steps against their floors). In one
#   engine they share every step, so a long prompt that arrives stalls every running decode for as long as its
#   prefill takes (chunked prefill, lesson 12, only bounds the stall).
#   DistServe and Splitwise run them on *different* workers, each sized for its phase, and move the request's KV
#   cache from the prefill worker to the decode worker in between: that transfer is the price;
# - **which replica gets a request.** Each replica has its own prefix cache. Spreading requests evenly (round-robin)
#   spreads every shared system prompt over every replica; sending a request where its prefix already is (prefix
#   affinity, SGLang's cache-aware router) computes each prefix once per fleet, as long as the load stays balanced;
# - **which model answers.** A small model that is right often enough can answer first and hand the hard requests to
#   the large one (a cascade). Whether that saves anything depends on how often the small model agrees, and on a
#   confidence signal that knows when it does not.
#
# Sections: (1) the interference, measured step by step; (2) what moving the KV costs: predict, then measure;
# (3) the handoff between two engines; (4) two processes over torch.distributed, and the recorded benchmark;
# (5) routing policies; (6) when a small model is enough; (7) the exercise.

# %%
import itertools
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.bench.chunked_prefill import mixed_workload
from minillm.cache.prefix_cache import block_hashes
from minillm.cluster.router import ReplicaState, make_router
from minillm.course.lesson import hardware_line, pick, recorded
from minillm.engine import LLM
from minillm.measure.breakdown import breakdown_of, step_breakdown
from minillm.measure.hardware import peak_flops
from minillm.measure.metrics import model_flops_per_token
from minillm.measure.workload import corpus_ids, serve
from minillm.sampling import SamplingParams

torch.set_num_threads(1)  # one thread: on a shared 2-core machine a second thread mostly measures the neighbours
print(hardware_line())
model, tok = minillm.load_model(dtype="float32")
cfg = model.config
RESULTS = Path(minillm.__file__).resolve().parent.parent / "results"


# %% [markdown]
# ## 1. The interference: one engine, decodes and a long prompt
#
# Two chat requests decode from t = 0; then long prompts arrive. One engine, one thread, a step budget large enough
# to take a whole prompt in one step (no chunking). Every step is logged: its duration and how many prompt tokens it
# carried. Watch what a decode step costs when it shares the step with a prompt.

# %%
reqs = mixed_workload(tok, n_decode=2, decode_len=pick(48, 16), n_long=2, long_len=pick(768, 160),
                      gap_s=pick(1.5, 0.4), first_s=pick(0.5, 0.2))
stall = []  # per run: a decode's worst inter-token gap over the median decode-only step (3 runs: the spread)
for _ in range(pick(3, 2)):
    llm = LLM.from_model(model, tok, max_num_seqs=8, max_num_batched_tokens=pick(1024, 256))
    outs, wall = serve(llm, reqs)
    decode_only = sorted((s["t_end"] - s["t_start"]) for s in llm.step_log
                         if s["num_prefill_tokens"] <= s["num_decodes"])
    stall.append(max(max(o.metrics["itl"]) for o in outs[:2]) / decode_only[len(decode_only) // 2])
steps = llm.step_log  # the last run's steps, plotted below
t0 = steps[0]["t_start"]
dur = [(s["t_end"] - s["t_start"]) * 1e3 for s in steps]
mixed = [s["num_prefill_tokens"] > s["num_decodes"] for s in steps]
plain = [d for d, m in zip(dur, mixed) if not m]
with_prompt = [d for d, m in zip(dur, mixed) if m]
print(f"{len(steps)} steps in {wall:.1f} s: {len(plain)} decode-only steps, "
      f"median {sorted(plain)[len(plain) // 2]:.0f} ms; {len(with_prompt)} steps carrying a prompt, "
      f"longest {max(with_prompt):.0f} ms")
print("decode inter-token latency of the two chat requests, worst:",
      ", ".join(f"{max(o.metrics['itl']) * 1e3:.0f} ms" for o in outs[:2]))
# where each kind of step spends its time: a long prompt prefilled alone, and one decode step
long_ids = torch.tensor([max(reqs, key=lambda r: len(r.prompt_ids)).prompt_ids])
n_long = long_ids.shape[1]
with torch.inference_mode():
    pre = breakdown_of(lambda: model(long_ids), repeat=pick(3, 2), label=f"prefill of {n_long} tokens",
                       flops=sum(model_flops_per_token(cfg, i + 1) for i in range(n_long)),
                       flops_per_s=peak_flops(model.dtype, "cpu"))
dec = step_breakdown(model, "decode", context=n_long, repeat=pick(5, 2))
for b in (pre, dec):
    print(b.line())
print(f"the prompt's step: {pre.terms['matmul'] / n_long:.2f} ms of matmul per prompt token, "
      f"{pre.shares['matmul']:.0%} of it, at {pre.compute_floor_ms / pre.wall_ms:.0%} of its compute floor; a decode "
      f"step: largest term {dec.largest()} ({dec.shares[dec.largest()]:.0%}), its byte floor "
      f"{dec.byte_floor_ms / dec.wall_ms:.0%} of its wall")

fig, ax = plt.subplots(figsize=(10, 3.2))
ax.bar([(s["t_start"] - t0) for s in steps], dur, width=[(s["t_end"] - s["t_start"]) for s in steps], align="edge",
       color=["tab:red" if m else "tab:blue" for m in mixed])
ax.set_xlabel("time (s)")
ax.set_ylabel("step duration (ms)")
ax.set_title("one engine: blue = decode-only steps, red = steps that also prefill a prompt")
plt.tight_layout()
plt.show()

# %% [markdown]
# Every red bar is a gap in the decodes' output: their next token waits for the whole prompt. The two breakdowns
# above say why the bars differ: the prompt's step is matmul work that grows with its length (ms per prompt token),
# the decode step's largest term and its distance from its byte floor are printed beside it. Two kinds of work with
# different bottlenecks share one queue. Chunked prefill (lesson 12) slices the red bars; disaggregation moves them to
# other hardware.

# %% [markdown]
# ## 2. What moving the KV costs: predict, then measure
#
# After prefill, the decode worker needs the prompt's keys and values: for each token, each layer, each KV head, a
# key and a value of head_dim numbers. Lesson 00 gave the formula. **Predict before you run the next cell:** how many
# bytes per prompt token for SmolLM2-135M in float32 (30 layers, 3 KV heads, head_dim 64)? And for a 1,000-token
# prompt? Write your numbers down.

# %%
bytes_per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
print(f"2 x {cfg.n_layers} layers x {cfg.n_kv_heads} kv heads x {cfg.head_dim} x 4 B = {bytes_per_token:,} B "
      f"per token; a 1,000-token prompt: {bytes_per_token * 1000 / 2**20:.1f} MiB")
print(f"for comparison, the weights: {sum(p.numel() for p in model.parameters()) * 4 / 2**20:.0f} MiB; "
      f"GQA (lesson 02) already divides this KV by {cfg.n_heads // cfg.n_kv_heads} "
      f"(MHA would have {cfg.n_heads} KV heads)")
# measured: prefill one real prompt in a prefill-only engine and weigh the KV it packs for the decode side
one = LLM.from_model(model, tok)
n_prompt = pick(1000, 100)
one.add_prefill(corpus_ids(tok)[:n_prompt], SamplingParams(max_tokens=4))
while one.has_unfinished():
    one.step()
(h,) = one.pop_handoffs()
block = one.block_manager.block_size
n_blocks = -(-h.num_computed_tokens // block)
print(f"predicted {bytes_per_token * n_prompt / 2**20:.2f} MiB for {n_prompt} prompt tokens; measured "
      f"{h.nbytes / 2**20:.2f} MiB in the handoff ({h.nbytes / h.num_computed_tokens:,.0f} B per token), because "
      f"the KV travels in whole blocks of {block} tokens: {n_blocks} blocks hold {n_blocks * block} token slots for "
      f"{h.num_computed_tokens} tokens ({n_blocks * block * bytes_per_token / 2**20:.2f} MiB)")

# %% [markdown]
# That is what crosses the wire per request. Between two GPUs on NVLink (hundreds of GB/s) a few MiB is tens of
# microseconds; over a 25 GB/s network it is a millisecond or two; between two processes on this CPU it goes through
# gloo's TCP loopback. The measured transfer is in section 4.

# %% [markdown]
# ## 3. The handoff between two engines
#
# The engine seam is two calls. `add_prefill` runs a prompt as usual (chunked, prefix-cached), samples the first
# token, and — before the request's blocks are freed — packs its KV into a `KVHandoff`: the blocks gathered in token
# order, the first token, the sampling parameters and generator state, and a checksum. `add_prefilled` on another
# engine allocates *its own* blocks, writes the KV into them, and puts the request straight into its running queue:
# the next step is a decode. Here both engines live in this process, with pools of different sizes so that block ids
# differ.

# %%
prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in
           ["What is the capital of France?", "Name three primary colors.", "Why is the sky blue?"]]
params = SamplingParams(max_tokens=pick(24, 8))
reference = LLM.from_model(model, tok).generate(prompts, params)

prefill_engine = LLM.from_model(model, tok, num_blocks=64)
decode_engine = LLM.from_model(model, tok, num_blocks=200)
decode_engine.block_manager.allocator.allocate(37)  # occupy some blocks: the handoff must land elsewhere
rids = [prefill_engine.add_prefill(p, params) for p in prompts]
while prefill_engine.has_unfinished():
    prefill_engine.step()
handoffs = prefill_engine.pop_handoffs()
for h in handoffs:
    decode_engine.add_prefilled(h)
    seq = decode_engine._seqs[h.request_id]
    print(f"request {h.request_id}: {h.num_computed_tokens} prompt tokens, first token {tok.decode(h.output_ids)!r}, "
          f"{h.nbytes / 2**10:.0f} KiB of KV, checksum {h.checksum[:12]}..., lands in blocks {seq.block_table}")
while decode_engine.has_unfinished():
    decode_engine.step()
for h, ref in zip(handoffs, reference):
    out = decode_engine.pop_output(h.request_id)
    print(f"  {out.text!r}  identical to one engine: {out.token_ids == ref.token_ids}")

# %% [markdown]
# The decode engine never ran these prompts, yet it continues them token for token as the single engine does: keys
# and values are all a decoder needs from the past. What moved is exactly what section 2 predicted (whole blocks: the
# last one may be partly filled). Exercise 13 asks you to write the packing and unpacking.

# %% [markdown]
# ## 4. Two processes, a real transfer, and the benchmark
#
# `DisaggregatedLLM` runs a prefill worker and a decode worker as two processes, each with its own engine and KV pool,
# joined by a torch.distributed process group (gloo on CPU, NCCL on GPU). The coordinator (this process) sends
# requests to the prefill worker; the KV goes prefill → decode with `send`/`recv`; tokens stream back from the decode
# worker. It takes and returns what `LLM` does (text or ids, per-prompt params, `RequestOutput`s; `stream` yields
# `StreamEvent`s). Every wait has a timeout, and a worker that dies fails only the requests it strands, each with an
# error saying why, never a hang: when the prefill worker dies, the requests whose KV already reached the decode
# worker finish their answers (the decode worker reports each handoff as it comes off the wire).

# %%
from minillm.cluster.disagg import DisaggregatedLLM

with DisaggregatedLLM("smollm2-135m", threads=1, timeout_s=300) as dllm:
    t = time.perf_counter()
    outs = dllm.generate(prompts, params)
    stats = dllm.stats()["requests"]
for o, ref, s in zip(outs, reference, stats):
    print(f"{o.text[:40]!r:44} same as one engine: {o.token_ids == ref.token_ids}; {s['transfer_bytes'] / 2**10:.0f} "
          f"KiB moved in {s['transfer_s'] * 1e3:.1f} ms = {s['transfer_share_of_ttft']:.1%} of its TTFT")

# %% [markdown]
# The benchmark (`minillm bench disagg`, part `pd`) serves the interference workload of section 1 three ways on the
# same two cores: one colocated engine with both threads and no chunking, the same engine with a 64-token chunk
# budget, and disaggregated prefill + decode with one thread each. The table is the recorded full run.

# %%
bench = recorded("disagg", quick_run=False)
pd_rows = [r for r in bench["rows"] if r["part"] == "pd"]
print(f"{'mode':<22}{'TTFT p50':>9}{'p99':>7}{'TPOT p50':>10}{'p99':>8}{'ITL p99':>9}{'long TTFT':>10}{'goodput':>8}")
for r in pd_rows:
    print(f"{r['mode']:<22}{r['ttft_p50_s']:>9.2f}{r['ttft_p99_s']:>7.2f}{r['decode_tpot_p50_s']:>10.3f}"
          f"{r['decode_tpot_p99_s']:>8.3f}{r['decode_itl_p99_s']:>9.3f}{r['long_ttft_mean_s']:>10.2f}"
          f"{r['goodput_req_per_s']:>8.2f}")
spread = bench.get("spread", {})
for k in ("tpot_p99_colocated_vs_disagg", "itl_p99_colocated_vs_disagg", "tpot_p99_chunked_vs_disagg",
          "long_ttft_disagg_vs_colocated", "throughput_disagg_vs_colocated"):
    sp = spread.get(k)
    print(f"{k} = {bench['ratios'][k]:.2f}" + (f" (min {sp['min']:.2f} / median {sp['median']:.2f} / max "
                                                 f"{sp['max']:.2f} over {len(sp['runs'])} runs)" if sp else
                                                 " (one recorded run, no spread)"))
stall.sort()
print(f"live, section 1's colocated engine in {len(stall)} runs: a decode's worst inter-token gap is min "
      f"{stall[0]:.1f} / median {stall[len(stall) // 2]:.1f} / max {stall[-1]:.1f}x a decode-only step — the stall "
      f"disaggregation removes from the decode side")
for note in bench["notes"]:
    if note.startswith("[pd]"):
        print("note:", note)

# %%
times = bench["series"]["pd"]["decode_token_times_s"]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
for mode, per_request in times.items():
    gaps = sorted(b - a for tt in per_request for a, b in itertools.pairwise(tt))
    a1.plot([g * 1e3 for g in gaps], [i / len(gaps) for i in range(1, len(gaps) + 1)], label=mode)
a1.set_xscale("log")
a1.set_xlabel("decode inter-token latency (ms, log)")
a1.set_ylabel("fraction of tokens")
a1.set_title("ITL distribution of the decoding requests")
a1.legend()
modes = [r["mode"] for r in pd_rows]
x = range(len(modes))
a2.bar([i - 0.2 for i in x], [r["decode_tpot_p99_s"] for r in pd_rows], width=0.4, label="decode TPOT p99")
a2.bar([i + 0.2 for i in x], [r["long_ttft_mean_s"] for r in pd_rows], width=0.4, label="long-prompt TTFT mean")
a2.set_xticks(list(x), modes, rotation=10)
a2.set_yscale("log")
a2.set_ylabel("seconds (log)")
a2.legend()
fig.suptitle(f"interference workload ({bench['hardware'].get('cpu', hardware_line())})")
plt.tight_layout()
plt.show()

# %% [markdown]
# Read the left plot's right tail: that is where colocated decodes waited behind prompts. In the disaggregated mode a
# decode step never contains a prompt, and chunking bounds what one step carries; the ITL and TPOT ratios above say
# how much each shortened the tail in the recorded run. The right plot shows what each choice charges for it. The
# disaggregated prefill worker has half the cores, and a long prompt's TTFT adds the transfer: the [pd] note above
# gives the transfer's share of that TTFT, section 4 the share measured here. With real hardware the split is a
# sizing decision (DistServe picks the number of prefill and decode GPUs per SLO); here it is one core each.

# %% [markdown]
# ## 5. Routing across replicas
#
# The router sees requests, not caches. It keeps, per replica, the chained block hashes of the prompts it sent there
# (the same hashes as the engine's prefix cache, lesson 12) and guesses. Three policies on a crafted stream: three
# groups of chat requests, each group sharing its own system prompt, arriving interleaved, two replicas. No model
# runs in this cell: only the routers' decisions and what each replica's cache would then hold.

# %%
corpus = corpus_ids(tok)
questions = ["What does it say first?", "Summarise it.", "Name one keyword.", "What is the main idea?"]
groups = [[tok.encode_chat([{"role": "system", "content": tok.decode(corpus[400 * g:400 * g + 160])},
                            {"role": "user", "content": q}]) for q in questions] for g in range(3)]
stream = [(g, groups[g][i]) for i in range(len(questions)) for g in range(3)]  # g0 g1 g2 g0 g1 g2 ...

for policy in ("round_robin", "least_tokens", "prefix_affinity"):
    router = make_router(policy, block_size=16)
    replicas = [ReplicaState(0), ReplicaState(1)]
    cached = [set(), set()]  # what each replica's prefix cache would hold (no eviction here)
    hits = total = 0
    placed = []
    for k, (g, ids) in enumerate(stream):
        r = router.choose(ids, 16, replicas)
        router.on_dispatch(r, ids)
        replicas[r].on_dispatch(str(k), len(ids), 16)
        hs = block_hashes(ids, 16)
        n = next((i for i, h in enumerate(hs) if h not in cached[r]), len(hs))  # leading blocks already cached
        hits, total = hits + n * 16, total + len(ids)
        cached[r].update(hs)
        placed.append(f"g{g}->{r}")
        replicas[r].on_finish(str(k))  # one at a time: each finishes before the next arrives
    per_replica = [sum(p.endswith(f">{i}") for p in placed) for i in range(2)]
    print(f"{policy:<16} hit rate {hits / total:.2f}, requests per replica {per_replica}:  {' '.join(placed)}")

# %% [markdown]
# Round-robin, with three groups on two replicas, sends each group to both replicas in turn, so each replica
# computes every group's prefix once. Prefix affinity keeps each group on the replica that first served it.
# Least-outstanding-tokens, with one request at a time, always sees two idle replicas and picks the same one: the
# best hit rate, and one replica doing all the work. Under load the picture changes: affinity must not pile a
# popular prefix on one replica while the other idles, so it falls back to the least loaded replica when the load
# gap passes a threshold (absolute and relative). The benchmark runs two real replica processes on a Poisson stream:

# %%
rt_rows = [r for r in bench["rows"] if r["part"] == "routing"]
print(f"{'policy':<17}{'TTFT p50':>9}{'p99':>7}{'mean':>7}{'tok/s':>7}{'hit rate':>9}  requests per replica")
for r in rt_rows:
    print(f"{r['policy']:<17}{r['ttft_p50_s']:>9.2f}{r['ttft_p99_s']:>7.2f}{r['ttft_mean_s']:>7.2f}"
          f"{r['output_tok_per_s']:>7.2f}{r['prefix_hit_rate']:>9.2f}  {r['requests_per_replica']}")
for note in bench["notes"]:
    if note.startswith("[routing]"):
        print("note:", note)

fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.4))
names = [r["policy"] for r in rt_rows]
a1.bar(names, [r["prefix_hit_rate"] for r in rt_rows], color="tab:green")
a1.set_ylabel("prefix hit rate")
a2.bar(names, [r["ttft_mean_s"] for r in rt_rows], color="tab:orange")
a2.set_ylabel("mean TTFT (s)")
fig.suptitle("two replicas, shared-prefix chat groups (recorded run)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ### The same question over HTTP: N servers behind a router users already run
#
# Past one machine each engine is its own `minillm serve`, and the router in front is not ours: sglang-router (a
# Rust router on PyPI) keeps, per worker, a radix tree of the *text* it sent there (`--policy cache_aware`), where
# ReplicaPool kept block hashes of token ids. Same idea, one level up: send a prompt where its prefix already is.
# `minillm.cluster.http_router` starts two servers and the router on loopback; `minillm bench http-router` runs the
# same shared-prefix chats through a fresh fleet per policy, and reads each server's prefix-cache counters from its
# `/metrics` (the router cannot see the caches either). The recorded run:

# %%
hr = recorded("http-router", quick_run=False)
for note in hr["notes"]:
    print("note:", note)
if hr["rows"]:
    print(f"load average {hr['load_avg_end']:.1f} on {hr['hardware']['cpu_count']} cores when the run ended: the "
          f"hit rates are the routers' decisions, the times also the neighbours'")
if hr["rows"]:
    print(f"\n{'policy':<13}{'hit rate':>9}{'TTFT p50':>9}{'p99':>7}{'mean':>7}{'server TTFT':>12}  "
          "requests per server")
    for r in hr["rows"]:
        print(f"{r['policy']:<13}{r['prefix_hit_rate']:>9.2f}{r['ttft_p50_s']:>9.2f}{r['ttft_p99_s']:>7.2f}"
              f"{r['ttft_mean_s']:>7.2f}{r['server_ttft_mean_s']:>12.2f}  {r['requests_per_server']}")
    by = {r["policy"]: r for r in hr["rows"]}
    rr, ca = by["round_robin"], by["cache_aware"]
    print(f"\ncache_aware found {ca['prefix_hit_rate']:.0%} of prompt tokens already cached against round-robin's "
          f"{rr['prefix_hit_rate']:.0%}; the client's median TTFT {ca['ttft_p50_s']:.2f} s vs {rr['ttft_p50_s']:.2f} s "
          f"({rr['ttft_p50_s'] / ca['ttft_p50_s']:.2f}x); the same greedy text for "
          f"{ca['same_text_as_first']:.0%} of requests")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
    names = [r["policy"] for r in hr["rows"]]
    a1.bar(names, [r["prefix_hit_rate"] for r in hr["rows"]], color="tab:green")
    a1.set_ylabel("prefix hit rate (servers' /metrics)")
    a2.bar(names, [r["ttft_p50_s"] for r in hr["rows"]], color="tab:orange", label="p50")
    a2.bar(names, [r["ttft_p99_s"] - r["ttft_p50_s"] for r in hr["rows"]], bottom=[r["ttft_p50_s"] for r in hr["rows"]],
           color="tab:red", alpha=0.4, label="p99")
    a2.set_ylabel("client TTFT (s)")
    a2.legend()
    fig.suptitle(f"{hr['settings'].get('servers', 2)} minillm serve processes behind sglang-router (recorded run)")
    plt.tight_layout()
    plt.show()

# %% [markdown]
# The tree a cache-aware router keeps is a *guess* of each server's cache: it never hears of evictions, and a new
# group of prompts that matches no tree goes to the server with the fewest requests in flight — so on an idle fleet
# the groups can pile onto one server (the requests per server above). README ("N servers behind a router") has the
# commands, and `tests/test_http_router.py` (slow set) kills a server mid-run: the router takes it out of rotation
# within about a second and nothing hangs.

# %% [markdown]
# ## 6. When is a small model enough?
#
# A cascade answers with the small model (lesson 09's distilled student) and escalates to SmolLM2 when the student's
# confidence is below a threshold. Confidence signals: the mean token log-prob (as a probability), the least likely
# token's probability, and one minus the mean normalised entropy. Threshold 0 never escalates (always-small);
# threshold 1 always escalates (always-large, the small model is not even run). In between, each escalated request
# pays for both models, so a cascade wins only if the small model is right often *and* the signal knows when. The
# benchmark computes both models' greedy answers once per question and sweeps the threshold.

# %%
cs_rows = [r for r in bench["rows"] if r["part"] == "cascade"]
cols = [c for c in ("model", "signal", "threshold", "agreement", "escalation_rate", "seconds_ratio") if c in cs_rows[0]]
print("  ".join(f"{c:>16}" for c in cols))
for r in cs_rows:
    print("  ".join(f"{r.get(c, ''):>16.3f}" if isinstance(r.get(c), float) else f"{str(r.get(c, ''))[:40]:>16}"
                    for c in cols))
for k in ("always_small_agreement", "small_vs_large_seconds", "cost_ratio_at_95_agreement",
          "perfect_signal_cost_ratio_at_95"):
    print(f"{k} = {bench['ratios'][k]:.3f}")
for note in bench["notes"]:
    if note.startswith("[cascade]"):
        print("note:", note)

fig, ax = plt.subplots(figsize=(6.5, 4))
for signal, curve in bench["series"]["cascade"]["curve"].items():
    ax.plot([p["seconds_ratio"] for p in curve], [p["agreement"] for p in curve], marker=".", label=signal)
ax.axhline(0.95, ls=":", color="gray", label="95% agreement")
ax.axvline(0.70, ls="--", color="gray", label="70% of always-large's cost")
ax.set_xlabel("mean cost per request / always-large's (measured seconds)")
ax.set_ylabel("agreement with the large model")
ax.set_title("cascade: quality vs cost, one point per threshold")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The curve starts at always-small (bottom left: its cost, its agreement) and ends at always-large (top, cost 1). A
# useful cascade has points above and to the left of the dotted lines' corner.
#
# **The cost condition.** Let s be the small model's cost over the large one's, and A its agreement alone. A request
# kept small costs s; an escalated one costs s + 1 (the small answer was paid for, then thrown away). Even a perfect
# signal, escalating exactly the disagreements, must escalate 1 − A of the requests to reach full agreement, or
# 0.95 − A to reach 95%: its cost is s + max(0, 0.95 − A). So a cascade can beat a cost target C at 95% agreement only
# if **A ≥ s + 0.95 − C**: the small model must be both cheap *and* right. The next cell prints the condition with
# this run's s, against the A it measured, and the what-if curve: what each agreement would buy at this s.

# %%
ra = bench["ratios"]
s_cost, a_small = ra["small_vs_large_seconds"], ra["always_small_agreement"]
target_cost = bench["targets"].get("cost_ratio_at_95_agreement", ("<=", 0.8))[1]
need = s_cost + 0.95 - target_cost
print(f"s = {s_cost:.2f} (the student's seconds per answer over SmolLM2's), A = {a_small:.0%} (its greedy answers "
      f"equal the large model's, token for token)")
print(f"predicted: a cascade at 95% agreement can cost <= {target_cost:.0%} of always-large only if A >= {need:.0%}; "
      f"measured A = {a_small:.0%}, so even a perfect signal costs {ra['perfect_signal_cost_ratio_at_95']:.0%}, "
      f"and the best real signal {ra['cost_ratio_at_95_agreement']:.0%} of always-large")
agreements = [i / 20 for i in range(21)]
fig, ax = plt.subplots(figsize=(6.5, 3.5))
ax.plot(agreements, [min(1.0, s_cost + max(0.0, 0.95 - a)) for a in agreements],
        label=f"perfect signal, s = {s_cost:.2f}")
ax.plot(agreements, [min(1.0, 0.3 + max(0.0, 0.95 - a)) for a in agreements], ls="--", label="a 3x cheaper small model")
ax.axhline(target_cost, ls=":", color="gray", label=f"target {target_cost:.0%}")
ax.axvline(a_small, color="tab:red", label=f"this student: A = {a_small:.0%}")
ax.set_xlabel("A: the small model's agreement with the large one")
ax.set_ylabel("cost at 95% agreement / always-large")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 7. A cascade that pays: a specialist, and a router in front of it
#
# The condition above says what would pay: a small model that is right on most of what it takes (high A) and cheap.
# A general student on a CPU budget is neither on open chat. Lesson 09's *specialist* is the same 16-block student
# distilled on one job (plurals and opposites); on that job it agrees with SmolLM2 on held-out words and phrasings.
# So the question changes from "is the small model sure?" to "is this request its job?", and it is asked before
# or early in generation, so an escalated request wastes little:
#
# - **prompt**: a classifier over the prompt (`DomainClassifier`: logistic regression over hashed token uni- and
#   bigrams, fit on the specialist's training prompts against other chat): microseconds, no model runs;
# - **early**: the specialist starts every request, and after its first k tokens the least likely token's
#   probability decides whether it goes on or stops and escalates (it wasted k tokens);
# - **both**: the classifier, then early confidence on what it sends to the specialist.
#
# `minillm bench cascade` answers a workload of held-out in-domain prompts and open chat once with each model (one
# at a time, alternating), and turns the per-request measurements into each policy's agreement and cost on a 50/50
# mix; a live routed run checks the prediction. The recorded run:

# %%
cc = recorded("cascade", quick_run=False)
print(f"{'policy':>66} {'agreement':>9} {'cost':>6} {'small share':>11}")
for r in cc["rows"]:
    print(f"{r['policy'][:66]:>66} {r['agreement']:>9.1%} {r['cost_ratio']:>6.2f} {r['small_share']:>11.0%}")
for note in cc["notes"]:
    print("note:", note)
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
for label, curve in cc["series"]["curve"].items():
    axes[0].plot([c["share"] for c in curve], [c["cost_ratio"] for c in curve], marker=".", label=label)
    axes[1].plot([c["share"] for c in curve], [c["agreement"] for c in curve], marker=".", label=label)
axes[0].axhline(0.8, ls=":", color="gray", label="target 0.8x")
axes[1].axhline(0.95, ls=":", color="gray", label="target 95%")
for ax, what in zip(axes, ("cost / always-large (seconds)", "agreement with always-large")):
    ax.set_xlabel("share of requests that are the specialist's job")
    ax.set_ylabel(what)
    ax.legend(fontsize=7)
fig.suptitle("routing to a specialist: what each share of in-domain traffic buys (recorded run)")
plt.tight_layout()
plt.show()

# %% [markdown]
# The classifier finds the job almost perfectly, so routing *by prompt* sends the specialist every in-domain request —
# and its agreement on them is the specialist's own, well short of 95%. Early confidence buys agreement back by
# escalating the answers the specialist is unsure of, at the price of its first tokens. Why even a perfect router
# saves little here, from the same run's requests:

# %%
per = cc["series"]["per_request"]
large_in = sum(r["large_s"] for r in per if r["in_domain"])
large_all = sum(r["large_s"] for r in per)
small_in = sum(r["small_s"] for r in per if r["in_domain"])
print(f"the in-domain half of the requests holds {large_in / large_all:.0%} of always-large's seconds (short answers: "
      f"'The plural of X is Y.'); the specialist does them in {small_in / large_in:.0%} of the large model's time")
print(f"so a router that sent it every in-domain request and nothing else would cost "
      f"{cc['ratios']['perfect_router_cost_50_50']:.2f}x always-large on this mix (at the specialist's agreement); "
      f"one that sent it only the answers it gets right (the oracle row) "
      f"{next(r['cost_ratio'] for r in cc['rows'] if r['policy'].startswith('oracle')):.2f}x at full agreement")
oracle = cc["series"]["curve"]["oracle"]
reach = next((c["share"] for c in oracle if c["cost_ratio"] <= 0.8), None)
print("the oracle router reaches 0.8x always-large " + (f"once {reach:.0%} of the requests are the specialist's job"
                                                         if reach is not None else "at no share of this workload"))

# %% [markdown]
# The cost condition of section 6 holds here too, in its requests' own terms: a cascade saves at most the share of
# the large model's seconds that its small model's job holds, times what the small model saves on it. Short,
# templated answers are cheap for the large model already; a specialist pays most where its job is a large share of
# the *tokens* (long structured outputs, extraction, summaries of a fixed kind), and where it agrees often enough that
# few requests escalate. The live run checks the arithmetic: its answers are the chosen model's own, and its
# agreement the predicted one; its seconds include what the sweep does not count (the router, a stream's setup).
#
# %% [markdown]
# **Exercise 13** (`exercises/ex13_disagg.py`, graded by `minillm grade 13`, hints with `minillm hint 13`): pack a
# sequence's KV blocks into contiguous tensors and unpack them into another pool's blocks (graded on scattered block
# tables, partial last blocks, an int8 pool with scales; then your functions carry SmolLM2's KV between two engines
# and the decode must continue identically), and the least-outstanding-tokens and prefix-affinity routers (graded on
# crafted request streams: ties, dead replicas, block-aligned matches, the imbalance fallback, the memory bound).
