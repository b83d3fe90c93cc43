"""Exercise 14: the whole ladder, composed; an edge deployment under an SLO (lesson 14).

Every rung so far made one thing cheaper: 4-bit weights (07), an int8 KV cache (07), a paged pool (04), continuous
batching (05), fusion (06), prefix caching (12), speculation (10). A deployment picks among them under a contract
that says what it must deliver, not how: an SLO. Here the device has a fixed memory that holds the weights and the
KV pool together, and the service owes a quality floor, a number of sequences at once and a speed floor. First
the arithmetic every capacity plan starts from (how many KV blocks fit), then the choice itself. Grade your work:

    minillm grade 14

- 14.budget: `kv_blocks_for_budget(model_config, memory_budget_bytes, weight_bytes, ...)` counts the KV blocks that
  fit in what the budget leaves after the weights, in the engine pool's exact layout (minillm/cache/kv_pool.py).
- 14.slo: `choose_config(slo, candidates)` returns the keywords of load_model and LLM.from_model that meet an
  EdgeSLO, choosing among measured Candidates (minillm/course/capstone.py defines both types).
- 14.real_model: nothing new to write; your choose_config picks for this machine's edge SLO on SmolLM2-135M.

The graders check the block count against the bytes a real pool allocates (KVBlockPool's tensors, an LLM's
cache.nbytes()) on crafted and random configurations (grouped-query heads, every KV dtype, block sizes, model
dtypes), and the budget's refusals. choose_config is graded on several SLOs over tables of candidates (budgets,
concurrency, quality and speed floors that different candidates meet, SLOs that none meets): what you return is
checked against the candidate it names, the engine pool's bytes per block and every field of the SLO. The
real-model task measures two candidates on SmolLM2-135M, then loads and serves your choice for this machine's
edge SLO: its weights plus its pool within the budget, the pool and max_num_seqs holding the sequences the SLO asks
for, its greedy answers on a fixed chat set against the float32 engine's, and its throughput against the float32
plain engine's, timed in interleaved pairs. Calling KVCacheSpec, KVBlockPool or the engine's own sizing in your
budget is rejected.
"""

from __future__ import annotations

import torch

from minillm.cache.block_allocator import blocks_needed  # noqa: F401  given: ceil(n_tokens / block_size)
from minillm.course.capstone import Candidate, EdgeSLO  # noqa: F401  given: a measured way to serve, and the SLO
from minillm.engine.config import KV_DTYPES  # noqa: F401  given: the engine's kv_cache_dtype names -> storage dtypes

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


def choose_config(slo: EdgeSLO, candidates: list[Candidate]) -> dict:
    """A deployment that meets `slo`, built from one of `candidates`: a dict of load_model's keywords (weights, fuse,
    sparsity: the candidate's) and LLM.from_model's (num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
    kv_cache_dtype and speculative: the candidate's, enable_prefix_caching); a key left out takes its default
    (weights "dequantized", fuse False, no pool size: the engine's default pool), any other key is refused.

    Each Candidate carries what it measured on the machine that serves it: its weights' bytes, the model's shape
    and dtype, its quality (agreement with the float32 engine) and its speedup. Trust those numbers, not numbers you
    remember: the same option measures differently on another CPU. What you return must hold, by those
    measurements and the engine pool's layout (your kv_blocks_for_budget), every field of the SLO:
    (1) the candidate's weights_bytes plus the pool (num_blocks blocks of block_size tokens in kv_cache_dtype)
    within slo.memory_bytes; (2) max_num_seqs >= slo.min_seqs, max_num_batched_tokens >= slo.min_seqs, and a pool
    that holds slo.min_seqs sequences of slo.context_tokens tokens at once; (3) quality >= slo.min_quality;
    (4) speedup >= slo.min_speedup. Any candidate that meets all four is a right answer. When none does, raise
    ValueError saying which floor or budget could not be met. Leave `candidates` as it was. The real-model task
    serves your answer and measures (1)-(4) again.
    Example: budget B, a candidate of W bytes of weights whose pool stores a block in P bytes: it can pay for
    (B - W) // P blocks; with blocks of 16 tokens, 8 sequences of 512 tokens need 8 x 32 = 256 of them, so it
    qualifies for memory only if (B - W) // P >= 256, and then it holds (B - W) // P // 32 such sequences at once.
    A candidate whose measured quality is under the floor is out, however small its weights.
    """
    raise NotImplementedError("task 14.slo: see the docstring; `minillm hint 14 slo` for hints")
