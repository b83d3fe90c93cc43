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
# # Lesson 12 — Serving: prefix caching, chunked prefill, and an OpenAI-compatible server
#
# Lessons 04-05 built the engine: a paged KV cache and a scheduler that re-plans every step. This lesson puts it
# behind HTTP, the way vLLM and SGLang are used, and measures the two scheduling ideas that matter most once real
# traffic arrives:
#
# - **prefix caching**: real requests repeat themselves (the same system prompt, the same document, the earlier turns
#   of a conversation). Prefill is compute bound, about 2 × parameters FLOPs per prompt token, so recomputing a
#   shared 1,000-token prefix costs every request the same time to first token (TTFT). Keys and values depend only
#   on the tokens before them, so a KV block computed once can serve every request that starts the same way;
# - **chunked prefill** (Sarathi-Serve): a long prompt's prefill is one long step, and every running decode waits
#   for it. Splitting prompts into chunks under a per-step token budget bounds each step, so decodes keep flowing,
#   at the price of more steps.
#
# Sections: (1) how a request travels: HTTP → queue → scheduler → runner → SSE, live with the official `openai`
# client; (2) the hash chain that names a block by its whole prefix; (3) hit rate vs workload and pool size;
# (4) prefix caching measured on the real model; (5) chunked prefill: the budget vs latency trade-off; (6) reading a
# serving benchmark: TTFT, TPOT, throughput and goodput under load.

# %%
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.bench import run_entry
from minillm.measure import roofline
from minillm.measure.breakdown import breakdown_of
from minillm.measure.metrics import weight_bytes
from minillm.sampling import SamplingParams
from minillm.bench.prefix_cache import shared_prefix_prompts, simulate_hit_rate
from minillm.course.lesson import QUICK, hardware_line, pick, spread_line
from minillm.cache.prefix_cache import block_hashes
from minillm.measure.workload import corpus_ids

torch.set_num_threads(1)  # one thread: on a shared 2-core machine a second thread mostly measures the neighbours
print(hardware_line())
model, tok = minillm.load_model(dtype="float32")
RESULTS = Path(minillm.__file__).resolve().parent.parent / "results"


def recorded(name: str) -> dict:
    """The full run in results/<name>.json; quick mode (and a missing file) runs the quick benchmark instead."""
    path = RESULTS / f"{name}.json"
    if QUICK or not path.exists():  # in a worker thread: bench serve runs its own asyncio loop (Jupyter has one)
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(run_entry, name, quick=True, save=False).result().to_dict()
    result = json.loads(path.read_text())
    print(f"the run recorded in results/{name}.json ({result['timestamp']}), on: {result['hardware'].get('cpu', '')}, "
          f"{result['settings'].get('threads', '?')} thread(s); rerun: minillm bench {name}")
    return result


# %% [markdown]
# ## 1. How a request travels
#
# ```
#  client ──HTTP POST /v1/chat/completions──▶ server (FastAPI, asyncio)
#                                              │ validate → 400 with an OpenAI-style error; queue full → 429
#                                              ▼
#                                     LLM.add_request(ids, params, sink)      ← thread-safe, returns at once
#                                              │
#            engine thread: loop { schedule → ModelRunner.run (one packed forward) → postprocess → emit }
#                                              │ each sampled token: StreamEvent → the request's sink
#                                              ▼
#  client ◀──SSE: data: {"choices":[{"delta":{"content":"Par"}}]} ... data: [DONE]
# ```
#
# One background thread owns the engine and steps it while any request is unfinished; every HTTP request only
# submits and then waits on its own queue. A client that hangs up mid-stream aborts its request, and its KV blocks go
# back to the pool at once.
#
# Start the server in this process (a thread; `minillm serve` does the same from a shell) and talk to it with the
# official `openai` client, exactly as an application would. Prefix caching is on, as in `minillm serve`.

# %%
import threading

import openai

from minillm.engine import LLM
from minillm.serving.server import Server, build_app

