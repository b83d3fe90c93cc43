"""Benchmark "prefix-cache" (lesson 12): the engine with and without prefix caching, one shared system prompt.

SmolLM2-135M, float32, greedy, fixed lengths (ignore_eos). Every request is a chat: one long system prompt
(pydoc text) and a short question of its own. Two patterns, each with caching off and on, back to back in one
process: one at a time (TTFT is the prefill the cache leaves to compute) and a burst at t=0 (TTFT includes the
queue of the other requests' prefills). Both engines get the same KV pool, so neither preempts. Greedy tokens
compared.
"""

from __future__ import annotations

import math

import torch

from minillm.measure.harness import BenchResult
from minillm.measure.metrics import percentiles, timer
from minillm.measure.workload import corpus_ids


def shared_prefix_prompts(tok, n: int, system_tokens: int) -> tuple[list[list[int]], int]:
    """n chat prompts sharing one system prompt of about `system_tokens` tokens; (prompts, system prompt tokens)."""
    from pydoc_data.topics import topics

    system = ("You answer questions about Python using this reference text.\n\n"
              + tok.decode(corpus_ids(tok)[:system_tokens]))
    names = sorted(topics)
    questions = [f"What does the reference say about {names[i % len(names)]}?" for i in range(n)]
    prompts = [tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    n_shared = len(tok.encode_chat([{"role": "system", "content": system}], add_generation_prompt=False))
    return prompts, n_shared


def simulate_hit_rate(prompts: list[list[int]], num_blocks: int, block_size: int = 16) -> float:
    """The cache's bookkeeping alone, no model: admit each prompt in turn (as if computed at once), then free it.
    Returns the fraction of prompt tokens served from the cache. Hashes and LRU decide it, not the tensors."""
    from minillm.engine.block_manager import BlockManager
    from minillm.engine.sequence import Sequence
    from minillm.cache.prefix_cache import PrefixCachingAllocator
    from minillm.sampling import SamplingParams

    manager = BlockManager(PrefixCachingAllocator(num_blocks, block_size), prefix_caching=True)
    for i, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        seq = Sequence(str(i), list(ids), SamplingParams(max_tokens=1))
        if not manager.can_allocate(seq):
            raise ValueError(f"prompt {i} ({len(ids)} tokens) does not fit a pool of {num_blocks} blocks")
        manager.allocate(seq)
        seq.num_cached_tokens = seq.num_tokens  # the prefill ran
        manager.deallocate(seq)  # finished: its full blocks stay cached until evicted
    return manager.allocator.stats.hit_rate


def _mean(xs) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def run(quick: bool = False, dtype: str = "float32") -> BenchResult:
    from minillm.cache.block_allocator import blocks_needed
    from minillm.engine import LLM
    from minillm.api import load_model
    from minillm.sampling import SamplingParams

    # quick: a budget smaller than one prompt, so the burst shows what full mode does (the first request's prefill
    # spans steps; the requests admitted after its first chunk find the cache)
    n_burst, n_seq, system_tokens, max_tokens, max_seqs, budget = ((4, 2, 120, 2, 4, 96) if quick
                                                                    else (32, 8, 1000, 16, 16, 512))
    block_size = 16
    model, tok = load_model("smollm2-135m", dtype=dtype, device="cpu")
    prompts, n_shared = shared_prefix_prompts(tok, n_burst, system_tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    longest = max(map(len, prompts)) + max_tokens
    # one pool for both engines, max_num_seqs full requests: neither preempts, the comparison is compute saved
    num_blocks = max_seqs * blocks_needed(longest, block_size)

    def engine(caching: bool) -> LLM:
        return LLM.from_model(model, tok, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_seqs,
                              max_num_batched_tokens=budget, enable_prefix_caching=caching)

    engine(False).generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up (first-touch of the weights)
    rows, results = [], {}
    for caching in (False, True):
        llm = engine(caching)
        with timer() as t:
            seq_out = [llm.generate([p], params)[0] for p in prompts[:n_seq]]  # one at a time
        seq_wall = t.seconds
        seq_prefill = sum(s["num_prefill_tokens"] for s in llm.step_log)
        llm = engine(caching)  # a cold cache again: the burst starts from nothing
        with timer() as t:
            burst_out = llm.generate(prompts, params)
        burst_wall = t.seconds
        burst_prefill = sum(s["num_prefill_tokens"] for s in llm.step_log)
        stats = llm.prefix_cache_stats
        results[caching] = (seq_out, burst_out)
        label = "prefix caching" if caching else "no prefix caching"
        rows.append({"engine": label, "pattern": f"one at a time ({n_seq})",
                     "mean_ttft_s": _mean([o.metrics["ttft"] for o in seq_out]),
                     "prefill_tokens": seq_prefill, "wall_s": seq_wall,
                     "output_tok_per_s": n_seq * max_tokens / seq_wall})
        rows.append({"engine": label, "pattern": f"burst ({n_burst} at t=0)",
                     "mean_ttft_s": _mean([o.metrics["ttft"] for o in burst_out]),
                     "p90_ttft_s": percentiles([o.metrics["ttft"] for o in burst_out], (90,))["p90"],
                     "prefill_tokens": burst_prefill, "wall_s": burst_wall,
                     "output_tok_per_s": n_burst * max_tokens / burst_wall,
                     "hit_rate": stats.hit_rate if stats else 0.0})
    off_seq, off_burst, on_seq, on_burst = rows
    same = sum(a.token_ids == b.token_ids for a, b in zip(results[False][0] + results[False][1],
                                                           results[True][0] + results[True][1]))
    ratios = {
        "burst_mean_ttft_speedup": off_burst["mean_ttft_s"] / on_burst["mean_ttft_s"],
        "one_at_a_time_mean_ttft_speedup": off_seq["mean_ttft_s"] / on_seq["mean_ttft_s"],
        "burst_prefill_tokens_saved": 1 - on_burst["prefill_tokens"] / off_burst["prefill_tokens"],
        "burst_throughput_ratio": on_burst["output_tok_per_s"] / off_burst["output_tok_per_s"],
    }
    targets = {"burst_mean_ttft_speedup": (">=", 3.0), "burst_prefill_tokens_saved": (">=", 0.8)}
    prompt_lens = sorted(map(len, prompts))
    notes = [
        (f"{n_burst} chat prompts of {prompt_lens[0]}-{prompt_lens[-1]} tokens sharing a {n_shared}-token system "
         f"turn; {max_tokens} output tokens each; block size {block_size}; max_num_seqs {max_seqs}; budget {budget} "
         f"tokens per step; {num_blocks} KV blocks for both engines (no preemption); {dtype}; CPU."),
        (f"greedy tokens identical with and without the cache for {same}/{n_burst + n_seq} requests (equality is "
         f"tested in float32 in tests/test_prefix_cache.py; a difference here would be batched rounding)."),
        ("one at a time, the first request fills the cache, so the cached mean includes one full prefill; in the "
         "burst, requests admitted in the first step all miss (their shared blocks are not computed yet) and the "
         "cache serves everyone admitted after the first chunk of the system prompt is done."),
        ("the last prompt token is always recomputed (its logits sample the first output token), and the tail of "
         "each prompt past its last full shared block (the question) is prefilled per request."),
    ]
    return BenchResult(name="prefix-cache", rows=rows, ratios=ratios, targets=targets,
                       settings={"quick": quick, "dtype": dtype, "requests": n_burst, "one_at_a_time": n_seq,
                                 "system_tokens": n_shared, "max_tokens": max_tokens, "block_size": block_size,
                                 "max_num_seqs": max_seqs, "budget": budget, "device": "cpu",
                                 "threads": torch.get_num_threads()},
                       notes=notes)
