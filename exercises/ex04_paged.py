"""Exercise 04: paged KV cache -- the block allocator and decode attention through block tables.

Fill in the methods and the function, then grade your work:

    minillm grade 04

The allocator grader runs random allocate / fork / free sequences against a model of who owns which block: no block
handed out twice, all-or-nothing allocation, shared blocks kept until their last owner frees them, double frees
refused, nothing leaked. The attention grader compares with SDPA over each sequence's own keys, with shuffled block
ids, lengths that are not multiples of the block size, GQA, and NaN in every pool slot a sequence does not own
(reading past a sequence's length shows up); it rejects answers that call SDPA or minillm.

task_04_real_model puts your BlockAllocator in every paged cache and registers your paged_attention as their decode
backend (register_attention(..., kind="paged_decode")): minillm.generate(cache="paged") and the engine (minillm.LLM,
six requests on a six-block pool, with preemptions) must give minillm's greedy tokens. It stands on exercises 00
(norm, RoPE, sampler) and 02/03 (the prefill attention: the latest you wrote), minillm's where you have not.
"""

from __future__ import annotations

from collections import deque

from torch import Tensor

from minillm.block_allocator import OutOfBlocksError  # noqa: F401  (the error allocate raises, given)
from minillm.paged_attention import _check_paged_inputs  # input validation, given: not part of the task

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
        raise NotImplementedError(
            "task 04.allocator: if n > number of free blocks raise OutOfBlocksError (allocating nothing); "
            "else pop n ids from the left of self._free and set their ref counts to 1"
        )

    def _check_ids(self, block_ids: list[int]) -> None:
        for i in block_ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_blocks:
                raise ValueError(f"block id {i!r} is not a block of this pool (0..{self.num_blocks - 1})")

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 goes back on the free list.

        Checks everything before changing anything, so a bad call (a double free, an unknown id) leaves the
        allocator as it was.
        """
        raise NotImplementedError(
            "task 04.allocator: validate everything first (self._check_ids; a block freed more times than its ref "
            "count is a double free: ValueError), then decrement each ref count and append a block to self._free "
            "when its count reaches 0"
        )

    def incref(self, block_ids: list[int]) -> None:
        """Add an owner to each (already allocated) block: a forked sequence or a shared prefix."""
        raise NotImplementedError(
            "task 04.allocator: every block must be allocated (ref count > 0, else ValueError); add 1 to each"
        )

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
    raise NotImplementedError(
        "task 04.paged_attention: gather each sequence's blocks from the pools through its block table (clamp -1 "
        "padding to a real id), mask positions >= context_lens in the scores (-inf) AND in the values (0 * NaN is "
        "NaN), query head h uses KV head h // (n_heads // n_kv_heads), softmax(q k^T / sqrt(head_dim)) v in float32"
    )
