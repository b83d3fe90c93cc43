"""Exercise 14 (reference solutions): a KV pool sized by a memory budget, and a deployment chosen for an SLO.

kv_blocks_for_budget is a verbatim copy of minillm.engine.config's (EngineConfig sizes its pool with it),
choose_config of minillm.course.deployment's (see SAME_AS; tests/test_exercise_sync.py keeps them in sync).
"""

from __future__ import annotations

import torch

from minillm.cache.block_allocator import blocks_needed  # given: ceil(n_tokens / block_size)
from minillm.course.capstone import Candidate, EdgeSLO  # given: a measured way to serve the model, and the SLO
from minillm.engine.config import KV_DTYPES  # given: the engine's kv_cache_dtype names -> storage dtypes

SAME_AS = {
    "kv_blocks_for_budget": "minillm.engine.config",
    "choose_config": "minillm.course.deployment",
}

# task 14.budget -----------------------------------------------------------------------------------------------


def kv_blocks_for_budget(model_config, memory_budget_bytes: int, weight_bytes: int, block_size: int = 16,
                         kv_cache_dtype: str | None = None, model_dtype: torch.dtype = torch.float32) -> int:
    """How many KV blocks of `block_size` tokens fit in what `memory_budget_bytes` leaves after `weight_bytes` of
    weights (lesson 14: a device's memory holds the weights and the KV pool, nothing is free).

    The layout is the engine pool's (cache/kv_pool.py, whose KVCacheSpec.bytes_per_block states it from the pool's
    side): K and V, in every layer, a (n_kv_heads, head_dim) slice per token, stored in kv_cache_dtype (None: the
    model's dtype); int8 adds a float16 scale per token and head. Only whole blocks can be allocated, so the count
    rounds down. Raises ValueError, saying what to change, when the weights alone exceed the budget or what is left
    holds no block."""
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be None (the model's dtype) or one of {list(KV_DTYPES)[1:]}, got "
                         f"{kv_cache_dtype!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    storage = KV_DTYPES[kv_cache_dtype] or model_dtype
    per_token_head = model_config.head_dim * torch.empty((), dtype=storage).element_size()
    if not storage.is_floating_point:
        per_token_head += 2  # its float16 scale: int8 codes mean nothing without it
    per_block = 2 * model_config.n_layers * block_size * model_config.n_kv_heads * per_token_head  # K and V
    left = memory_budget_bytes - weight_bytes
    if left < 0:
        raise ValueError(f"the weights ({weight_bytes:,} bytes) exceed the memory budget ({memory_budget_bytes:,}): "
                         f"load smaller weights (weights='q4' or 'int8') or raise the budget")
    if left < per_block:
        raise ValueError(f"the {left:,} bytes the budget leaves after the weights hold no KV block of {block_size} "
                         f"tokens ({per_block:,} bytes): store the KV in int8 (kv_cache_dtype='int8'), load smaller "
                         f"weights, use smaller blocks or raise the budget")
    return left // per_block


# task 14.slo --------------------------------------------------------------------------------------------------


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