llm = LLM.from_model(model, tok, max_num_seqs=4, enable_prefix_caching=True)
server = Server(build_app(llm, "smollm2-135m"), port=0, log_level="warning")  # port 0: any free port
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.05)
client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
print("serving at", server.url)


def timed_stream(messages, max_tokens):
    """Stream one chat answer; (text, TTFT, inter-token gaps) measured on the client side."""
    t0, stamps, text = time.perf_counter(), [], ""
    for chunk in client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text += chunk.choices[0].delta.content
    return text, stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])]


text, ttft, gaps = timed_stream([{"role": "user", "content": "What is the capital of France?"}], pick(24, 8))
print(repr(text))
print(f"TTFT {ttft * 1000:.0f} ms, mean inter-token latency {1000 * sum(gaps) / max(1, len(gaps)):.0f} ms over "
      f"{len(gaps)} gaps")

# %% [markdown]
# Now two requests that share a long system prompt, one after the other. The second one's system turn is already in
# the cache: only its own question (and the last token) is prefilled.

# %%
system = {"role": "system", "content": "You answer questions about Python using this reference text.\n\n"
                                       + tok.decode(corpus_ids(tok)[:pick(800, 200)])}
for question in ("What is a decorator?", "What is a generator?"):
    _, ttft, _ = timed_stream([system, {"role": "user", "content": question}], 4)
    stats = llm.prefix_cache_stats
    print(f"{question:<24} TTFT {ttft * 1000:6.0f} ms   cache so far: {stats.hit_tokens} of {stats.query_tokens} "
          f"prompt tokens served from cache")
server.should_exit = True  # drains: requests in flight finish (or are aborted after a timeout), then it stops

# %% [markdown]
# ## 2. Naming a block by its whole prefix
#
# A full block of 16 tokens is named `hash(parent's name, its 16 tokens)`, starting from a fixed root. The chain makes
# a name stand for *every* token before it, so equal names mean equal prefixes and equal keys and values. Two chat
# prompts that share a system prompt:

# %%
prompts, n_shared = shared_prefix_prompts(tok, 2, pick(300, 120))
a, b = (block_hashes(p, 16) for p in prompts)
first_diff = next(i for i, t in enumerate(zip(*prompts)) if t[0] != t[1])
print(f"prompt lengths {len(prompts[0])} and {len(prompts[1])} tokens; they share a {n_shared}-token system turn "
      f"and differ first at token {first_diff} (block {first_diff // 16})")
for i, (x, y) in enumerate(zip(a, b)):
    print(f"block {i:>2}: {x.hex()[:12]} {y.hex()[:12]} {'same' if x == y else 'DIFFERENT'}")
print(f"full blocks: {len(a)} and {len(b)}; the partial last block of each prompt has no name yet")

# %% [markdown]
# From the first differing token on, every name differs, even where later tokens happen to agree: the block's keys
# were computed with attention over a different prefix, so they are different keys. That is also why the names are
# SHA-256 and not Python's `hash()`: with a hash that is easy to collide, a crafted prompt could be handed another
# user's cached keys and values (vLLM fixed exactly this, CVE-2025-25183).
#
# The engine side is small (`minillm/cache/prefix_cache.py`): `PrefixCachingAllocator` keeps each block in one of three
# states — free and unnamed, owned by running sequences, or unowned but named (still holding its KV, in LRU order);
# `BlockManager.allocate` asks `match(names)` for the longest cached prefix, shares those blocks by reference
# count, and sets the sequence's `num_cached_tokens` past them, so the unchanged scheduler of lesson 05 simply
# schedules the rest. The last prompt token is always computed: its logits sample the first output token.

# %% [markdown]
# ## 3. Hit rate: workload and pool size decide it
#
# The cache's bookkeeping needs no model: admit each prompt in turn, mark it computed, free it, and count the
# prompt tokens that came from the cache (`simulate_hit_rate`). Three workloads of the same size: chats sharing a
# system prompt, multi-turn conversations (each turn resends the whole history), and unrelated documents. The pool
# size is in blocks of 16 tokens; a small pool evicts (least recently freed first) before the prefix comes back.
#
# *Predict before you run the next cell:* which of the three workloads will have the highest hit rate with a large
# pool, and which will have none at all? Write your ranking down.

