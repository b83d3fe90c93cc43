"""The block manager: which KV blocks each sequence owns, in verbs that read like the scheduling algorithm.

It sits on the paged cache's BlockAllocator (minillm/block_allocator.py, lesson 04) and works on plain block ids:
  can_allocate(seq) / allocate(seq)  - blocks for everything the sequence has so far (prompt, or prompt + output
                                       when a preempted sequence is recomputed), on admission;
  can_append(seq, n) / may_append(seq, n) - before a step that writes the sequence's last token and n - 1 more
                                       (n > 1: verifying draft tokens, lesson 10): they may start new blocks;
  truncate(seq, n_tokens)            - forget cached tokens from n_tokens on and free the blocks past them;
  deallocate(seq)                    - give all of its blocks back (finished, aborted or preempted).

A decode step writes the key/value of the sequence's last token (index num_tokens - 1), so it needs
ceil(num_tokens / block_size) blocks: at most one more than before, and only every block_size tokens.
That is paging's whole memory win: a sequence holds at most one partly filled block (lesson 04).
"""

from __future__ import annotations

from ..block_allocator import BlockAllocator, blocks_needed
from .sequence import Sequence


class BlockManager:
    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_size = allocator.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def num_free(self) -> int:
        return self.allocator.num_free()

    def blocks_for(self, n_tokens: int) -> int:
        return blocks_needed(n_tokens, self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.allocator.can_allocate(self.blocks_for(seq.num_tokens) - len(seq.block_table))

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens (it must hold none yet: admission or re-admission)."""
        if seq.block_table:
            raise ValueError(f"request {seq.request_id} already holds blocks {seq.block_table}")
        seq.block_table = self.allocator.allocate(self.blocks_for(seq.num_tokens))

    def can_append(self, seq: Sequence, n: int = 1) -> bool:
        """Can the next step write its n tokens? Needs free blocks only where the last one fills up."""
        missing = self.blocks_for(seq.num_tokens + n - 1) - len(seq.block_table)
        return missing <= 0 or self.allocator.can_allocate(missing)

    def may_append(self, seq: Sequence, n: int = 1) -> None:
        """Grow the block table if the n tokens about to be written start new blocks."""
        missing = self.blocks_for(seq.num_tokens + n - 1) - len(seq.block_table)
        if missing > 0:
            seq.block_table += self.allocator.allocate(missing)

    def truncate(self, seq: Sequence, n_tokens: int) -> None:
        """Keep the KV of seq's first n_tokens (speculative rollback): later blocks return to the pool."""
        if not 0 <= n_tokens <= seq.num_cached_tokens:
            raise ValueError(f"request {seq.request_id}: can keep 0..{seq.num_cached_tokens} cached tokens, "
                             f"got {n_tokens}")
        keep = self.blocks_for(n_tokens)
        self.allocator.free(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.num_cached_tokens = n_tokens

    def deallocate(self, seq: Sequence) -> None:
        """Return every block of `seq`; its cached keys/values are gone (a re-admission recomputes them)."""
        if seq.block_table:
            self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0
