"""Exercise 04 (reference solutions): the block allocator and paged decode attention.

BlockAllocator is a verbatim copy of minillm.block_allocator's, paged_attention of minillm.paged's (see SAME_AS;
tests/test_exercise_sync.py keeps them in sync).
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from minillm.block_allocator import OutOfBlocksError
from minillm.paged_attention import _check_paged_inputs  # input validation, given: not part of the task

SAME_AS = {
    "BlockAllocator": "minillm.block_allocator",
    "paged_attention": "minillm.paged_attention",
}


# task 04.allocator ------------------------------------------------------------------------------------------

class BlockAllocator:
    """Hands out block ids from a free list (a deque) and keeps a reference count per block."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    def num_free(self) -> int:
        return len(self._free)

    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        """Take `n` free blocks (ref count 1 each). All or nothing: raises OutOfBlocksError if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"asked for {n} KV blocks but only {len(self._free)} of {self.num_blocks} are free "
                f"(block_size={self.block_size}): free finished sequences, preempt one, or build the cache with "
                f"more blocks"
            )
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._ref_counts[i] = 1
        return ids

    def _check_ids(self, block_ids: list[int]) -> None:
        for i in block_ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_blocks:
                raise ValueError(f"block id {i!r} is not a block of this pool (0..{self.num_blocks - 1})")

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 goes back on the free list.

        Checks everything before changing anything, so a bad call (a double free, an unknown id) leaves the
        allocator as it was.
        """
        block_ids = list(block_ids)
        self._check_ids(block_ids)
        drops: dict[int, int] = {}
        for i in block_ids:
            drops[i] = drops.get(i, 0) + 1
        for i, n in drops.items():
            if n > self._ref_counts[i]:
                state = "is already free" if self._ref_counts[i] == 0 else f"has only {self._ref_counts[i]} owner(s)"
                raise ValueError(f"double free: block {i} {state}; free each block once per owner")
        for i in block_ids:
            self._ref_counts[i] -= 1
            if self._ref_counts[i] == 0:
                self._free.append(i)

    def incref(self, block_ids: list[int]) -> None:
        """Add an owner to each (already allocated) block: a forked sequence or a shared prefix."""
        block_ids = list(block_ids)
        self._check_ids(block_ids)
        for i in block_ids:
            if self._ref_counts[i] == 0:
                raise ValueError(f"block {i} is free; allocate it before sharing it")
        for i in block_ids:
            self._ref_counts[i] += 1

    def ref_count(self, block_id: int) -> int:
        self._check_ids([block_id])
        return self._ref_counts[block_id]

    def reset(self) -> None:
        """Forget every allocation (all blocks free again)."""
        self._free = deque(range(self.num_blocks))
        self._ref_counts = [0] * self.num_blocks

    def __repr__(self) -> str:
        return (f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={self.num_free()})")


# task 04.paged_attention ------------------------------------------------------------------------------------

def paged_attention(q: Tensor, k_pool_layer: Tensor, v_pool_layer: Tensor, block_tables: Tensor,
                    context_lens: Tensor) -> Tensor:
    """Decode attention through block tables, in torch: one query per sequence over its first context_lens keys.

    q (num_seqs, n_heads, head_dim); pools (num_blocks, block_size, n_kv_heads, head_dim); block_tables
    (num_seqs, max_blocks) (entries past a sequence's blocks may be -1); context_lens (num_seqs,).
    Returns (num_seqs, n_heads, head_dim). Slots past a sequence's length may hold anything (NaN included).
    """
    _check_paged_inputs(q, k_pool_layer, v_pool_layer, block_tables)
    if block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(f"{q.shape[0]} queries need {q.shape[0]} block table rows and context lengths, got "
                         f"{tuple(block_tables.shape)}, {tuple(context_lens.shape)}")
    n_seqs, n_heads, head_dim = q.shape
    n_kv_heads = k_pool_layer.shape[2]
    group = n_heads // n_kv_heads
    table = block_tables.long().clamp(min=0).flatten()  # -1 padding reads block 0; those slots are masked below
    # gathered (n_seqs * max_blocks, block_size, kv_heads, head_dim) -> (n_seqs, kv_heads, L = max_blocks * block_size,
    # head_dim): each sequence's keys in position order
    keys = k_pool_layer.index_select(0, table).view(n_seqs, -1, n_kv_heads, head_dim).transpose(1, 2)
    values = v_pool_layer.index_select(0, table).view(n_seqs, -1, n_kv_heads, head_dim).transpose(1, 2)
    valid = torch.arange(keys.shape[2], device=q.device) < context_lens.to(q.device)[:, None]  # (n_seqs, L)
    values = torch.where(valid[:, None, :, None], values, 0)  # 0 * NaN is NaN: clear unused slots, not just weights
    q_grouped = q.float().view(n_seqs, n_kv_heads, group, head_dim)  # query head h reads KV head h // group
    scores = (q_grouped @ keys.float().transpose(-1, -2)) * head_dim**-0.5  # (n_seqs, n_kv_heads, group, L)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = scores.softmax(dim=-1) @ values.float()  # (n_seqs, n_kv_heads, group, head_dim)
    return out.reshape(n_seqs, n_heads, head_dim).to(q.dtype)