# %%
corpus = corpus_ids(tok)
n_req = pick(32, 12)
shared, _ = shared_prefix_prompts(tok, n_req, pick(1000, 300))
turns, conversations = 4, n_req // 4
history = [corpus[c * 2000:c * 2000 + 200] for c in range(conversations)]  # each conversation's first message
multi_turn = []
for t in range(turns):  # conversations take turns: between two turns of one, the others' turns pass through
    for c in range(conversations):  # each turn appends an answer and a new message, and resends everything
        history[c] = history[c] + corpus[20_000 + (c * turns + t) * 150:20_000 + (c * turns + t + 1) * 150]
        multi_turn.append(history[c])
documents = [corpus[i * 900:(i + 1) * 900] for i in range(n_req)]
mixed = [p for pair in zip(shared, documents) for p in pair]  # the system-prompt app shares the pool with documents
workloads = {"shared system prompt": shared, "multi-turn chats": multi_turn,
             "system prompt + documents": mixed, "unrelated documents": documents}
pools = [70, 100, 140, 200, 400, 800, 1600]
hit = {name: [simulate_hit_rate(ps, n) for n in pools] for name, ps in workloads.items()}
print(f"{'workload':<26}" + "".join(f"{n:>7}" for n in pools) + "   (pool size in blocks of 16 tokens)")
for name, rates in hit.items():
    print(f"{name:<26}" + "".join(f"{r:>7.2f}" for r in rates))


def seen_before(prompts: list[list[int]], block: int = 16) -> float:
    """The hit rate a cache that never evicts would reach, from the prompts alone: each prompt's longest prefix shared
    with an earlier prompt, in whole blocks and short of its last token (always recomputed), over all prompt tokens."""
    reused = 0
    for i, p in enumerate(prompts):
        shared_len = max((len(os.path.commonprefix([p, q])) for q in prompts[:i]), default=0)
        reused += min(shared_len, len(p) - 1) // block * block
    return reused / sum(len(p) for p in prompts)


