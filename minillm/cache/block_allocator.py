"""The block allocator behind the paged KV cache (lesson 04): fixed-size blocks, a free list, ref counts.

The KV pool is `num_blocks` blocks of `block_size` token slots; a sequence grows its list of block ids (its
block table) a block at a time, so it never reserves more than one partly filled block. `BlockAllocator` is
the bookkeeping on plain ints: all-or-nothing `allocate`, `free` (a double free raises), `incref` to share a
block. `BlockTable` is one sequence's ids over it (grow, truncate, free), used by the block manager,
PagedSequenceCache and the draft model. Tensors live in kv_pool.py. Exercise 04 asks you to write it.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than asked for. Nothing was allocated."""


def blocks_needed(n_tokens: int, block_size: int) -> int:
    """Blocks that hold `n_tokens` tokens: ceil(n_tokens / block_size)."""
    if n_tokens < 0 or block_size < 1:
        raise ValueError(f"need n_tokens >= 0 and block_size >= 1, got {n_tokens}, {block_size}")
    return -(-n_tokens // block_size)


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


class BlockTable:
    """One sequence's KV block ids, in token order: position p lives in block block_ids[p // block_size].

    It grows a block at a time (`grow(n_tokens)` takes only the blocks n_tokens need beyond those it
    holds, all or nothing), gives back the blocks past a shorter length (`truncate`, speculative rollback)
    and frees everything (`free`, tail first: with prefix caching a chain's tail is evicted before its
    head). `block_ids` may be a list the caller owns (a Sequence's block_table): it is changed in place."""

    def __init__(self, allocator: BlockAllocator, block_ids: list[int] | None = None):
        self.allocator = allocator
        self.block_ids = [] if block_ids is None else block_ids

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def __len__(self) -> int:
        return len(self.block_ids)

    def missing(self, n_tokens: int) -> int:
        """Blocks to add before the table holds n_tokens tokens (0 if it already does)."""
        return max(blocks_needed(n_tokens, self.block_size) - len(self.block_ids), 0)

    def can_grow(self, n_tokens: int) -> bool:
        missing = self.missing(n_tokens)
        return missing == 0 or self.allocator.can_allocate(missing)

    def grow(self, n_tokens: int) -> None:
        """Take the blocks n_tokens tokens need (OutOfBlocksError, and none taken, if too few are free)."""
        missing = self.missing(n_tokens)
        if missing:
            self.block_ids += self.allocator.allocate(missing)

    def truncate(self, n_tokens: int) -> None:
        """Keep the blocks of positions [0, n_tokens); those wholly past them go back to the allocator."""
        keep = blocks_needed(n_tokens, self.block_size)
        self.allocator.free(self.block_ids[keep:])
        del self.block_ids[keep:]

    def free(self) -> None:
        """Give every block back, tail first."""
        if self.block_ids:
            self.allocator.free(self.block_ids[::-1])
        self.block_ids.clear()

    def __repr__(self) -> str:
        return f"BlockTable({self.block_ids})"
