"""Exercise 04 (reference solutions): the block allocator, and where a token's key/value goes in the pool and is
read back from.

BlockAllocator is a verbatim copy of minillm.cache.block_allocator's, slot_mapping and context_slots of
minillm.cache.paged_attention's (see SAME_AS; tests/test_exercise_sync.py keeps them in sync).
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from minillm.cache.block_allocator import OutOfBlocksError

SAME_AS = {
    "BlockAllocator": "minillm.cache.block_allocator",
    "slot_mapping": "minillm.cache.paged_attention",
    "context_slots": "minillm.cache.paged_attention",
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


# task 04.slots ---------------------------------------------------------------------------------------------

def slot_mapping(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int], block_size: int
                 ) -> list[int]:
    """The write path: the pool slot of every new token of one packed forward, in packed order.

    Sequence i's query_lens[i] new tokens are its last positions, context_lens[i] - query_lens[i] ..
    context_lens[i] - 1 (a whole prompt, a chunk of one, or one decode token); position p lives in slot
    table[p // block_size] * block_size + p % block_size. AttentionMetadata.build checks the lists first.
    """
    slots: list[int] = []
    for table, ctx, n_new in zip(block_tables, context_lens, query_lens):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - n_new, ctx)]
    return slots


def context_slots(block_tables: Tensor, context_lens: Tensor, block_size: int, width: int) -> tuple[Tensor, Tensor]:
    """Each sequence's cached tokens as flat pool slots, in position order, padded to `width` positions.

    block_tables (n, max_blocks), context_lens (n,) -> slots (n, width) int64 indexing a layer's pool viewed as
    (num_blocks * block_size, n_kv_heads, head_dim), and valid (n, width), True at the sequence's real positions.
    Position p lives in slot table[p // block_size] * block_size + p % block_size (the module docstring's rule, for
    every position at once). Padding positions point at the sequence's position 0: a real, finite key/value the mask
    then excludes (a slot nobody owns may hold NaN, and a masked 0 weight times NaN is still NaN).
    """
    positions = torch.arange(width, device=block_tables.device)
    valid = positions < context_lens.to(block_tables.device)[:, None]  # (n, width)
    positions = torch.where(valid, positions, 0)
    blocks = block_tables.long().gather(1, positions // block_size)  # (n, width): block id of each position
    return blocks * block_size + positions % block_size, valid
