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
# # Lesson 04 — Contiguous → paged KV cache
#
# Lesson 01's KV cache gives every sequence one contiguous buffer of `max_len` token slots, reserved before the
# first token is generated. A server does not know how long an answer will be, so `max_len` is the worst case (here
# 2048). Two kinds of waste follow:
#
# * **over-reservation** (internal fragmentation): a sequence that ends at 300 tokens still holds 2048 slots;
# * **external fragmentation**: if reservations of different sizes are carved out of one arena, the free space
#   ends up in holes between live reservations, and a new request can fail although enough memory is free in total.
#
# In the vLLM paper (Kwon et al., 2023) existing systems used only 20–40% of their KV memory for actual tokens.
# KV memory is what bounds the batch size, and batch size is what makes decode efficient (lesson 05), so this
# waste is throughput thrown away.
#
# **Paged attention** borrows virtual memory's answer. The pool is cut into fixed-size **blocks** of `block_size`
# token slots (16 here). A sequence owns a **block table**, the list of its block ids in order; token position `p`
# lives in block `table[p // block_size]` at offset `p % block_size`. A sequence takes a new block only when its
# last one is full, so it wastes fewer than `block_size` slots, and any free block fits any sequence: no external
# fragmentation. The price is an indirection: attention reads keys *through the table*.
#
# This lesson: (1) the waste, on a realistic workload; (2) blocks, tables and the allocator; (3) slot mapping;
# (4) paged attention in torch and in Triton; (5) memory and concurrency numbers; (6) the block-size trade-off;
# (7) identical text on the real model, and what the indirection costs on this CPU.

# %%
import inspect
import json
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minillm
from minillm.bench import paged as bench
from minillm.cache.block_allocator import BlockAllocator, OutOfBlocksError, blocks_needed
from minillm.config import SMOLLM2_135M, ModelConfig
from minillm.kv_cache import kv_bytes_per_token
from minillm.course.lesson import hardware_line, pick
from minillm.model import Transformer
from minillm.cache.paged import PagedKVCache, PagedSequenceCache
from minillm.cache.paged_attention import AttentionMetadata, paged_attention

torch.manual_seed(0)
print(hardware_line())
cfg = SMOLLM2_135M
per_token = kv_bytes_per_token(cfg, torch.bfloat16)
print(f"SmolLM2-135M KV cache: 2 x {cfg.n_layers} layers x {cfg.n_kv_heads} KV heads x {cfg.head_dim} dims x 2 bytes "
      f"= {per_token / 1024:.1f} KiB per token (bfloat16); a 2048-token reservation = "
      f"{2048 * per_token / 2**20:.0f} MiB")

# %% [markdown]
# ## 1. The waste, on a workload
#
# A seeded workload with long-tailed prompt and answer lengths (log-normal; most requests are short, a few are
# long), capped at 2048 tokens in total, like chat and summarisation traffic:

# %%
n_seqs = pick(1000, 200)
workload = bench.sample_workload(n_seqs)
lengths = [p + o for p, o in workload]
print(f"{n_seqs} sequences: mean {statistics.mean(lengths):.0f} tokens, median {statistics.median(lengths):.0f}, "
      f"90th percentile {sorted(lengths)[int(0.9 * n_seqs)]}, max {max(lengths)}")
fig, ax = plt.subplots(figsize=(6.4, 3.2))
ax.hist(lengths, bins=50)
ax.axvline(2048, color="red", linestyle="--", label="contiguous reservation (max_len 2048)")
ax.set_xlabel("tokens per sequence (prompt + output)")
ax.set_ylabel("sequences")
ax.legend()
plt.show()

# %% [markdown]
# Memory reserved vs used for the whole workload, contiguous (2048 slots each) vs paged (blocks of 16). The paged
# numbers come from the real `BlockAllocator`: each sequence allocates `ceil(len / 16)` blocks.
#
# *Predict before you run the next cell:* the histogram above shows how long the sequences really are. What
# percentage of the reserved memory do you expect each layout to waste? Write both numbers down.

# %%
mem = bench.memory_rows(lengths, cfg)
print(f"{'cache':18s} {'reserved MiB':>13s} {'used MiB':>10s} {'waste':>7s}")
for r in mem:
    print(f"{r['cache']:18s} {r['reserved_MiB']:13.0f} {r['used_MiB']:10.0f} {r['waste_pct']:6.1f}%")
