"""Exercise 03: flash attention, from the online-softmax merge to a tiled loop (and, optionally, a Triton kernel).

Fill in each function, then grade your work:

    minillm grade 03

The graders compare with torch's SDPA on random shapes (q_len and kv_len not multiples of the block size, GQA,
decode, chunked prefill) and return_lse's log-sum-exp with a float64 one, check that flash_attention never builds a
q_len x kv_len tensor, never copies K/V per query head, skips the key blocks above the causal diagonal and refuses
block sizes < 1, and reject answers that call SDPA, softmax or minillm's own attention.

task_03_real_model makes your flash_attention (16 x 16 tiles: the 37-token chat prompt spans three key tiles)
SmolLM2-135M's attention backend: prefill logits within 1e-3 of minillm's and the same greedy tokens. It stands on
exercise 00 (your norm, RoPE and sampler where written, else minillm's).
"""

from __future__ import annotations

import torch  # noqa: F401  (you will need it)
from torch import Tensor

from minillm.attention import check_shapes  # noqa: F401  input validation, given: not part of the task

try:  # triton is optional: task 03.triton is skipped without it (sets TRITON_INTERPRET=1 on a CPU-only machine)
    from minillm_kernels._triton_env import tl, triton
except ImportError:
    triton = tl = None


# task 03.merge ----------------------------------------------------------------------------------------------

def merge_partials(o1: Tensor, m1: Tensor, l1: Tensor, o2: Tensor, m2: Tensor, l2: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Combine the softmax-attention partials of two disjoint key sets into the partial of their union.

    A partial over keys J is (o, m, l) with m = max_j s_j, l = sum_j exp(s_j - m), o = sum_j exp(s_j - m) v_j:
    o is *unnormalised* (o / l is the attention output over J alone). Shapes: o (..., head_dim); m, l (...,).
    An empty key set is m = -inf, l = 0, o = 0. Both partials are rescaled to the common maximum m = max(m1, m2),
    so exp never sees a positive argument (no overflow), and the result is exact, not an approximation.

    Returns (o, m, l) of the union with the same shapes; two empty sides give (0, -inf, 0), never NaN. Example: one
    key on each side, scores 0 and log 3, values [1.] and [5.]: (o1, m1, l1) = ([1.], 0, 1), (o2, m2, l2) = ([5.],
    log 3, 1); merged m = log 3, side 1 scaled by 1/3: l = 4/3, o = [1/3 + 5] = [16/3], and o / l = [4.], the
    softmax-weighted mean (1 * 1 + 3 * 5) / 4.
    """
    raise NotImplementedError("task 03.merge: see the docstring; `minillm hint 03 merge` for hints")


# task 03.flash ----------------------------------------------------------------------------------------------

def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, block_q: int = 64, block_k: int = 64,
                    return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Tiled attention with the online softmax; same result as naive_attention, O(block_q x block_k) temporaries.

    q (batch, n_heads, q_len, head_dim), k/v (batch, n_kv_heads, kv_len, head_dim); causal is bottom-right aligned
    (query i sees keys j <= i + kv_len - q_len). Accumulates in float32, returns q's dtype. With return_lse, return
    (out, lse): lse is each row's log-sum-exp over the keys it sees of its scaled scores s_j = q.k_j / sqrt(head_dim),
    log(sum_j exp(s_j)), (batch, n_heads, q_len) float32, finite even where exp(s_j) alone over- or underflows.

    What must hold: equal to naive attention (within float32 rounding) for any q_len and kv_len, multiples of the
    block sizes or not, GQA (query head h reads KV head h // group), decode (q_len 1) and chunked prefill (q_len <
    kv_len); no temporary larger than a block_q x block_k tile of scores per head (never a q_len x kv_len one); key
    blocks entirely above the causal diagonal are skipped, not computed and masked; K/V never copied per query head
    (a query head reads its KV head's tensors in place, also tile by tile); block_q < 1 or block_k < 1 is a
    ValueError (1 is valid). Example: q_len = kv_len = 100, block_q = block_k = 64, causal: the first query block
    (rows 0-63) reads only key block 0-63; the second reads keys 0-63 and 64-99, the latter masked on its diagonal.
    A row whose visible scaled scores are [0, log 3] has lse = log 4.
    """
    raise NotImplementedError("task 03.flash: see the docstring; `minillm hint 03 flash` for hints")


# task 03.triton (optional) ----------------------------------------------------------------------------------

def attend_key_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, kv_len, causal_offset, qk_scale,
                     stride_kn, stride_vn, MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """Fold keys [start_n, start_n + BLOCK_N) into the running (acc, m_i, l_i) of a BLOCK_M tile of queries.

    The inner step of minillm_kernels.flash_attn's kernel (read `_flash_fwd_kernel` there for how it is called;
    the grader runs that kernel with your function in place of the engine's). Decorate it with @triton.jit.
      acc (BLOCK_M, D) float32 unnormalised output; m_i, l_i (BLOCK_M,) float32 running max / sum, in log2 units
      q (BLOCK_M, D) the query tile; k_ptrs, v_ptrs (BLOCK_N, D) pointers to keys/values 0..BLOCK_N-1 of this
      head: add start_n * stride_kn (stride_vn) to reach this tile. offs_m (BLOCK_M,) query positions, offs_n
      (BLOCK_N,) = arange(0, BLOCK_N). Query i sees key j <= i + causal_offset when CAUSAL.
      qk_scale = log2(e) / sqrt(D): scores * qk_scale are in log2 units, so use tl.exp2.
      MASKED: the tile may run past kv_len or cross the diagonal; mask the loads (other=0.0) and set invisible
      scores to -inf. Unmasked tiles need neither. UPCAST: convert loaded k, v to float32 (the interpreter's bf16
      math is wrong). Return (acc, m_i, l_i) updated.
    The same online-softmax step as task 03.flash's inner loop, on one tile, in base 2: after the call, acc / l_i
    is the attention of the tile's queries over every key seen so far.
    """
    raise NotImplementedError("task 03.triton: see the docstring; `minillm hint 03 triton` for hints")
