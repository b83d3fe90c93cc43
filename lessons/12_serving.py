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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.bench import run_entry
from minillm.bench.prefix_cache import shared_prefix_prompts, simulate_hit_rate
from minillm.course.lesson import QUICK, hardware_line, pick
from minillm.cache.prefix_cache import block_hashes
from minillm.bench.workload import corpus_ids

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
for k, v in pc["ratios"].items():
    print(f"{k} = {v:.3f}")
for note in pc["notes"]:
    print("note:", note)

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
for k, v in cp["ratios"].items():
    print(f"{k} = {v:.3f}")
for note in cp["notes"]:
    print("note:", note)

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
# chunk. On a GPU a step of a few hundred tokens costs barely more than a step of one (decode is memory bound), so
# vLLM and SGLang default to budgets in the thousands; on this CPU every token in a step costs time, and the best
# budget is much smaller.

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
#   is saturated, then stays flat while the queue, and TTFT with it, grows without bound;
# - **goodput**: requests/s that met the latency objective (here TTFT and TPOT limits, printed below). It is the
#   number that matters: past saturation, throughput looks fine and goodput collapses.

# %%
sv = recorded("serve")
print(f"{'workload':<14}{'rate':>6}{'req/s':>7}{'tok/s':>7}{'TTFT p50':>9}{'p99':>7}{'TPOT p50':>9}{'p99':>7}"
      f"{'goodput':>8}{'lost':>5}{'5xx':>5}{'hit':>6}")
for r in sv["rows"]:
    if isinstance(r["rate"], str):
        continue
    print(f"{r['workload']:<14}{r['rate']:>6}{r['requests_per_s']:>7.2f}{r['output_tok_per_s']:>7.1f}"
          f"{r['ttft_p50']:>9.2f}{r['ttft_p99']:>7.2f}{r['tpot_p50']:>9.3f}{r['tpot_p99']:>7.3f}"
          f"{r['goodput_req_per_s']:>8.2f}{r['lost']:>5}{r['errors_5xx']:>5}{r['prefix_hit_rate']:>6.2f}")
for r in sv["rows"]:
    if isinstance(r["rate"], str):
        print(f"{r['workload']:<36} {r['output_tok_per_s']:6.2f} tok/s, TPOT {r['tpot_mean'] * 1000:6.1f} ms, "
              f"E2E {r['e2e_mean']:.2f} s")
for k, v in sv["ratios"].items():
    print(f"{k} = {v:.3f}")
for note in sv["notes"]:
    print("note:", note)

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
# away, requests queue, TTFT on the right climbs, and goodput falls below throughput. The rate at that bend is this
# machine's capacity for this workload; everything the course built (a faster step, a smaller cache, more requests per
# step, fewer prefill tokens) moves it to the right. The overhead rows compare the same requests through HTTP and in
# process: what the server layer costs per token.

# %% [markdown]
# **Exercise 12** (`exercises/ex12_prefix_cache.py`, graded by `minillm grade 12`, hints with `minillm hint 12`): the
# chained block hash, the longest-prefix match and the LRU allocator behind the cache (graded on crafted block
# streams: identical prefixes share blocks, one differing token breaks the chain from its block on, a partial block
# is never shared, eviction takes never-named blocks first and then the least recently freed); the last task plugs
# your hash and allocator into the engine serving SmolLM2 and checks hits, evictions and answers. Next, lesson 13:
# splitting prefill and decode across machines.