# predicted from the histogram's mean alone: contiguous reserves max_len for each sequence; paged leaves on average
# half of a block minus half a slot, (16 - 1) / 2 slots, empty in each sequence's last block
mean_len = statistics.mean(lengths)
contig, paged = mem
empty_per_seq = (paged["slots_reserved"] - paged["tokens_used"]) / len(lengths)
print(f"contiguous: predicted {1 - mean_len / bench.MAX_LEN:.1%} waste (1 - mean {mean_len:.0f} / {bench.MAX_LEN}), "
      f"measured {contig['waste_pct']:.1f}%, because every sequence reserves {bench.MAX_LEN} slots and fills "
      f"{contig['tokens_used'] / len(lengths):.0f} on average")
print(f"paged: predicted {7.5 / (mean_len + 7.5):.1%} waste (7.5 empty slots per sequence), measured "
      f"{paged['waste_pct']:.1f}%, because the last blocks left {empty_per_seq:.2f} slots empty per sequence")
fig, ax = plt.subplots(figsize=(6.4, 3.2))
names = [r["cache"] for r in mem]
ax.bar(names, [r["reserved_MiB"] for r in mem], label="reserved")
ax.bar(names, [r["used_MiB"] for r in mem], label="holding tokens")
ax.set_ylabel("KV memory (MiB)")
ax.set_title(f"{n_seqs} sequences, SmolLM2-135M, bfloat16")
ax.legend()
plt.show()

# %% [markdown]
# **External fragmentation**, the other half of the problem, in a toy arena of 8192 slots where reservations must be
# contiguous: reserve four requests, free two that are not neighbours, and ask for one more.

# %%
arena = 8192
live = {"A": (0, 2048), "B": (2048, 2048), "C": (4096, 2048), "D": (6144, 2048)}  # name -> (start, size)
for name in ("A", "C"):
    del live[name]
holes, pos = [], 0
for start, size in sorted(live.values()):
    if start > pos:
        holes.append(start - pos)
    pos = start + size
if pos < arena:
    holes.append(arena - pos)
print(f"free slots in total: {sum(holes)}, largest hole: {max(holes)}; a 3000-token reservation fits: "
      f"{max(holes) >= 3000}")
