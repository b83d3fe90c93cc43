"""MHA -> GQA -> MQA: how many key/value heads the query heads share, as a transformation of a loaded model.

KV bytes per token scale with n_kv_heads, so fewer KV heads shrink the cache and what a long-context decode
step reads. Query head h reads KV head h // (n_heads // n_kv_heads); one `Attention` serves all three.
`regroup`, `to_mha` (repeat KV heads: exact) and `to_mqa` (mean-pool each group, the GQA paper's starting
point before uptraining: it costs quality) return a converted copy with a new config. Lesson 02; exercise 02
asks for `grouped_attention` and `mean_pool_kv_heads`.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from minillm.model import Transformer


def valid_kv_heads(n_heads: int) -> list[int]:
    """The KV-head counts a model with `n_heads` query heads can have: the divisors of n_heads."""
    return [g for g in range(1, n_heads + 1) if n_heads % g == 0]


def kv_heads_for(query_head: int, n_heads: int, n_kv_heads: int) -> int:
    """Which KV head query head `query_head` reads: groups of n_heads / n_kv_heads adjacent query heads share one."""
    if n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}; valid: {valid_kv_heads(n_heads)}")
    if not 0 <= query_head < n_heads:
        raise ValueError(f"query_head must be in [0, {n_heads}), got {query_head}")
    return query_head // (n_heads // n_kv_heads)


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


def repeat_kv_heads(w: Tensor, n_kv_heads: int, times: int) -> Tensor:
    """(n_kv_heads * head_dim, dim) -> (n_kv_heads * times * head_dim, dim): each head's rows repeated `times` times
    in place, so new head g * times + r is a copy of old head g (query heads keep reading the same keys)."""
    rows, dim = w.shape
    head_dim = rows // n_kv_heads
    heads = w.reshape(n_kv_heads, 1, head_dim, dim).expand(n_kv_heads, times, head_dim, dim)
    return heads.reshape(n_kv_heads * times * head_dim, dim).clone()


def regroup(model: Transformer, n_kv_heads: int) -> Transformer:
    """A copy of `model` with `n_kv_heads` KV heads (any divisor of n_heads); `model` is left untouched.

    First every KV head is repeated to one per query head (MHA: exact), then groups of n_heads / n_kv_heads adjacent
    heads are mean-pooled. Going to a multiple of the current count is therefore exact (each new group pools copies
    of one head); going down averages the heads a group's queries used to read (approximate: see
    minillm.compress.quality).
    """
    cfg = model.config
    if n_kv_heads not in valid_kv_heads(cfg.n_heads):
        raise ValueError(f"n_kv_heads must divide n_heads={cfg.n_heads}: got {n_kv_heads}; "
                         f"valid values are {valid_kv_heads(cfg.n_heads)}")
    new = copy.deepcopy(model)  # keeps the tied embedding / LM head tied
    new.config = cfg.with_(n_kv_heads=n_kv_heads)
    for block in new.layers:
        attn = block.attn
        for name in ("wk", "wv"):
            w = getattr(attn, name).weight.data  # (old n_kv_heads * head_dim, dim)
            # Mean-pooling k rows is sound with RoPE: k = W x is linear in W, and RoPE rotates each head's vector
            # by the same position-dependent angles whichever head it is (same frequencies, same pairing for all
            # heads), so rotate(mean_i W_i x) = mean_i rotate(W_i x): pooling weights equals pooling rotated keys.
            mha = repeat_kv_heads(w, cfg.n_kv_heads, cfg.group_size)  # (n_heads * head_dim, dim)
            pooled = mean_pool_kv_heads(mha, cfg.n_heads, n_kv_heads)  # (n_kv_heads * head_dim, dim)
            layer = nn.Linear(pooled.shape[1], pooled.shape[0], bias=False, device=w.device, dtype=w.dtype)
            layer.weight.data.copy_(pooled)
            layer.requires_grad_(False)
            setattr(attn, name, layer)
        attn.n_kv_heads = n_kv_heads
    return new


def to_mha(model: Transformer) -> Transformer:
    """Multi-head attention: one KV head per query head, by repetition. Same logits, n_heads / n_kv_heads x the KV."""
    return regroup(model, model.config.n_heads)


def to_mqa(model: Transformer) -> Transformer:
    """Multi-query attention: all KV heads mean-pooled into one. Smallest cache; costs quality without uptraining."""
    return regroup(model, 1)
