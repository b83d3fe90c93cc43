"""Exercise 02 (reference solutions): grouped-query attention, and shrinking the KV heads of a trained model.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

SAME_AS = {
    "grouped_attention": "minillm.compress.gqa",
    "mean_pool_kv_heads": "minillm.compress.gqa",
}


# task 02.grouped_attention ----------------------------------------------------------------------------------

def grouped_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """softmax(q k^T / sqrt(d)) v where n_kv_heads divides n_heads, without copying K/V once per query head.

    q (batch, n_heads, q_len, head_dim); k, v (batch, n_kv_heads, kv_len, head_dim). Query head h reads KV head
    h // (n_heads // n_kv_heads). The causal mask is bottom-right aligned (the queries are the last q_len positions).
    """
    b, n_heads, q_len, d = q.shape
    n_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = n_heads // n_kv_heads
    # adjacent query heads form a group: head h = g * group + j -> (g, j); K/V broadcast over j, never repeated
    qg = q.float().reshape(b, n_kv_heads, group, q_len, d)
    scores = torch.einsum("bgjqd,bgkd->bgjqk", qg, k.float()) * d**-0.5  # (b, n_kv_heads, group, q_len, kv_len)
    if causal:
        i = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        j = torch.arange(kv_len, device=q.device)[None, :]
        scores = scores.masked_fill(j > i, float("-inf"))
    out = torch.einsum("bgjqk,bgkd->bgjqd", scores.softmax(dim=-1), v.float())
    return out.reshape(b, n_heads, q_len, d).to(q.dtype)


# task 02.mean_pool ------------------------------------------------------------------------------------------

def mean_pool_kv_heads(w: Tensor, n_kv_heads: int, new_n_kv_heads: int) -> Tensor:
    """Pool a k or v projection weight (n_kv_heads * head_dim, dim) down to (new_n_kv_heads * head_dim, dim) by
    averaging each group of n_kv_heads / new_n_kv_heads adjacent heads' rows (GQA paper, section 2.1). Averages in
    float32, returns w's dtype; a new_n_kv_heads that does not divide n_kv_heads is a ValueError."""
    if new_n_kv_heads < 1 or n_kv_heads % new_n_kv_heads:
        raise ValueError(f"new_n_kv_heads={new_n_kv_heads} must divide n_kv_heads={n_kv_heads}")
    rows, dim = w.shape
    head_dim = rows // n_kv_heads
    group = n_kv_heads // new_n_kv_heads
    heads = w.reshape(new_n_kv_heads, group, head_dim, dim)  # heads g*group .. g*group+group-1 pool into head g
    return heads.float().mean(dim=1).reshape(new_n_kv_heads * head_dim, dim).to(w.dtype)