alloc = BlockAllocator(arena // 16, 16)
taken = {name: alloc.allocate(2048 // 16) for name in "ABCD"}
alloc.free(taken["A"])
alloc.free(taken["C"])
print(f"paged: {alloc.num_free()} free blocks, a 3000-token sequence needs {blocks_needed(3000, 16)}: fits "
      f"{alloc.can_allocate(blocks_needed(3000, 16))} (its blocks need not be neighbours)")

# %% [markdown]
# ## 2. Blocks, block tables and the allocator
#
# `BlockAllocator` is pure bookkeeping on Python ints: a free list (a deque) and a reference count per block.
# `allocate` is all-or-nothing and raises `OutOfBlocksError` with what to do; `free` drops one reference and puts a
# block back when nobody holds it; `incref` adds an owner, which is how a forked sequence (parallel sampling, beam
# search) or a shared prompt prefix uses the same blocks without copying them. A double free is an error, never a
# silently corrupted free list (tests/test_block_allocator.py checks these invariants with a hypothesis state
# machine).

# %% [markdown]
# The contract (exercise 04 asks you to implement it):
#
# ```text
# allocate(n):  n > free blocks -> OutOfBlocksError, nothing taken;  else pop n ids from the free list, refcount 1 each
# free(ids):    validate every id first (unknown id, double free -> ValueError, nothing changed);
#               then refcount -= 1 per id; a block whose count reaches 0 goes back on the free list
# incref(ids):  refcount += 1 per (already allocated) block
# ```

# %%
alloc = BlockAllocator(num_blocks=8, block_size=16)
seq_a = alloc.allocate(3)  # a 40-token prompt: ceil(40 / 16) = 3 blocks
alloc.incref(seq_a[:2])  # a fork shares the first two (full) blocks...
seq_b = seq_a[:2] + alloc.allocate(1)  # ...and gets its own last block (copy-on-write of the partial one)
print("seq A table", seq_a, " seq B table", seq_b, " ref counts", [alloc.ref_count(b) for b in range(8)])
alloc.free(seq_a)
print("after A finishes: free", alloc.num_free(), " ref counts", [alloc.ref_count(b) for b in range(8)])
try:
    alloc.allocate(6)
except OutOfBlocksError as e:
    print("OutOfBlocksError:", e)

# %% [markdown]
# `PagedKVCache` owns the tensors: one K pool and one V pool of shape
# `(n_layers, num_blocks, block_size, n_kv_heads, head_dim)`, and the allocator that hands their blocks out. Used
# like lesson 01's cache (its subclass `PagedSequenceCache`, what `minillm.generate(..., cache="paged")` uses), it
# grows each sequence's block table on demand:

# %%
tiny = Transformer(ModelConfig.tiny()).eval()
cache = PagedSequenceCache.for_model(tiny, batch_size=2, max_len=64, block_size=16)
with torch.no_grad():
    tiny(torch.randint(0, 512, (2, 20)), kv_cache=cache)  # prefill 20 tokens: 2 blocks each
    print("after prefill of 20:", cache.block_tables_host, f"({cache.allocator.num_free()} blocks free)")
    for _ in range(13):
        tiny(torch.randint(0, 512, (2, 1)), kv_cache=cache)  # decode: a new block at token 33
    print("after 13 decode steps (33 tokens):", cache.block_tables_host)
print(f"pool {cache.nbytes() / 1024:.0f} KiB reserved, {cache.bytes_used() / 1024:.0f} KiB in allocated blocks")

# %% [markdown]
# ## 3. Slot mapping
#
# The pool of one layer, viewed as `(num_blocks * block_size, n_kv_heads, head_dim)`, is an array of **slots**.
# Each new token's key and value are written to slot `table[p // block_size] * block_size + p % block_size`, one row
# write per token (`slot_mapping`); attention reads a sequence's context back by the same rule, for every cached
# position (`context_slots`): that write path and that read path are exercise 04. The serving engine (lesson 05)
# packs many sequences' new tokens into one forward and describes them with `AttentionMetadata`: here sequence 0
# decodes its 38th token, sequence 1 prefills 5 tokens, sequence 2 continues a chunked prefill (3 cached, 4 new):

# %%
meta = AttentionMetadata.build(block_tables=[[7, 2, 5], [0], [3]], context_lens=[38, 5, 7], query_lens=[1, 5, 4],
                               block_size=16)
print("slot_mapping  ", meta.slot_mapping.tolist())
print("block_tables  ", meta.block_tables.tolist())
print("cu_seqlens_q  ", meta.cu_seqlens_q.tolist(), " context_lens", meta.context_lens.tolist())
print("position 37 of sequence 0 -> block", [7, 2, 5][37 // 16], "offset", 37 % 16, "-> slot", 5 * 16 + 37 % 16)

# %% [markdown]
# ## 4. Paged attention
#
# Decode attention through the tables, in torch: gather every sequence's blocks into a `(seqs, kv_heads, L,
# head_dim)` tensor (`index_select` with the flattened table), mask the positions past each sequence's length —
# in the scores *and* in the values, because the unused tail of a last block may hold anything, and `0 × NaN` is
# NaN — and attend. Query head `h` reads KV head `h // group` (GQA, lesson 02).

# %% [markdown]
# As pseudocode (`paged_attention` is this, in torch):
#
# ```text
# for each sequence s, with L = len(block_table[s]) · block_size:
#     K_s, V_s = pool[block_table[s]] laid end to end        (L, n_kv_heads, head_dim), in position order
#     valid = position < context_lens[s]                       mask the scores AND zero the values past it (0·NaN = NaN)
#     out[s, h] = softmax(q[s, h] · K_s[:, h // group]ᵀ / √d, masked) · V_s[:, h // group]
# ```

# %%
from minillm.attention import sdpa_attention
from minillm.cache.paged_attention import gather_sequence

lens, block_size, n_kv_heads, head_dim = [1, 17, 40], 16, 3, 64
num_blocks = 8
k_pool = torch.full((num_blocks, block_size, n_kv_heads, head_dim), float("nan"))  # NaN in every unowned slot
v_pool = torch.full_like(k_pool, float("nan"))
ids = torch.randperm(num_blocks).tolist()  # blocks scattered through the pool, as after many allocations
tables = torch.full((3, 3), -1, dtype=torch.int32)
for i, n in enumerate(lens):
    mine, ids = ids[: blocks_needed(n, block_size)], ids[blocks_needed(n, block_size):]
    tables[i, : len(mine)] = torch.tensor(mine)
    slots = [mine[p // block_size] * block_size + p % block_size for p in range(n)]
    k_pool.view(-1, n_kv_heads, head_dim)[slots] = torch.randn(n, n_kv_heads, head_dim)
    v_pool.view(-1, n_kv_heads, head_dim)[slots] = torch.randn(n, n_kv_heads, head_dim)
q = torch.randn(3, 9, head_dim)
out = paged_attention(q, k_pool, v_pool, tables, torch.tensor(lens))
print("block tables (shuffled ids, -1 = none):", tables.tolist())
for i, n in enumerate(lens):
    k = gather_sequence(k_pool, tables[i], n).transpose(0, 1)[None]  # (1, kv_heads, n, head_dim), in order
    v = gather_sequence(v_pool, tables[i], n).transpose(0, 1)[None]
    ref = sdpa_attention(q[i][None, :, None], k, v)[0, :, 0]
    print(f"seq {i} (len {n}): max |paged - SDPA over its own keys| = {(out[i] - ref).abs().max().item():.2e}")

# %% [markdown]
# The gather *copies* every cached key and value before attending: for decode attention, which does little arithmetic
# per cached byte, that is several times the memory traffic of attending in place. The Triton kernel
# (`kernels/paged_decode.py`) instead computes addresses from the table inside the kernel — block ids loaded from the
# table are used as offsets — and reads each key once. Its inner loop (one program per sequence, KV head and context
# split, all query heads of the group as rows of one `tl.dot`, online softmax as in lesson 03):

# %%
from minillm_kernels import paged_decode

src = inspect.getsource(paged_decode._paged_decode_split_kernel.fn)
print(src[src.index("    for tile_start"):src.index("    part = ")])
small = paged_decode.triton_paged_decode(q, k_pool, v_pool, tables, torch.tensor(lens), num_splits=2)
print(f"Triton ({'interpreter' if paged_decode.INTERPRET else 'GPU'}) vs torch paged: "
      f"max diff {(small - out).abs().max().item():.2e}")

# %% [markdown]
# ## 5. Memory and concurrency: the numbers
#
# The full benchmark (`minillm bench paged`) measures all of this plus the real model. Here, the two memory claims:
# the share of reserved KV memory that is wasted, and how many of the workload's sequences fit (at their final
# length) in the KV budget of 32 contiguous reservations.

# %%
budget = 32 * bench.MAX_LEN
contiguous_fit, paged_fit = bench.concurrent_under_budget(lengths, budget)
print(f"KV budget {budget * per_token / 2**20:.0f} MiB ({budget} token slots)")
print(f"  contiguous: {contiguous_fit} sequences   paged (block 16): {paged_fit} sequences   "
      f"-> {paged_fit / contiguous_fit:.1f}x more concurrent sequences")
print(f"  waste: contiguous {mem[0]['waste_pct']:.1f}%   paged {mem[1]['waste_pct']:.2f}%")

# %% [markdown]
# ## 6. The block-size trade-off
#
# Smaller blocks waste less (on average about `block_size / 2` slots per sequence), but every sequence needs a
# longer block table, which the kernel reads and the scheduler manages, and each table lookup covers fewer tokens
# (short, scattered memory reads). vLLM's default of 16 sits where the waste is already small (see the table) and
# tables stay short.

# %%
sizes = bench.block_size_rows(lengths)
print(f"{'block':>6s} {'waste %':>8s} {'waste tokens/seq':>17s} {'table entries/seq':>18s}")
for r in sizes:
    print(f"{r['block_size']:6d} {r['waste_pct']:8.2f} {r['mean_waste_tokens_per_seq']:17.1f} "
          f"{r['table_entries_per_seq']:18.1f}")
fig, ax1 = plt.subplots(figsize=(6.4, 3.6))
bs = [r["block_size"] for r in sizes]
ax1.plot(bs, [r["waste_pct"] for r in sizes], marker="o", color="C0", label="waste %")
ax1.set_xscale("log", base=2)
ax1.set_xlabel("block size (tokens)")
ax1.set_ylabel("KV waste (% of reserved)", color="C0")
ax2 = ax1.twinx()
ax2.plot(bs, [r["table_entries_per_seq"] for r in sizes], marker="s", color="C1", label="table entries")
ax2.set_yscale("log")
ax2.set_ylabel("block-table entries per sequence", color="C1")
ax1.set_title("block size: waste vs table size")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 7. The real model: identical text, and the cost of the indirection here
#
# Greedy generation with `cache="paged"` must produce exactly the text of `cache="contiguous"`: paging changes where
# keys live, not what attention computes.

# %%
model, tok = minillm.load_model("smollm2-135m", dtype="float32")
prompt = "Explain in two sentences why the sky is blue."
new_tokens = pick(64, 8)
gen_rows, identical = bench.generation_rows(model, tok, prompt, new_tokens, repeat=pick(2, 1))
for r in gen_rows:
    print(f"{r['cache']:11s} {r['new_tokens']} tokens, decode {r['decode_tok_per_s']:.1f} tok/s: {r['text']!r}")
print("identical tokens:", identical)

# %%
context = pick(2048, 512)
attn_rows = bench.attention_step_rows(cfg, context, repeat=pick(20, 5))
for r in attn_rows:
    print(f"one layer's decode attention at context {r['context']}: {r['attention']:22s} {r['us']:8.1f} us")
print(f"paged gather / contiguous: {attn_rows[1]['us'] / attn_rows[0]['us']:.1f}x the time")
added_ms = (attn_rows[1]["us"] - attn_rows[0]["us"]) * cfg.n_layers / 1e3
step_ms = {r["cache"]: 1e3 / r["decode_tok_per_s"] for r in gen_rows}
print(f"at context {context} the gather adds {added_ms:.2f} ms to a step over {cfg.n_layers} layers, "
      f"{added_ms / step_ms['contiguous']:.0%} of a contiguous decode step of section 7 "
      f"({step_ms['contiguous']:.1f} ms, at a context of the prompt + up to {new_tokens} tokens, "
      f"where paged took {step_ms['paged']:.1f} ms)")
fig, ax = plt.subplots(figsize=(6.4, 3.0))
ax.barh([r["attention"] for r in attn_rows], [r["us"] for r in attn_rows])
ax.set_xlabel(f"microseconds per layer (context {context}, batch 1)")
plt.show()

# %% [markdown]
# **Reading the numbers.** On this CPU the paged path buys nothing for a *single* sequence, and what it costs in
# the attention itself is the ratio printed above: the torch gather copies all of a sequence's cached keys and
# values into a fresh tensor every step and every layer, then attends over the copy, and a CPU has no kernel that
# reads through a block table in place. End to end, a decode step at batch 1 also reads all the model's weights
# (lesson 00), so the attention's extra time is a share of a longer step; the last line above prints that share at
# the long context, and section 7's two decode rates show it at a short one. (Inside `PagedKVCache`, a
# batch whose sequences all have one length gathers once and uses the model's own attention backend; ragged
# batches use `paged_attention`; on CUDA the Triton kernel reads the blocks in place.)
#
# The win of paging is **memory**: the table above shows the same KV budget holding several times more sequences,
# and a bigger batch is what makes decode efficient on a GPU — that is lesson 05 (continuous batching), whose engine
# is built on this cache. On a GPU, `scripts/gpu_check_paged.py` measures the kernel against contiguous decode
# attention; its results, if present:

# %%
gpu = Path("results/gpu_check_paged.json")
if gpu.exists() and "configs" in (report := json.loads(gpu.read_text())):
    print(report.get("device"))
    for c in report["configs"]:
        if "error" not in c:
            print(f"batch {c['batch']:2d} heads {c['n_heads']}/{c['n_kv_heads']} d {c['head_dim']}: contiguous "
                  f"{c['contiguous_sdpa_us']:.0f} us, Triton paged {c['triton_paged_us']:.0f} us "
                  f"({c['triton_vs_contiguous_time']:.2f}x), torch gather {c['torch_gather_us']:.0f} us")
else:
    print("no GPU results yet: run `python scripts/gpu_check_paged.py` on a CUDA machine")

# %% [markdown]
# **Exercise 04** (`exercises/ex04_paged.py`): write the `BlockAllocator`'s allocate / free / incref, then the two
# halves of paging that are new here: `slot_mapping`, the slot each new token's key/value is written to (a whole
# prompt, a chunk that starts in the middle of a block, a decode token), and `context_slots`, the slots a sequence's
# cached tokens are read back from, padded for a batch. `minillm grade 04` grades them, its last task serving SmolLM2
# through `generate(cache="paged")` and the engine with your allocator and slots;
# `minillm hint 04 [task] --level 1|2|3` when you are stuck.