bound = {name: seen_before(ps) for name, ps in workloads.items()}
print("\nranking predicted from the prompts alone:", " > ".join(sorted(bound, key=bound.get, reverse=True)))
for name, rates in hit.items():
    if bound[name] == 0:
        why = "no prompt starts like an earlier one, so there is nothing to reuse"
    elif rates[0] >= bound[name] - 0.005:
        why = f"the shared blocks stay cached even in {pools[0]} blocks"
    else:
        enough = next((n for n, r in zip(pools, rates) if r >= bound[name] - 0.005), None)
        why = (f"below {enough} blocks the pool evicts shared blocks before they come back" if enough else
               "even the largest pool evicts shared blocks before they come back")
    print(f"{name}: predicted {bound[name]:.2f} (prefix seen before), measured {rates[-1]:.2f} at {pools[-1]} "
          f"blocks and {rates[0]:.2f} at {pools[0]}, because {why}")

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
for name, rates in hit.items():
    ax.plot(pools, rates, marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_xlabel("KV pool (blocks of 16 tokens)")
ax.set_ylabel("prompt tokens served from cache")
ax.set_title("Prefix-cache hit rate (bookkeeping only, sequential arrivals)")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# The multi-turn rate is bounded by what is new in each turn; the system-prompt rate by the share of each prompt the
# system turn covers; unrelated documents never hit. The interesting failures are in between: a pool too small to
# keep the shared blocks until the next request arrives. In a running server the pool is also what running requests
# need, so the cache holds only what they leave free.
#
# ## 4. Prefix caching on the real model
#
# `minillm bench prefix-cache`: chat requests sharing a long system prompt, the engine with caching off and on, back
# to back; once one request at a time (TTFT = one prefill, no queue) and once as a burst (everything at t=0, TTFT
# includes the queue of other requests' prefills). Both engines get the same KV pool, large enough that neither
# preempts, so the difference is compute saved.

# %%
pc = recorded("prefix-cache")
for r in pc["rows"]:
    print(f"{r['engine']:<18} {r['pattern']:<18} mean TTFT {r['mean_ttft_s']:7.3f} s   prefill tokens "
          f"{r['prefill_tokens']:>6}   {r['output_tok_per_s']:6.2f} output tok/s")
for k in pc["ratios"]:
    print(spread_line(pc, k))
for note in pc["notes"]:
    print("note:", note)
for pattern in dict.fromkeys(r["pattern"] for r in pc["rows"]):
    off, on = (next(r for r in pc["rows"] if r["pattern"] == pattern and r["engine"].startswith(e))
               for e in ("no", "prefix"))
    print(f"{pattern}: {off['prefill_tokens'] / on['prefill_tokens']:.1f}x fewer prompt tokens prefilled, mean TTFT "
          f"{off['mean_ttft_s'] / on['mean_ttft_s']:.1f}x shorter: TTFT falls less than the prefill work, by "
          f"{on['mean_ttft_s'] - off['mean_ttft_s'] * on['prefill_tokens'] / off['prefill_tokens']:.2f} s per request "
          f"(what a TTFT holds besides prefill tokens: steps' fixed cost, the first token's sampling, the queue)")

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
labels = [f"{r['engine']}\n{r['pattern']}" for r in pc["rows"]]
colors = ["tab:gray" if r["engine"].startswith("no") else "tab:blue" for r in pc["rows"]]
a1.barh(labels, [r["mean_ttft_s"] for r in pc["rows"]], color=colors)
a1.set_xlabel("mean TTFT (s)")
a2.barh(labels, [r["prefill_tokens"] for r in pc["rows"]], color=colors)
a2.set_xlabel("prompt tokens prefilled")
a2.set_yticks([])
plt.tight_layout()
plt.show()

# %% [markdown]
# Read the burst rows with the scheduler in mind: requests admitted in the *first* step all miss, because no block of
# the system prompt has been computed yet (vLLM behaves the same way); once the first chunk is done and named, every
# later admission finds it. The one-at-a-time rows are the per-request saving without any queueing.
#
# ## 5. Chunked prefill: the budget vs latency trade-off
#
# `minillm bench chunked-prefill`: a few requests are decoding when long prompts arrive. Each step, the scheduler
# runs the decodes first and fills the rest of `max_num_batched_tokens` with prefill; the sweep varies that budget.

# %%
cp = recorded("chunked-prefill")
print(f"{'budget':>7}{'chunked':>9}{'ITL p50 s':>11}{'ITL p99 s':>11}{'max step s':>12}{'long TTFT s':>13}"
      f"{'tok/s':>8}")
for r in cp["rows"]:
    print(f"{r['budget']:>7}{str(r['chunked']):>9}{r['decode_itl_p50_s']:>11.3f}{r['decode_itl_p99_s']:>11.3f}"
          f"{r['max_step_s']:>12.3f}{r['long_ttft_mean_s']:>13.2f}{r['output_tok_per_s']:>8.2f}")
for k in cp["ratios"]:
    print(spread_line(cp, k))
for note in cp["notes"]:
    print("note:", note)
tps, nsteps = [r["output_tok_per_s"] for r in cp["rows"]], [r["steps"] for r in cp["rows"]]
ttft = {r["budget"]: r["long_ttft_mean_s"] for r in cp["rows"]}
print(f"what a small budget cost in this run: throughput {min(tps):.1f}..{max(tps):.1f} tok/s across budgets "
      f"({(max(tps) - min(tps)) / max(tps):.0%} apart) in {min(nsteps)}..{max(nsteps)} engine steps; the long "
      f"prompts' mean TTFT {ttft[cp['rows'][0]['budget']]:.2f} s unchunked, {ttft[cp['rows'][-1]['budget']]:.2f} s "
      f"at budget {cp['rows'][-1]['budget']}")

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
s = cp["series"]
ax.plot(s["budget"], s["itl_p99_s"], marker="o", label="decode ITL p99")
ax.plot(s["budget"], s["long_ttft_mean_s"], marker="s", label="long prompts' mean TTFT")
ax.set_xscale("log", base=2)
ax.set_xlabel("max_num_batched_tokens (per-step token budget)")
ax.set_ylabel("seconds")
ax.set_title("Chunked prefill: decode stalls vs long-prompt latency")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# The budget moves latency between two kinds of request: a large one gives the long prompt its first token sooner
# and stalls everyone decoding; a small one keeps decode steps short and makes the long prompt wait for its last
# chunk. vLLM and SGLang default to budgets in the thousands; on this CPU the table's best budget is much smaller.
# The model below says why the two machines differ: which term sets a step's time on each.
#
# **A roofline model** of that difference (`minillm/measure/roofline.py`: a model, not a measurement). A step's time
# is max(weight bytes / bandwidth, FLOPs / FLOP/s) plus a fixed cost per op (on a GPU, kernel launches overlap the
# GPU's work, so the largest of the three terms sets the time). This CPU's three numbers are measured now; the H100's
# are datasheet figures. How much longer is a step of the bench's decodes when it also carries a prompt chunk?

# %%
cpu = roofline.this_cpu(torch.float32)
ops = roofline.eager_ops(model)
decodes, long_len = cp["settings"]["decodes"], cp["settings"]["long_len"]
ctx = 32 + cp["settings"]["decode_len"] // 2  # the decodes' keys at mid-run: a 32-token prompt and half the output
chunks = [c for c in (16, 64, 256, long_len) if c <= long_len]
print(f"{'machine':<34}" + "".join(f"{f'+{c} tok':>11}" for c in chunks) + "   (step time / a step of decodes alone)")
growth = {}
for machine in (cpu, roofline.H100_SXM):
    alone = machine.seconds(roofline.forward_step(model.config, machine, tokens=decodes, context=ctx, ops=ops))
    growth[machine.name] = [machine.seconds(roofline.forward_step(model.config, machine, tokens=decodes + c,
                                                                  context=ctx + c // 2, ops=ops)) / alone
                            for c in chunks]
    print(f"{machine.name[:33]:<34}" + "".join(f"{g:>10.1f}x" for g in growth[machine.name]))
print(f"  ({cpu.source}, {cpu.op_seconds * 1e6:.1f} us per op, {ops} ops per step; H100: {roofline.H100_SXM.source})")
plain = next(r for r in cp["rows"] if not r["chunked"])
measured = plain["max_step_s"] / plain["decode_itl_p50_s"]
model_says = growth[cpu.name][-1]
alone_s = cpu.seconds(roofline.forward_step(model.config, cpu, tokens=decodes, context=ctx, ops=ops))
long_s = alone_s * model_says
# the step the ratio divides by, measured now: the engine's own decode step for the bench's decodes, term by term
engine = LLM.from_model(model, tok, max_num_seqs=16)
for i in range(decodes):
    engine.add_request(corpus[i * 500:i * 500 + 32], SamplingParams(max_tokens=pick(64, 16), ignore_eos=True))
engine.step()  # the prompts' prefill; every later step decodes the four
live = breakdown_of(engine.step, repeat=pick(7, 3), label=f"engine step, {decodes} decodes")
print(f"predicted {model_says:.0f}x for a step that carries a whole {long_len}-token prompt on this CPU, measured "
      f"{measured:.0f}x (the bench's longest unchunked step over its median decode gap), because the step it divides "
      f"by took {plain['decode_itl_p50_s'] * 1e3:.0f} ms in that run, {plain['decode_itl_p50_s'] / alone_s:.1f}x the "
      f"model's {alone_s * 1e3:.0f} ms, while the step with the prompt took {plain['max_step_s']:.2f} s, "
      f"{plain['max_step_s'] / long_s:.1f}x the model's {long_s:.2f} s: the model accounts for "
      f"{alone_s / plain['decode_itl_p50_s']:.0%} of the short step and {long_s / plain['max_step_s']:.0%} of the "
      f"long one")
modelled = cpu.terms(roofline.forward_step(model.config, cpu, tokens=decodes, context=ctx, ops=ops))
print(f"that short step measured now: {live.line()}")
print(f"  its largest term is {live.largest()} ({live.terms[live.largest()]:.0f} ms); the model counts "
      + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in modelled.items())
      + f": the weight matmuls streamed {weight_bytes(model) / live.terms['matmul'] / 1e6:.1f} GB/s, "
        f"{weight_bytes(model) / live.terms['matmul'] * 1e3 / cpu.bandwidth:.0%} of the copy bandwidth the model "
        f"assumes for them")
h100 = roofline.H100_SXM.terms(roofline.forward_step(model.config, roofline.H100_SXM, tokens=decodes + long_len,
                                                       context=ctx + long_len // 2, ops=ops))
print(f"on the H100 model the same step costs {growth[roofline.H100_SXM.name][-1]:.1f}x a decode step: its largest "
      f"term is {max(h100, key=h100.get)} ({', '.join(f'{k} {v * 1e3:.2f} ms' for k, v in h100.items())}), which is "
      f"why GPU engines take budgets in the thousands.")

# %% [markdown]
# ## 6. Reading a serving benchmark
#
# `minillm bench serve` starts its own `minillm serve` and plays a client: requests arrive at random (Poisson) at a
# given rate, each streams its answer, and every chunk is timed where a user would see it. Four numbers tell the
# story, and they pull against each other:
#
# - **TTFT** (time to first token): queueing + the prompt's prefill. What a chat user feels first;
# - **TPOT / ITL** (time per output token, inter-token latency): the decode step time, which grows with the batch
#   and with any prefill that shares the step (section 5);
# - **throughput** (requests/s, output tokens/s): what the operator pays for. It rises with the rate until the engine
#   is saturated, then stays flat while the queue, and TTFT with it, grows as long as requests keep arriving;
# - **goodput**: requests/s that met the latency objective (here TTFT and TPOT limits, printed below). It is the
#   number that matters: past saturation throughput holds at the capacity while goodput falls.
#
# A queue needs two things: requests arriving faster than the engine finishes them, and for long enough. The server
# has 16 slots (`max_num_seqs`), so the bench sends each rate's requests over the same ~24 s: past the capacity
# about (rate - capacity) × 24 requests are left waiting. (Sixteen requests per rate, as an earlier version sent,
# all fit into the slots at once: TPOT rose, nobody waited, and goodput equalled throughput at every rate.) The
# lines under the table say what this run shows.

# %%
sv = recorded("serve")
print(f"{'workload':<14}{'rate':>6}{'sent':>5}{'req/s':>7}{'tok/s':>7}{'TTFT p50':>9}{'p99':>7}{'TPOT p50':>9}"
      f"{'p99':>7}{'goodput':>8}{'SLO met':>8}{'lost':>5}{'5xx':>5}{'hit':>6}")
for r in sv["rows"]:
    if isinstance(r["rate"], str):
        continue
    print(f"{r['workload']:<14}{r['rate']:>6}{r['sent']:>5}{r['requests_per_s']:>7.2f}{r['output_tok_per_s']:>7.1f}"
          f"{r['ttft_p50']:>9.2f}{r['ttft_p99']:>7.2f}{r['tpot_p50']:>9.3f}{r['tpot_p99']:>7.3f}"
          f"{r['goodput_req_per_s']:>8.2f}{r.get('slo_attained', float('nan')):>8.0%}{r['lost']:>5}"
          f"{r['errors_5xx']:>5}{r['prefix_hit_rate']:>6.2f}")
for r in sv["rows"]:
    if isinstance(r["rate"], str):
        print(f"{r['workload']:<36} {r['output_tok_per_s']:6.2f} tok/s, TPOT {r['tpot_mean'] * 1000:6.1f} ms, "
              f"E2E {r['e2e_mean']:.2f} s")
for k in sv["ratios"]:
    print(spread_line(sv, k))
for note in sv["notes"]:
    print("note:", note)
sweep = [r for r in sv["rows"] if r["workload"] == "short-chat" and not isinstance(r["rate"], str)]
capacity = max(r["requests_per_s"] for r in sweep)
over = [r for r in sweep if r["rate"] > 1.1 * capacity]
print(f"\ncapacity: at most {capacity:.2f} short chats/s completed at any rate of this sweep")
for r in sweep:
    ok = r.get("slo_attained", r["goodput_req_per_s"] / max(r["requests_per_s"], 1e-9))
    state = "more than the capacity" if r in over else "within the capacity"
    print(f"  {r['rate']:>4} req/s offered ({state}): {r['requests_per_s']:.2f} completed/s, "
          f"{r['goodput_req_per_s']:.2f} within the SLO ({ok:.0%} of {r['sent']}), TTFT p99 {r['ttft_p99']:.1f} s")
if not over:
    print("no rate of this run passed the capacity: no queue formed, and goodput can only fall with TPOT")
elif all(r["goodput_req_per_s"] >= 0.95 * r["requests_per_s"] for r in over):
    print("past the capacity goodput still kept up with throughput: too few requests arrived there for the wait to "
          "pass the TTFT limit (a burst that fits into the free slots waits for nothing)")
else:
    worst = over[-1]
    print(f"past the capacity, throughput held at {worst['requests_per_s']:.2f} req/s while goodput fell to "
          f"{worst['goodput_req_per_s']:.2f}: the waiting requests' TTFT (p99 {worst['ttft_p99']:.1f} s) is over the "
          f"{sv['settings']['slo_ttft_s']:g} s limit")

# %%
s = sv["series"]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
a1.plot(s["rate"], s["requests_per_s"], marker="o", label="throughput (req/s)")
a1.plot(s["rate"], s["goodput_req_per_s"], marker="s", label="goodput (req/s within SLO)")
a1.plot(s["rate"], s["rate"], ls=":", color="gray", label="offered load")
a1.set_xlabel("request rate (req/s, Poisson)")
a1.legend()
a2.plot(s["rate"], s["ttft_p50"], marker="o", label="TTFT p50")
a2.plot(s["rate"], s["ttft_p99"], marker="o", label="TTFT p99")
a2.plot(s["rate"], s["tpot_p99"], marker="s", label="TPOT p99")
a2.set_yscale("log")
a2.set_xlabel("request rate (req/s, Poisson)")
a2.set_ylabel("seconds")
a2.legend()
fig.suptitle(f"minillm serve, short chats ({hardware_line() if QUICK else sv['hardware'].get('cpu', '')})")
plt.tight_layout()
plt.show()

# %% [markdown]
# Read the left plot from the left: while throughput follows the offered load, the engine keeps up; where it bends
# away (the lines under the table say where, in this run), requests queue, TTFT on the right climbs, and goodput
# parts from throughput. The rate at that bend is this machine's capacity for this workload; everything the course
# built (a faster step, a smaller cache, more requests per step, fewer prefill tokens) moves it to the right. The
# overhead rows compare the same requests through HTTP and in process: what the server layer costs per token.

# %% [markdown]
# **Exercise 12** (`exercises/ex12_prefix_cache.py`, graded by `minillm grade 12`, hints with `minillm hint 12`): the
# chained block hash, the longest-prefix match and the LRU allocator behind the cache (graded on crafted block
# streams: identical prefixes share blocks, one differing token breaks the chain from its block on, a partial block
# is never shared, eviction takes never-named blocks first and then the least recently freed); the last task plugs
# your hash and allocator into the engine serving SmolLM2 and checks hits, evictions and answers. Next, lesson 13:
# splitting prefill and decode across machines.
