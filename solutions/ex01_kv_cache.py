"""Exercise 01 (reference solutions): the contiguous KV cache's write and its decode-step attention.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.kv_cache import CacheFullError  # the error to raise, given: not part of the task

SAME_AS = {
    "append_kv": "minillm.kv_cache",
    "decode_attention": "minillm.kv_cache",
}


# task 01.cache_append ---------------------------------------------------------------------------------------

def append_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, start: int) -> int:
    """Write k, v (batch, n_kv_heads, new, head_dim) into one layer's buffers (batch, n_kv_heads, max_len, head_dim)
    at positions start .. start + new - 1; return the new filled length (start + new). If that is past the buffer's
    capacity, raise CacheFullError naming the capacity and write nothing: never wrap around or truncate."""
    end = start + k.shape[2]
    capacity = k_cache.shape[2]
    if end > capacity:
        raise CacheFullError(
            f"KV cache capacity is {capacity} tokens; writing positions {start}..{end - 1} would overflow. "
            f"Allocate the cache with a larger max_len (prompt + max_new_tokens)."
        )
    k_cache[:, :, start:end] = k
    v_cache[:, :, start:end] = v
    return end


# task 01.cached_attention -----------------------------------------------------------------------------------

def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, n_filled: int) -> Tensor:
    """One decode step: q (batch, n_heads, 1, head_dim) attends over the first `n_filled` cached positions of
    k_cache/v_cache (batch, n_kv_heads, max_len, head_dim). Returns (batch, n_heads, 1, head_dim) in q's dtype.

    The newest token is the last query, so it may see every filled key: no causal mask. Slots from n_filled on
    were never written (zeros, or another request's keys): reading them would corrupt the softmax.
    """
    b, n_heads, q_len, d = q.shape
    n_kv_heads = k_cache.shape[1]
    if q_len != 1:
        raise ValueError(f"decode_attention takes one new token per sequence, got q_len={q_len}")
    group = n_heads // n_kv_heads
    k = k_cache[:, :, :n_filled].float()  # (b, n_kv_heads, n_filled, d): the filled prefix only
    v = v_cache[:, :, :n_filled].float()
    qg = q.float().reshape(b, n_kv_heads, group, d)  # query head h = g * group + j reads KV head g
    scores = torch.einsum("bgjd,bgnd->bgjn", qg, k) * d**-0.5  # (b, n_kv_heads, group, n_filled)
    out = torch.einsum("bgjn,bgnd->bgjd", scores.softmax(dim=-1), v)  # (b, n_kv_heads, group, d)
    return out.reshape(b, n_heads, 1, d).to(q.dtype)
