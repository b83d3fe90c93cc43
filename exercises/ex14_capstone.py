"""Exercise 14: the whole ladder, composed; an edge deployment under an SLO (lesson 14).

Every rung so far made one thing cheaper: 4-bit weights (07), an int8 KV cache (07), a paged pool (04), continuous
batching (05), fusion (06), prefix caching (12), speculation (10). A deployment picks among them under a contract
that says what it must deliver, not how: an SLO. Here the device has a fixed memory that holds the weights and the
KV pool together, and the service owes a quality floor, a number of sequences at once and a speed floor. First
the arithmetic every capacity plan starts from (how many KV blocks fit), then the choice itself. Grade your work:

    minillm grade 14

- 14.budget: `kv_blocks_for_budget(model_config, memory_budget_bytes, weight_bytes, ...)` counts the KV blocks that
  fit in what the budget leaves after the weights, in the engine pool's exact layout (minillm/cache/kv_pool.py).
- 14.slo: `choose_config(slo)` returns the keywords of load_model and LLM.from_model that meet an EdgeSLO.

The graders check the block count against the bytes a real pool allocates (KVBlockPool's tensors, an LLM's
cache.nbytes()) on crafted and random configurations (grouped-query heads, every KV dtype, block sizes, model
dtypes), and the budget's refusals. Then SmolLM2-135M is loaded and served with your configuration: its weights plus
its pool within the budget, the pool and max_num_seqs holding the sequences the SLO asks for, its greedy answers
on a fixed chat set against the float32 engine's, and its throughput against the float32 plain engine's, timed in
interleaved pairs. Calling KVCacheSpec, KVBlockPool or the engine's own sizing in your budget is rejected.
"""

from __future__ import annotations

import torch

from minillm.cache.block_allocator import blocks_needed  # noqa: F401  given: ceil(n_tokens / block_size)
from minillm.course.capstone import EdgeSLO, load_deployed  # noqa: F401  given: the SLO, and the models it serves
from minillm.engine.config import KV_DTYPES  # noqa: F401  given: the engine's kv_cache_dtype names -> storage dtypes
from minillm.model import model_bytes  # noqa: F401  given: the bytes of a model's weights

# task 14.budget -----------------------------------------------------------------------------------------------


def kv_blocks_for_budget(model_config, memory_budget_bytes: int, weight_bytes: int, block_size: int = 16,
                         kv_cache_dtype: str | None = None, model_dtype: torch.dtype = torch.float32) -> int:
    """The number of KV blocks of `block_size` tokens that fit in what `memory_budget_bytes` leaves after
    `weight_bytes` of weights, as a Python int.

    The layout is the engine pool's (read minillm/cache/kv_pool.py): K and V are stored separately, in every one of
    model_config.n_layers layers; each token of a block holds a (n_kv_heads, head_dim) slice (the KV heads, not the
    query heads: grouped-query attention shares them) in the storage dtype, which is KV_DTYPES[kv_cache_dtype], or
    model_dtype when kv_cache_dtype is None. An int8 pool also keeps one float16 scale per token and head, for K and
    for V. A block is allocated whole or not at all, so a remainder smaller than a block buys nothing.
    Raise ValueError, with a message saying what to change, when the weights alone exceed the budget, or when what
    is left holds no block at all; an unknown kv_cache_dtype is a ValueError too.
    Example: SmolLM2-135M (30 layers, 3 KV heads of 64 dims), float32 KV, blocks of 16 tokens: one block is
    737,280 bytes; a 600,000,000-byte budget with 538,060,032 bytes of float32 weights leaves 61,939,968 bytes:
    84 blocks. In int8 a block is 190,080 bytes and the same budget holds 325.
    """
    raise NotImplementedError("task 14.budget: see the docstring; `minillm hint 14 budget` for hints")


# task 14.slo --------------------------------------------------------------------------------------------------


def choose_config(slo: EdgeSLO) -> dict:
    """A deployment that meets `slo`: a dict of load_model's keywords (weights, fuse, sparsity) and LLM.from_model's
    (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, kv_cache_dtype, enable_prefix_caching,
    speculative: "ngram", "learned" or None); a key left out takes its default, any other key is refused.

    The grader loads slo.model with your load keywords through load_deployed (size your pool on that same object:
    its config, its dtype, model_bytes of it), builds LLM.from_model with the rest, and holds the result to every
    field of the SLO: (1) the weights plus the pool (cache.nbytes(); a learned draft head's weights too) within
    slo.memory_bytes; (2) max_num_seqs >= slo.min_seqs, and a pool that holds slo.min_seqs sequences of
    slo.context_tokens tokens at once, which the speed run must reach; (3) agreement >= slo.min_quality: the
    share of the float32 engine's greedy answer tokens on a fixed chat set that your engine reproduces, each
    answer counted up to its first differing token; (4) throughput on a second chat set at least slo.min_speedup
    times the float32 plain engine's (a median of interleaved pairs; a small allowance for a noisy machine).
    The float32 defaults fail (1): 538 MB of weights and a 268 MB pool. Lossy choices can fail (3), and
    speculating while many sequences decode can fail (4). If the budget cannot hold what the SLO asks for with the
    cheapest choices, raise ValueError saying so.
    Example: EdgeSLO(memory_bytes=240 MiB, min_quality=0.45, min_seqs=8, context_tokens=512, min_speedup=1.3):
    8 x 512 tokens are 256 blocks of 16, 48.7 MB in int8 but 188.7 MB in float32; 4-bit weights are 97 MB on a CPU
    where minillm's low-bit kernels load. So the pool is int8, the weights 4-bit, and the blocks are what the
    budget leaves after those weights (815 here), serving up to 25 sequences of 512 tokens at once.
    """
    raise NotImplementedError("task 14.slo: see the docstring; `minillm hint 14 slo` for hints")
