"""Exercise 03 (reference solutions): online softmax, tiled flash attention, and the Triton kernel's inner step.

merge_partials and flash_attention are verbatim copies of minillm.attention.flash (see SAME_AS;
tests/test_exercise_sync.py keeps them in sync). attend_key_block is the inner step of minillm_kernels.flash_attn's
kernel, copied verbatim too (tests/graders/test_ex03_flash.py checks it); it exists only when triton is installed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.attention import check_shapes  # input validation, given: not part of the task

try:  # triton is optional: task 03.triton is skipped without it (sets TRITON_INTERPRET=1 on a CPU-only machine)
    from minillm_kernels._triton_env import tl, triton
except ImportError:
    triton = tl = None

SAME_AS = {
    "merge_partials": "minillm.attention.flash",
    "flash_attention": "minillm.attention.flash",
}


# task 03.merge ----------------------------------------------------------------------------------------------

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


# task 03.flash ----------------------------------------------------------------------------------------------

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


# task 03.triton (optional) ----------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def attend_key_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, kv_len, causal_offset, qk_scale,
                         stride_kn, stride_vn, MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
        """Fold keys [start_n, start_n + BLOCK_N) into the running (acc, m_i, l_i) of a BLOCK_M tile of queries.

        m_i, l_i are kept in log2 units (qk_scale includes log2(e)). MASKED tiles may run past kv_len or cross the
        causal diagonal: their loads are masked (an out-of-bounds load is undefined on GPU, a segfault in the
        interpreter) and their invisible scores set to -inf.
        """
        offs_k = start_n + offs_n  # (BLOCK_N,) key positions of this tile
        if MASKED:
            in_bounds = offs_k < kv_len
            k = tl.load(k_ptrs + start_n * stride_kn, mask=in_bounds[:, None], other=0.0)  # (BLOCK_N, D)
            v = tl.load(v_ptrs + start_n * stride_vn, mask=in_bounds[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs + start_n * stride_kn)
            v = tl.load(v_ptrs + start_n * stride_vn)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=tl.float32) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:
            visible = in_bounds[None, :]
            if CAUSAL:
                visible = visible & (offs_k[None, :] <= offs_m[:, None] + causal_offset)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row saw key 0 in the first tile
        p = tl.exp2(s - m_new[:, None])
        rescale = tl.exp2(m_i - m_new)  # the online-softmax step: earlier sums were relative to the old max
        l_i = l_i * rescale + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None], input_precision="ieee", out_dtype=tl.float32)
        return acc, m_new, l_i
