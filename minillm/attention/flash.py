"""FlashAttention's forward pass in plain torch: tile queries and keys, never build the q_len x kv_len matrix.

The online softmax keeps a running max `m`, sum `l` and unnormalised output `o` per query row, so attention is
computed one key block at a time and partials over disjoint keys merge exactly (`merge_partials`;
`flash_attention` applies it tile after tile). What it removes: the O(N^2) score matrix and its trips through
memory, so peak memory grows like O(N). As a torch loop on a CPU it is slower than one fused matmul; the fast
path is the same algorithm as one GPU kernel (kernels/flash_attn.py). Lesson 03; exercise 03 asks for
`merge_partials` and `flash_attention`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.attention import check_shapes


def merge_partials(o1: Tensor, m1: Tensor, l1: Tensor, o2: Tensor, m2: Tensor, l2: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Combine the softmax-attention partials of two disjoint key sets into the partial of their union.

    A partial over keys J is (o, m, l) with m = max_j s_j, l = sum_j exp(s_j - m), o = sum_j exp(s_j - m) v_j:
    o is *unnormalised* (o / l is the attention output over J alone). Shapes: o (..., head_dim); m, l (...,).
    An empty key set is m = -inf, l = 0, o = 0. Both partials are rescaled to the common maximum m = max(m1, m2),
    so exp never sees a positive argument (no overflow), and the result is exact, not an approximation.
    """
    m = torch.maximum(m1, m2)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both empty: avoid exp(-inf - -inf) = nan
    scale1, scale2 = torch.exp(m1 - m_safe), torch.exp(m2 - m_safe)  # exp(-inf) = 0 for an empty side
    l = scale1 * l1 + scale2 * l2
    o = scale1[..., None] * o1 + scale2[..., None] * o2
    return o, m, l


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, block_q: int = 64, block_k: int = 64,
                    return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Tiled attention with the online softmax; same result as naive_attention, O(block_q x block_k) temporaries.

    q (batch, n_heads, q_len, head_dim), k/v (batch, n_kv_heads, kv_len, head_dim); causal is bottom-right aligned
    (query i sees keys j <= i + kv_len - q_len). Accumulates in float32, returns q's dtype. With return_lse, also
    each row's log-sum-exp of its scaled scores, m + log(l), (batch, n_heads, q_len) float32: what lets two
    attention results over disjoint key sets be merged later (merge_partials with o = out * l, sequence parallelism).
    """
    check_shapes(q, k, v)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    batch, n_heads, q_len, head_dim = q.shape
    n_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = n_heads // n_kv_heads
    offset = kv_len - q_len  # >= 0 (check_shapes), so every query sees key 0: no row is ever fully masked
    scale = head_dim**-0.5
    # GQA without copying K/V: query head h = kv * group + g, so group the queries per KV head
    q_grouped = q.reshape(batch, n_kv_heads, group, q_len, head_dim)  # (b, h_kv, group, q_len, d)
    out = torch.empty_like(q_grouped)
    lse = torch.empty(q_grouped.shape[:-1], dtype=torch.float32, device=q.device)  # (b, h_kv, group, q_len)
    for q_start in range(0, q_len, block_q):
        q_end = min(q_start + block_q, q_len)
        q_tile = q_grouped[:, :, :, q_start:q_end].float() * scale  # (b, h_kv, group, bq, d)
        rows = q_tile.shape[:-1]
        # running max of the scores per query row
        m = torch.full(rows, float("-inf"), dtype=torch.float32, device=q.device)
        l = torch.zeros(rows, dtype=torch.float32, device=q.device)  # running sum of exp(score - m)
        acc = torch.zeros_like(q_tile)  # running unnormalised output
        # causal: the last query of this tile sees keys < q_end + offset; blocks past that are all masked: skip
        kv_stop = min(kv_len, q_end + offset) if causal else kv_len
        for k_start in range(0, kv_stop, block_k):
            k_end = min(k_start + block_k, kv_stop)
            k_tile = k[:, :, None, k_start:k_end].float()  # (b, h_kv, 1, bk, d): broadcast over the group
            v_tile = v[:, :, None, k_start:k_end].float()
            scores = q_tile @ k_tile.transpose(-1, -2)  # (b, h_kv, group, bq, bk): one tile, never the full row
            if causal and k_end - 1 > q_start + offset:  # the tile crosses the diagonal: mask its upper part
                q_pos = torch.arange(q_start, q_end, device=q.device)[:, None] + offset
                k_pos = torch.arange(k_start, k_end, device=q.device)[None, :]
                scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            m_new = torch.maximum(m, scores.amax(dim=-1))  # finite: key 0 was in the first tile for every row
            p = torch.exp(scores - m_new[..., None])
            rescale = torch.exp(m - m_new)  # the online-softmax step: old sums were relative to the old max
            l = rescale * l + p.sum(dim=-1)
            acc = rescale[..., None] * acc + p @ v_tile
            m = m_new
        out[:, :, :, q_start:q_end] = (acc / l[..., None]).to(q.dtype)
        lse[..., q_start:q_end] = m + torch.log(l)
    out = out.reshape(batch, n_heads, q_len, head_dim)
    return (out, lse.reshape(batch, n_heads, q_len)) if return_lse else out
