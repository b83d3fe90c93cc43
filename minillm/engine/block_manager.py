"""The block manager (lesson 05): which KV blocks each sequence owns, in verbs that read like the scheduler.

On the engine's BlockAllocator (lesson 04), shared with the paged cache, it keeps each sequence's `block_table`:
`can_allocate` / `allocate` on admission (prompt, or prompt + output after a preemption), `can_append` /
`may_append` before a step writes new tokens (several with drafts, lesson 10), `truncate` (speculative rollback),
`deallocate`, `cache_blocks` (prefix caching, lesson 12). With a PrefixCachingAllocator `allocate` shares the
longest cached prefix: prefix caching changes what "allocate" finds, not the scheduling algorithm.
"""

from __future__ import annotations

from minillm.cache.block_allocator import BlockAllocator, BlockTable, blocks_needed
from minillm.cache.prefix_cache import block_hashes
from minillm.engine.sequence import Sequence


class BlockManager:
    def __init__(self, allocator: BlockAllocator, prefix_caching: bool = False):
        """prefix_caching=True needs an allocator that registers and matches blocks (PrefixCachingAllocator, or
        exercise 12's): the engine builds both from one setting."""
        if prefix_caching and not all(callable(getattr(allocator, m, None)) for m in ("match", "acquire", "register")):
            raise TypeError(f"prefix_caching=True needs an allocator with match(), acquire() and register() (a "
                            f"PrefixCachingAllocator), got {type(allocator).__name__}")
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.prefix_caching = prefix_caching

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def num_free(self) -> int:
        return self.allocator.num_free()

    def blocks_for(self, n_tokens: int) -> int:
        return blocks_needed(n_tokens, self.block_size)

    def table(self, seq: Sequence) -> BlockTable:
        """seq's block table over this manager's allocator (it changes seq.block_table in place)."""
        return BlockTable(self.allocator, seq.block_table)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks of seq's longest cached prefix, stopping before its last token ([] without caching)."""
        if not self.prefix_caching:
            return []
        seq.block_hashes = block_hashes(seq.all_ids, self.block_size, seq.block_hashes)
        return self.allocator.match(seq.block_hashes[:(seq.num_tokens - 1) // self.block_size])

    def can_allocate(self, seq: Sequence) -> bool:
        source = seq.prefix_source
        if self.prefix_caching and source is not None and not (source.num_output_tokens or source.is_finished):
            return False  # n samples of a prompt: wait for sample 0 to compute (and cache) it, then share its blocks
        hit = self._cached_prefix(seq)
        unowned_hits = sum(self.allocator.ref_count(b) == 0 for b in hit)  # taking them uses up free blocks
        return self.allocator.can_allocate(self.blocks_for(seq.num_tokens) - len(seq.block_table) - len(hit)
                                           + unowned_hits)

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens (it must hold none yet: admission or re-admission). With prefix
        caching, its cached prefix's blocks are shared and count as computed (num_cached_tokens): the n samples of
        one prompt are admitted once the first has computed it, so the prompt runs once."""
        if seq.block_table:
            raise ValueError(f"request {seq.request_id} already holds blocks {seq.block_table}")
        hit = self._cached_prefix(seq)
        table = self.table(seq)
        if hit:
            self.allocator.acquire(hit)  # before allocating: allocation may evict unowned cached blocks
            table.block_ids += hit
        try:
            table.grow(seq.num_tokens)
        except Exception:
            table.free()  # all or nothing: give the shared blocks back
            raise
        seq.num_cached_tokens = len(hit) * self.block_size
        seq.num_named_blocks = len(hit)
        if self.prefix_caching:
            stats = self.allocator.stats
            stats.num_requests += 1
            stats.query_tokens += seq.num_tokens
            stats.hit_tokens += seq.num_cached_tokens

    def can_append(self, seq: Sequence, n: int = 1) -> bool:
        """Can the next step write its n tokens? Needs free blocks only where the last one fills up."""
        # the step writes the KV of the last sampled token (index num_tokens - 1) and of n - 1 drafts after it
        return self.table(seq).can_grow(seq.num_tokens + n - 1)

    def may_append(self, seq: Sequence, n: int = 1) -> None:
        """Grow the block table if the n tokens about to be written start new blocks."""
        self.table(seq).grow(seq.num_tokens + n - 1)

    def truncate(self, seq: Sequence, n_tokens: int) -> None:
        """Keep the KV of seq's first n_tokens (speculative rollback): later blocks return to the pool."""
        if not 0 <= n_tokens <= seq.num_cached_tokens:
            raise ValueError(f"request {seq.request_id}: can keep 0..{seq.num_cached_tokens} cached tokens, "
                             f"got {n_tokens}")
        if n_tokens < seq.num_named_blocks * self.block_size:  # a cached block may be shared: it never changes
            raise ValueError(f"request {seq.request_id}: its first {seq.num_named_blocks} blocks are in the prefix "
                             f"cache; cannot truncate to {n_tokens} tokens")
        self.table(seq).truncate(n_tokens)
        seq.num_cached_tokens = n_tokens

    def cache_blocks(self, seq: Sequence) -> None:
        """Name seq's full blocks whose every token is computed: from now on they can serve other requests."""
        n_full = min(seq.num_cached_tokens // self.block_size, len(seq.block_table))
        if not self.prefix_caching or n_full <= seq.num_named_blocks:
            return
        seq.block_hashes = block_hashes(seq.all_ids, self.block_size, seq.block_hashes)
        # a named block is full and computed, so nobody writes it again: sharing it needs no copy-on-write
        for i in range(seq.num_named_blocks, n_full):
            self.allocator.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_named_blocks = n_full

    def deallocate(self, seq: Sequence) -> None:
        """Return every block of `seq`; its cached keys/values are gone (a re-admission recomputes them), unless
        prefix caching keeps its full blocks findable, the tail's first in line for eviction."""
        if seq.block_table:
            self.cache_blocks(seq)
        self.table(seq).free()  # tail first
        seq.num_cached_tokens = 0
        seq.num_named_blocks = 0
