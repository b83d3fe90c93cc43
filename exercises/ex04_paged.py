"""Exercise 04: paged KV cache -- the block allocator, and where each token's key/value goes in the pool (the write
path) and where a sequence's cached tokens are read back from (the read path).

Fill in the methods and the functions, then grade your work:

    minillm grade 04

The contract. A layer's pool, viewed as (num_blocks * block_size, n_kv_heads, head_dim), is an array of slots.
Position p of a sequence whose block table is T lives in slot T[p // block_size] * block_size + p % block_size.
  slot_mapping   one packed forward: sequence i brings query_lens[i] new tokens, its positions
                 context_lens[i] - query_lens[i] .. context_lens[i] - 1 (a prompt, a chunk of one that starts in
                 the middle of a block, or one decode token); return their slots, sequence after sequence, in
                 position order. Only the new tokens: the earlier ones are already in the pool.
  context_slots  every cached position 0 .. context_lens[i] - 1 of each sequence, as an (n, width) int64 tensor
                 of slots plus an (n, width) bool `valid` that is True exactly there. Positions past a sequence's
                 length are padding: their slot is the sequence's position-0 slot (a real, finite key/value that
                 the attention mask then drops; a slot nobody owns may hold NaN, and 0 * NaN is NaN). Tables are
                 padded with -1 past a sequence's blocks.

The allocator grader runs random allocate / fork / free sequences against a model of who owns which block: no block
handed out twice, all-or-nothing allocation, shared blocks kept until their last owner frees them, double frees
refused, nothing leaked. The slots grader compares with its own position-by-position answer on scattered block
tables, chunked prefill, decode steps and block boundaries, on random tables and lengths, and writes and reads a
pool through your two functions step by step: what it reads back must be each sequence's tokens in order, as a
contiguous cache holds them.

task_04_real_model puts your BlockAllocator in every paged cache and your slot_mapping and context_slots in the
engine's step metadata (minillm.cache.paged_attention): minillm.generate(cache="paged") and the engine (minillm.LLM, six
requests on a six-block pool, with preemptions) must give minillm's greedy tokens. It stands on exercises 00 (norm,
RoPE, sampler) and 02/03 (the attention: the latest you wrote), minillm's where you have not.
"""

from __future__ import annotations

from collections import deque

from torch import Tensor

from minillm.cache.block_allocator import OutOfBlocksError  # noqa: F401  (the error allocate raises, given)

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
        """Take `n` free blocks (ref count 1 each). All or nothing: raises OutOfBlocksError if fewer are free.

        Blocks come from the front of the free list (the longest free first), so a freed block is reused last;
        n < 0 is a ValueError, n = 0 returns []. Example: a fresh allocator of 4 blocks: allocate(3) gives [0, 1, 2],
        then allocate(2) raises OutOfBlocksError and block 3 is still free.
        """
        raise NotImplementedError("task 04.allocator: see the docstring; `minillm hint 04 allocator` for hints")

    def _check_ids(self, block_ids: list[int]) -> None:
        for i in block_ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_blocks:
                raise ValueError(f"block id {i!r} is not a block of this pool (0..{self.num_blocks - 1})")

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 goes back on the free list.

        Checks everything before changing anything, so a bad call (a double free, an unknown id) leaves the
        allocator as it was.

        Invalid: an id that is not a block of this pool (the given _check_ids says so), and a block listed more times
        than it has owners (a double free), counting repeats within the call: ValueError. Blocks whose count
        reaches 0 go to the end of the free list, in the call's order. Example: blocks 0 and 1 allocated, block 1
        shared (ref count 2): free([0, 1]) frees block 0 (back on the list) and leaves block 1 with one owner;
        free([0]) again is a double free, and free([1, 1]) too.
        """
        raise NotImplementedError("task 04.allocator: see the docstring; `minillm hint 04 allocator` for hints")

    def incref(self, block_ids: list[int]) -> None:
        """Add an owner to each (already allocated) block: a forked sequence or a shared prefix.

        A free block (ref count 0) or an unknown id is a ValueError, and then no count changes. Example: after
        allocate(1) gave [0], incref([0]) makes ref_count(0) == 2, and two frees of block 0 are needed to free it.
        """
        raise NotImplementedError("task 04.allocator: see the docstring; `minillm hint 04 allocator` for hints")

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


# task 04.slots ---------------------------------------------------------------------------------------------

def slot_mapping(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int], block_size: int
                 ) -> list[int]:
    """The write path: the pool slot of every new token of one packed forward, in packed order (see the top).

    Example: block_size 4, tables [[7, 2], [5]], context_lens [6, 2], query_lens [3, 1]: sequence 0 writes
    positions 3, 4, 5 (slots 31, 8, 9: block 7's last slot, then block 2's first two), sequence 1 position 1 (slot
    21), so the result is [31, 8, 9, 21].
    """
    raise NotImplementedError("task 04.slots: see the docstring; `minillm hint 04 slots` for hints")


def context_slots(block_tables: Tensor, context_lens: Tensor, block_size: int, width: int) -> tuple[Tensor, Tensor]:
    """The read path: (slots (n, width) int64, valid (n, width) bool) of each sequence's positions 0 .. width - 1,
    valid where position < its context length; padding positions use the sequence's position-0 slot (see the top).

    Both tensors on block_tables' device; no Python loop over positions is needed. Example: block_size 4, tables
    [[7, 2], [5, -1]], context_lens [6, 2], width 6: slots [[28, 29, 30, 31, 8, 9], [20, 21, 20, 20, 20, 20]], valid
    [[T, T, T, T, T, T], [T, T, F, F, F, F]] (sequence 1's padding never looks up its -1 table entry).
    """
    raise NotImplementedError("task 04.slots: see the docstring; `minillm hint 04 slots` for hints")
