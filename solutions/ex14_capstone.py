"""Exercise 14 (reference solutions): a KV pool sized by a memory budget, and a deployment chosen for an SLO.

kv_blocks_for_budget is a verbatim copy of minillm.engine.config's (EngineConfig sizes its pool with it),
choose_config of minillm.course.capstone's (see SAME_AS; tests/test_exercise_sync.py keeps them in sync).
"""

from __future__ import annotations

import torch

from minillm.cache.block_allocator import blocks_needed  # given: ceil(n_tokens / block_size)
from minillm.course.capstone import EdgeSLO, load_deployed  # given: the SLO, and the models as the grader serves them
from minillm.engine.config import KV_DTYPES  # given: the engine's kv_cache_dtype names -> storage dtypes
from minillm.model import model_bytes  # given: the bytes of a model's weights

SAME_AS = {
    "kv_blocks_for_budget": "minillm.engine.config",
    "choose_config": "minillm.course.capstone",
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


def choose_config(slo: EdgeSLO) -> dict:
    """The deployment for `slo`: the file's 4-bit weights (the fewest bytes, and on a CPU with minillm's kernels the
    fastest matmuls), the KV pool in int8 (a quarter of float32's bytes per token) filling what the weights leave of
    the budget, as many sequences at once as that pool holds at full length, and the exact techniques that cost
    nothing: fusion, prefix caching (chats share their system prompt). No speculation: at 8 sequences a step is no
    longer memory bound, and verifying drafts costs more than it saves (lesson 10)."""
    block_size, kv_cache_dtype = 16, "int8"
    model, _ = load_deployed(slo.model, weights="q4", fuse=True)
    num_blocks = kv_blocks_for_budget(model.config, slo.memory_bytes, model_bytes(model), block_size, kv_cache_dtype,
                                      model.dtype)
    per_seq = blocks_needed(slo.context_tokens, block_size)
    if num_blocks < slo.min_seqs * per_seq:
        raise ValueError(f"{slo.memory_bytes:,} bytes hold q4 weights and {num_blocks} int8 KV blocks, fewer than "
                         f"the {slo.min_seqs * per_seq} that {slo.min_seqs} sequences of {slo.context_tokens} tokens "
                         f"need: this SLO asks for more memory than the device has")
    return {"weights": "q4", "fuse": True, "kv_cache_dtype": kv_cache_dtype, "block_size": block_size,
            "num_blocks": num_blocks, "max_num_seqs": num_blocks // per_seq, "max_num_batched_tokens": 512,
            "enable_prefix_caching": True, "speculative": None}
