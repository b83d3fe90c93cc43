"""Paged decode attention in Triton: one query per sequence, keys and values read through the block table.

The torch gather it replaces on the GPU (minillm.cache.paged_attention.paged_attention) copies every sequence's
blocks into a contiguous buffer before attending: it reads the KV bytes twice and writes them once. This kernel reads
each key/value once, straight from the pool; decode is memory-bound, so reading the cache once is the whole game.
Lesson 04 uses it; scripts/gpu_check_paged.py measures it against contiguous decode attention on a GPU.
Shapes: `triton_paged_decode`; the flash-decoding split: `_paged_decode_split_kernel`.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import Tensor

if not torch.cuda.is_available() and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    # triton's own helpers (tl.max, tl.sum, ...) are @triton.jit functions whose mode is fixed at `import triton`
    raise ImportError("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on this "
                      "CPU-only machine: import minillm_kernels.paged_decode before triton, or export "
                      "TRITON_INTERPRET=1")

# On a machine without CUDA this turns the Triton interpreter on (TRITON_INTERPRET=1) before the kernels below are
# defined, so they run on CPU tensors, slowly.
from ._triton_env import INTERPRET, tl, triton


@triton.jit
def _paged_decode_split_kernel(
    Q, K, V, TABLES, CONTEXT_LENS, PART_ACC, PART_M, PART_L,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_t_seq,
    stride_acc_seq, stride_acc_head, stride_acc_split,
    stride_m_seq, stride_m_head,
    tokens_per_split, scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program per (sequence, KV head, split of the context): flash-decoding's partial results.

    A tile of TILE token positions becomes block ids (one load from the table per position: `table[t // block_size]`)
    and row addresses `block_id * stride_block + (t % block_size) * stride_slot`, so each key/value is read once,
    straight from the pool. A program handles all query heads of its KV head group at once (GQA: the group's queries
    are the rows of one tl.dot, padded to 16), keeps an online softmax (running max m, sum l, accumulator) in fp32,
    and writes its partial result for `_merge_splits_kernel`. Every load is masked (positions past the context,
    padded heads, padded head dims): under the interpreter an out-of-bounds load segfaults instead of raising.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(CONTEXT_LENS + seq)

    g = tl.arange(0, GROUP_PAD)  # query heads kv_head*GROUP + g share this KV head
    d = tl.arange(0, HEAD_DIM_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(Q + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # (GROUP_PAD, HEAD_DIM_PAD)
    if UPCAST:  # the interpreter computes bf16/fp16 math wrongly: work in fp32 there
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)

    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, context_len)
    for tile_start in range(split_start, split_end, TILE):
        t = tile_start + tl.arange(0, TILE)  # token positions of this tile
        t_ok = t < split_end
        block_ids = tl.load(TABLES + seq * stride_t_seq + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        slot = t % BLOCK_SIZE
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k_rows = block_ids * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head
        v_rows = block_ids * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
        k = tl.load(K + k_rows[:, None] + d[None, :], mask=kv_ok, other=0.0)  # (TILE, HEAD_DIM_PAD)
        v = tl.load(V + v_rows[:, None] + d[None, :], mask=kv_ok, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (GROUP_PAD, TILE), fp32
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)  # rescale what was accumulated under the old max
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    part = seq * stride_m_seq + heads * stride_m_head + split  # an empty split stores m=-inf, l=0, acc=0
    tl.store(PART_M + part, m_i, mask=g_ok)
    tl.store(PART_L + part, l_i, mask=g_ok)
    acc_ptrs = (PART_ACC + seq * stride_acc_seq + heads[:, None] * stride_acc_head + split * stride_acc_split
                + d[None, :])
    tl.store(acc_ptrs, acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    PART_ACC, PART_M, PART_L, OUT,
    stride_acc_seq, stride_acc_head, stride_acc_split,
    stride_m_seq, stride_m_head,
    stride_o_seq, stride_o_head,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """One program per (sequence, query head): merge the splits' partial results with the log-sum-exp rule."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    m = tl.load(PART_M + seq * stride_m_seq + head * stride_m_head + sp)  # (NUM_SPLITS,)
    l = tl.load(PART_L + seq * stride_m_seq + head * stride_m_head + sp)
    acc = tl.load(PART_ACC + seq * stride_acc_seq + head * stride_acc_head + sp[:, None] * stride_acc_split
                  + d[None, :], mask=d_ok[None, :], other=0.0)  # (NUM_SPLITS, HEAD_DIM_PAD)
    m_max = tl.max(m, 0)  # finite: split 0 always holds at least one token
    w = tl.exp(m - m_max)  # 0 for empty splits (m = -inf)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(OUT + seq * stride_o_seq + head * stride_o_head + d, out.to(OUT.dtype.element_ty), mask=d_ok)


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _pick_splits(n_programs: int, max_context: int, tile: int, device: torch.device) -> int:
    """Enough context splits to give every SM about two programs, never more splits than tiles.

    Splitting the context keeps a GPU busy when num_seqs * n_kv_heads is smaller than the number of SMs (e.g.
    batch 8 x 3 KV heads = 24 programs on a 132-SM H200 without splits)."""
    if device.type != "cuda":
        return 1
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * n_sm // max(n_programs, 1))
    return min(_next_pow2(want), _next_pow2(-(-max_context // tile)), 64)


def triton_paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, context_lens: Tensor,
                        num_splits: int | None = None, tile: int | None = None) -> Tensor:
    """Decode attention through block tables with the Triton kernel.

    Same contract as minillm.cache.paged_attention.paged_attention:
        q (num_seqs, n_heads, head_dim); k_pool, v_pool (num_blocks, block_size, n_kv_heads, head_dim), one layer;
        block_tables (num_seqs, max_blocks) int, -1 past a sequence's blocks; context_lens (num_seqs,) int.
        -> (num_seqs, n_heads, head_dim)

    `num_splits` (a power of 2) splits each context for parallelism; by default it is chosen from the GPU's SM
    count (1 under the interpreter). `tile` is the token positions per inner step (power of 2, >= 16)."""
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"expected q (num_seqs, n_heads, head_dim) and one layer's pools (num_blocks, block_size, "
                         f"n_kv_heads, head_dim); got {tuple(q.shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    n_seqs, n_heads, head_dim = q.shape
    _, block_size, n_kv_heads, pool_head_dim = k_pool.shape
    if pool_head_dim != head_dim or n_heads % n_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} vs pool {tuple(k_pool.shape)}: head_dim must match and n_kv_heads "
                         f"must divide n_heads")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k_pool.dtype != q.dtype \
            or v_pool.dtype != q.dtype:
        raise TypeError(f"q, k_pool, v_pool must share one of float16/bfloat16/float32, got {q.dtype}, "
                        f"{k_pool.dtype}, {v_pool.dtype}: cast them first")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported by this kernel")
    if block_tables.dim() != 2 or block_tables.shape[0] != n_seqs or block_tables.dtype not in (torch.int32,
                                                                                                 torch.int64):
        raise ValueError(f"block_tables must be int (num_seqs={n_seqs}, max_blocks), got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if context_lens.shape != (n_seqs,) or context_lens.is_floating_point():
        raise ValueError(f"context_lens must be an int tensor of shape ({n_seqs},), got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    devices = {t.device for t in (q, k_pool, v_pool, block_tables, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if q.is_cuda == INTERPRET:
        raise RuntimeError("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing this module)"
                           " and CUDA tensors need it off" if not q.is_cuda else
                           "TRITON_INTERPRET=1 is set but the tensors are on CUDA: unset it, or pass CPU tensors")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("the pools' head_dim must be contiguous (stride 1); pass cache.k_pool[layer]")
    if n_seqs == 0:
        return q.new_empty(q.shape)

    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    group = n_heads // n_kv_heads
    tile = tile or (64 if not INTERPRET else 32)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of 2 >= 16, got {tile}")
    max_context = tables.shape[1] * block_size  # a bound known on the host: no device sync
    splits = num_splits or _pick_splits(n_seqs * n_kv_heads, max_context, tile, q.device)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of 2, got {splits}")
    tokens_per_split = -(-max(-(-max_context // splits), 1) // tile) * tile  # a whole number of tiles

    f32 = {"dtype": torch.float32, "device": q.device}
    part_acc = torch.empty((n_seqs, n_heads, splits, head_dim), **f32)
    part_m = torch.empty((n_seqs, n_heads, splits), **f32)
    part_l = torch.empty((n_seqs, n_heads, splits), **f32)
    head_dim_pad = _next_pow2(head_dim)
    _paged_decode_split_kernel[(n_seqs, n_kv_heads, splits)](
        q, k_pool, v_pool, tables, context_lens, part_acc, part_m, part_l,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        tables.stride(0),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_m.stride(0), part_m.stride(1),
        tokens_per_split, head_dim**-0.5,
        GROUP=group, GROUP_PAD=max(16, _next_pow2(group)), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE=tile, UPCAST=INTERPRET and q.dtype != torch.float32,
    )
    out = torch.empty_like(q)
    _merge_splits_kernel[(n_seqs, n_heads)](
        part_acc, part_m, part_l, out,
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_m.stride(0), part_m.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=splits, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
    )
    return out
