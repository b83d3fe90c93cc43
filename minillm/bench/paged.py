"""Benchmark "paged": what a paged KV cache saves, what it costs (lesson 04).

Memory (the real BlockAllocator's bookkeeping, a seeded long-tailed workload): the share of reserved KV memory
a contiguous cache (max_len slots a sequence) wastes against a paged one (ceil(len / block_size) blocks), how
many sequences fit one budget, and the block-size trade-off. Speed (float32, greedy): identical tokens from
cache="contiguous" and "paged", decode tok/s of both, and one layer's decode attention at a long context,
contiguous SDPA vs the torch gather (slower on a CPU: it copies the cache; on a GPU kernels/paged_decode.py
reads the blocks in place, scripts/gpu_check_paged.py times it).
"""

from __future__ import annotations

import statistics

import torch

from minillm.measure.harness import BenchResult, time_fn
from minillm.measure.metrics import decode_tok_s, timed_decode
from minillm.cache.block_allocator import BlockAllocator, OutOfBlocksError, blocks_needed
from minillm.config import SMOLLM2_135M, ModelConfig
from minillm.kv_cache import kv_bytes_per_token

MAX_LEN = 2048
MIB = 2**20


def sample_workload(n: int, max_len: int = MAX_LEN, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs: log-normal (long-tailed) prompts around 256 and outputs around 128 tokens,
    clipped so prompt + output <= max_len, as in chat/summarisation traffic."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.empty(n).log_normal_(mean=5.5, std=1.0, generator=g).clamp(8, max_len - 64).long()
    outputs = torch.empty(n).log_normal_(mean=4.8, std=1.0, generator=g).clamp(1, max_len).long()
    return [(int(p), int(min(o, max_len - p))) for p, o in zip(prompts, outputs)]


def memory_rows(lengths: list[int], cfg: ModelConfig, block_size: int = 16, max_len: int = MAX_LEN,
                dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """KV memory reserved vs used for the contiguous cache (max_len per sequence) and the paged cache."""
    per_token = kv_bytes_per_token(cfg, dtype)
    used = sum(lengths)
    alloc = BlockAllocator(sum(blocks_needed(n, block_size) for n in lengths), block_size)
    tables = [alloc.allocate(blocks_needed(n, block_size)) for n in lengths]
    paged_slots = sum(len(t) for t in tables) * block_size
    rows = []
    for cache, reserved in (("contiguous", len(lengths) * max_len), (f"paged (block {block_size})", paged_slots)):
        rows.append({"cache": cache, "slots_reserved": reserved, "tokens_used": used,
                     "reserved_MiB": reserved * per_token / MIB, "used_MiB": used * per_token / MIB,
                     "waste_pct": 100 * (reserved - used) / reserved})
    return rows


def concurrent_under_budget(lengths: list[int], budget_tokens: int, block_size: int = 16,
                            max_len: int = MAX_LEN) -> tuple[int, int]:
    """How many of the workload's sequences (in order, each at its final length) fit in `budget_tokens` KV slots:
    (contiguous, paged). Paged admission goes through a BlockAllocator until it runs out of blocks."""
    contiguous = min(len(lengths), budget_tokens // max_len)
    alloc = BlockAllocator(budget_tokens // block_size, block_size)
    paged = 0
    for n in lengths:
        try:
            alloc.allocate(blocks_needed(n, block_size))
        except OutOfBlocksError:
            break
        paged += 1
    return contiguous, paged


def block_size_rows(lengths: list[int], block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> list[dict]:
    """Internal fragmentation (waste) against block-table size: small blocks waste little, need long tables."""
    used = sum(lengths)
    rows = []
    for bs in block_sizes:
        entries = [blocks_needed(n, bs) for n in lengths]
        reserved = sum(entries) * bs
        rows.append({"block_size": bs, "waste_pct": 100 * (reserved - used) / reserved,
                     "mean_waste_tokens_per_seq": (reserved - used) / len(lengths),
                     "table_entries_per_seq": statistics.mean(entries), "max_table_entries": max(entries)})
    return rows


@torch.inference_mode()
def attention_step_rows(cfg: ModelConfig, context: int, block_size: int = 16, repeat: int = 20) -> list[dict]:
    """One layer's decode attention at `context` cached tokens, batch 1, one thread: contiguous SDPA vs the paged
    torch gather (median microseconds)."""
    from minillm.attention import sdpa_attention
    from minillm.cache.paged_attention import paged_attention

    g = torch.Generator().manual_seed(0)
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = torch.randn(1, h, 1, d, generator=g)
    k = torch.randn(1, hkv, context, d, generator=g)
    v = torch.randn(1, hkv, context, d, generator=g)
    n_blocks = blocks_needed(context, block_size)
    perm = torch.randperm(n_blocks, generator=g)  # blocks scattered in the pool, as after many allocations
    k_pool = torch.zeros(n_blocks, block_size, hkv, d)
    v_pool = torch.zeros_like(k_pool)
    k_pool.view(-1, hkv, d)[: context] = k[0].transpose(0, 1)  # blocks in order, then shuffle the ids
    v_pool.view(-1, hkv, d)[: context] = v[0].transpose(0, 1)
    k_pool, v_pool = k_pool[perm.argsort()], v_pool[perm.argsort()]
    table, lens = perm[None].int(), torch.tensor([context])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # sub-millisecond ops: with 2 threads on a shared machine, thread wake-ups dominate
    try:
        contiguous = time_fn(lambda: sdpa_attention(q, k, v), warmup=3, repeat=repeat)
        paged = time_fn(lambda: paged_attention(q[:, :, 0], k_pool, v_pool, table, lens), warmup=3, repeat=repeat)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(paged_attention(q[:, :, 0], k_pool, v_pool, table, lens),
                               sdpa_attention(q, k, v)[:, :, 0], atol=1e-5, rtol=1e-4)
    return [{"attention": "contiguous sdpa", "context": context, "us": contiguous.median * 1e6},
            {"attention": "paged gather (torch)", "context": context, "us": paged.median * 1e6}]


def generation_rows(model, tokenizer, prompt: str, new_tokens: int, repeat: int = 2) -> tuple[list[dict], bool]:
    """Greedy generation with both caches: decode tok/s (median of `repeat`) and whether the texts are identical."""
    ids = tokenizer.encode(prompt)
    rows, texts = [], {}
    for cache in ("contiguous", "paged"):
        timed_decode(model, ids, 4, cache)  # warm-up
        tok_s, texts[cache] = decode_tok_s(model, ids, new_tokens, repeat, cache)
        rows.append({"cache": cache, "new_tokens": len(texts[cache]), "decode_tok_per_s": tok_s,
                     "text": tokenizer.decode(texts[cache])[:60]})
    return rows, texts["contiguous"] == texts["paged"]


def run(quick: bool = False) -> BenchResult:
    from minillm.api import load_model

    cfg = SMOLLM2_135M
    n_seqs, budget_seqs, new_tokens, context = (128, 32, 8, 1024) if quick else (1000, 32, 64, 2048)
    workload = sample_workload(n_seqs)
    lengths = [p + o for p, o in workload]
    mem = memory_rows(lengths, cfg)
    contiguous_fit, paged_fit = concurrent_under_budget(lengths, budget_seqs * MAX_LEN)
    sizes = block_size_rows(lengths)
    attn = attention_step_rows(cfg, context, repeat=pick_repeat(quick))
    model, tok = load_model("smollm2-135m", dtype="float32", device="cpu")
    gen, identical = generation_rows(model, tok, "Explain in two sentences why the sky is blue.", new_tokens,
                                     repeat=1 if quick else 2)

    budget_mib = budget_seqs * MAX_LEN * kv_bytes_per_token(cfg, torch.bfloat16) / MIB
    rows = [{"part": "memory", **r} for r in mem]
    rows += [{"part": "budget", "cache": name, "KV_budget_MiB": budget_mib, "concurrent_seqs": n}
             for name, n in (("contiguous", contiguous_fit), ("paged (block 16)", paged_fit))]
    rows += [{"part": "block size", **r} for r in sizes]
    rows += [{"part": "attention step", **r} for r in attn]
    rows += [{"part": "generation", **r} for r in gen]
    ratios = {
        "paged_waste_pct": mem[1]["waste_pct"],
        "contiguous_waste_pct": mem[0]["waste_pct"],
        "concurrent_seqs_paged_vs_contiguous": paged_fit / contiguous_fit,
        "identical_text": float(identical),
        "decode_tok_s_paged_vs_contiguous": gen[1]["decode_tok_per_s"] / gen[0]["decode_tok_per_s"],
        "attention_step_paged_vs_contiguous_time": attn[1]["us"] / attn[0]["us"],
    }
    targets = {"paged_waste_pct": ("<", 4.0), "concurrent_seqs_paged_vs_contiguous": (">=", 2.0),
               "identical_text": (">=", 1.0)}
    mean_len = statistics.mean(lengths)
    notes = [
        (f"workload: {n_seqs} sequences, seeded log-normal prompt/output lengths, mean {mean_len:.0f} tokens, "
         f"median {statistics.median(lengths):.0f}, max {max(lengths)} (cap {MAX_LEN}); KV bytes for SmolLM2-135M "
         f"in bfloat16 ({kv_bytes_per_token(cfg, torch.bfloat16) / 1024:.0f} KiB per token)."),
        ("waste = reserved slots never written / reserved slots. Contiguous reserves 2048 per sequence; paged "
         "wastes only the unfilled tail of each sequence's last block (< block_size tokens)."),
        (f"budget = {budget_seqs} contiguous reservations of {MAX_LEN} tokens; sequences counted at their final "
         "length (no preemption needed)."),
        ("attention step (one thread): the torch gather (paged_attention) copies every cached key and value "
         "into a fresh tensor, masks the values (another copy) and attends over the strided result: several times "
         "the memory traffic of SDPA attending in place. "
         "A CPU has no kernel that reads through a block table in place; the Triton kernel does that on a GPU "
         "(scripts/gpu_check_paged.py)."),
        ("generation: with one sequence PagedKVCache gathers its blocks once per layer and calls the model's "
         "attention backend, so only the copy is extra; decode at batch 1 is dominated by reading the weights, so "
         "the end-to-end ratio stays near 1 at short contexts. Paging pays off in memory (more sequences per "
         "budget, lesson 05), not in single-sequence speed."),
    ]
    return BenchResult(name="paged", rows=rows, ratios=ratios, targets=targets,
                       settings={"device": "cpu", "block_size": 16, "max_len": MAX_LEN, "kv_dtype": "bfloat16",
                                 "model_dtype": "float32", "new_tokens": new_tokens, "attention_context": context},
                       notes=notes)


def pick_repeat(quick: bool) -> int:
    return 5 if quick else 20
