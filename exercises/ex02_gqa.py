"""Exercise 02: MHA -> GQA -> MQA (lesson 02, "share key/value heads").

With n_kv_heads < n_heads, groups of adjacent query heads share one key/value head: fewer KV bytes to store and to
read per decode step. Fill in both functions, then grade your work:

    minillm grade 02

The graders compare yours with torch SDPA on K/V repeated per query head, and with a per-head loop for the pooling.
Calling torch's attention, minillm's repeat_kv (or minillm at all) inside your answer is rejected.

task_02_real_model makes your grouped_attention SmolLM2-135M's attention backend (9 query heads on 3 KV heads):
prefill logits within 1e-3 of minillm's, and generate()'s greedy tokens identical (your attention also runs every
decode step over the cache). It stands on exercise 00 (your norm, RoPE and sampler where written, else minillm's);
exercise 01's decode_attention stays out, so the decode steps are yours too.
"""

from __future__ import annotations

import torch  # noqa: F401  (you will need it)
from torch import Tensor

# task 02.grouped_attention ----------------------------------------------------------------------------------

def grouped_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """softmax(q k^T / sqrt(d)) v where n_kv_heads divides n_heads, without copying K/V once per query head.

    q (batch, n_heads, q_len, head_dim); k, v (batch, n_kv_heads, kv_len, head_dim). Query head h reads KV head
    h // (n_heads // n_kv_heads). The causal mask is bottom-right aligned (the queries are the last q_len positions).

    Returns (batch, n_heads, q_len, head_dim) in q's dtype; scores and softmax in float32, safe for scores in the
    hundreds. No tensor of n_heads copies of K or V may be built (no repeat_kv, no repeat_interleave). Example: 9 query
    heads on 3 KV heads: heads 0, 1, 2 read KV head 0, heads 3, 4, 5 KV head 1 (not heads 0, 3, 6). With q_len 1 and
    kv_len 5 (a decode step) the query sees all 5 keys.
    """
    raise NotImplementedError("task 02.grouped_attention: see the docstring; `minillm hint 02 grouped_attention` for "
                              "hints")


# task 02.mean_pool ------------------------------------------------------------------------------------------

def mean_pool_kv_heads(w: Tensor, n_kv_heads: int, new_n_kv_heads: int) -> Tensor:
    """Pool a k or v projection weight (n_kv_heads * head_dim, dim) down to (new_n_kv_heads * head_dim, dim) by
    averaging each group of n_kv_heads / new_n_kv_heads adjacent heads' rows (GQA paper, section 2.1). Averages in
    float32, returns w's dtype; a new_n_kv_heads that does not divide n_kv_heads is a ValueError.

    A head is head_dim consecutive rows (head_dim = rows / n_kv_heads). Example: 4 heads of head_dim 1, rows
    [[1.], [3.], [5.], [7.]], pooled to 2 heads: [[2.], [6.]] (heads 0 and 1 average, then 2 and 3); pooled to 3 heads:
    ValueError.
    """
    raise NotImplementedError("task 02.mean_pool: see the docstring; `minillm hint 02 mean_pool` for hints")
