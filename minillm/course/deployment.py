"""Exercise 14's answer: a deployment chosen for an edge SLO from measured candidates (minillm/course/capstone.py).

Kept apart from capstone.py, which the exercise's stub imports for its data types and measurements: the stub's
imports must not lead to the answer.
"""

from __future__ import annotations

from minillm.cache.block_allocator import blocks_needed
from minillm.course.capstone import Candidate, EdgeSLO
from minillm.engine.config import kv_blocks_for_budget


def choose_config(slo: EdgeSLO, candidates: list[Candidate]) -> dict:
    """The deployment for `slo`: of the candidates whose measured quality and speedup reach the SLO's floors and whose
    weights leave room for min_seqs full contexts of KV in their pool's dtype, the fastest; its pool fills what its
    weights leave of the budget (blocks of 16 tokens), serving as many full contexts at once as that pool holds, with
    prefix caching on (exact, and chats share their system prompt). ValueError when no candidate meets the SLO."""
    block_size = 16
    per_seq = blocks_needed(slo.context_tokens, block_size)
    best, best_blocks = None, 0
    for c in candidates:
        if c.quality < slo.min_quality or c.speedup < slo.min_speedup:
            continue
        try:
            num_blocks = kv_blocks_for_budget(c.model_config, slo.memory_bytes, c.weights_bytes, block_size,
                                              c.kv_cache_dtype, c.model_dtype)
        except ValueError:  # the weights leave no block
            continue
        if num_blocks >= slo.min_seqs * per_seq and (best is None or c.speedup > best.speedup):
            best, best_blocks = c, num_blocks
    if best is None:
        raise ValueError(f"no candidate meets the SLO: none reaches quality {slo.min_quality} and speedup "
                         f"{slo.min_speedup} with weights that leave {slo.memory_bytes:,} bytes room for "
                         f"{slo.min_seqs} x {slo.context_tokens} tokens of KV")
    max_num_seqs = best_blocks // per_seq
    return {**best.load_keys(), "kv_cache_dtype": best.kv_cache_dtype, "speculative": best.speculative,
            "block_size": block_size, "num_blocks": best_blocks, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max(512, max_num_seqs), "enable_prefix_caching": True}
