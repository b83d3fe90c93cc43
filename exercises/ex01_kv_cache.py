"""Exercise 01: the KV cache (lesson 01, "stop recomputing the past").

A decode step projects only the newest token; its key and value go into a preallocated buffer after the ones
already there, and its query attends over everything written so far. Fill in both functions, then grade your work:

    minillm grade 01

The graders compare yours with torch SDPA over the filled prefix, fill the unwritten slots with NaN (a read past
the filled length shows up), and plug your functions into a cache that the real model class decodes with. Calling
torch's attention (or minillm) inside your answer is rejected.

task_01_real_model decodes SmolLM2-135M with minillm.generate through a cache that writes with your append_kv and
decodes with your decode_attention (unwritten slots full of NaN): the same greedy tokens as minillm. It stands on
exercise 00: your rms_norm, apply_rope, naive_attention (the prefill) and sampler run underneath where you have
written them, minillm's where you have not; if only they break the run, the failure says so.
"""

from __future__ import annotations

import torch  # noqa: F401  (you will need it)
from torch import Tensor

from minillm.kv_cache import CacheFullError  # noqa: F401  (the error to raise, given)

# task 01.cache_append ---------------------------------------------------------------------------------------

def append_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, start: int) -> int:
    """Write k, v (batch, n_kv_heads, new, head_dim) into one layer's buffers (batch, n_kv_heads, max_len, head_dim)
    at positions start .. start + new - 1; return the new filled length (start + new). If that is past the buffer's
    capacity, raise CacheFullError naming the capacity and write nothing: never wrap around or truncate.

    Positions are the buffers' dim 2; the other slots are left as they were. Example: buffers of capacity 8, start
    5 and 3 new tokens fill positions 5, 6, 7 and return 8; start 6 with 3 new tokens raises CacheFullError (the
    message names 8) and positions 6 and 7 keep what they held.
    """
    raise NotImplementedError("task 01.cache_append: see the docstring; `minillm hint 01 cache_append` for hints")


# task 01.cached_attention -----------------------------------------------------------------------------------

def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, n_filled: int) -> Tensor:
    """One decode step: q (batch, n_heads, 1, head_dim) attends over the first `n_filled` cached positions of
    k_cache/v_cache (batch, n_kv_heads, max_len, head_dim). Returns (batch, n_heads, 1, head_dim) in q's dtype.

    The newest token is the last query, so it may see every filled key: no causal mask. Slots from n_filled on
    were never written (zeros, or another request's keys): reading them would corrupt the softmax.

    Query head h reads KV head h // (n_heads / n_kv_heads); scores q k^T / sqrt(head_dim) and their softmax in
    float32 (scores in the hundreds must not overflow); a q_len other than 1 is a ValueError. Example: one head,
    head_dim 1, q = [[1.]], cached keys [0., 0., NaN] and values [2., 4., NaN] with n_filled = 2: equal scores, so
    the output is [[3.]], and the NaN slot is never read.
    """
    raise NotImplementedError("task 01.cached_attention: see the docstring; `minillm hint 01 cached_attention` for "
                              "hints")
