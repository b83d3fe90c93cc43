"""Exercise 12: prefix caching (lesson 12, "serving": vLLM's automatic prefix caching).

Requests that start the same way (a shared system prompt, a document, the earlier turns of a chat) would prefill the
same tokens again and again. Keys and values depend only on the tokens up to them, so a full KV block computed for
one request is exactly the block another request with the same prefix would compute: name every full block by its
whole prefix, keep it after its owners finish, and look it up. Write the names, the lookup and the eviction, then
grade your work:

    minillm grade 12

- 12.hash: `hash_block(parent, tokens)` names one full block: the SHA-256 digest (32 bytes) of the parent block's
  name followed by the block's token ids as 4-byte little-endian signed ints (int32; the stdlib's array type
  with code "i" lays them out so). A sequence's first block has the parent ROOT_HASH = bytes(32).
  `block_hashes(token_ids, block_size, known)` chains them: name[i] = hash_block(name[i - 1], block i's tokens), one
  name per *full* block (a partly filled last block is still being written: it has none). `known` holds names
  already computed for the first blocks (a growing sequence extends its list instead of rehashing its prompt at
  every step): keep them as they are and continue the chain from the last one. The chain makes equal names mean
  equal prefixes: one differing token changes its block's name and every name after it.
- 12.match: `match(hashes)` returns the blocks of the longest cached prefix of `hashes`: look the names up in order
  and stop at the first one not cached. A later name that is cached is of no use: the blocks before it would have
  to be recomputed anyway, and the engine reads a sequence's blocks from its first. match only looks: it changes no
  ref count and no LRU order. `acquire(blocks)` makes the caller one more owner of each block match found; an
  unowned one leaves the LRU list (it can no longer be evicted). A block without a name cannot be acquired
  (ValueError, nothing changed).
- 12.lru: a named block whose last owner frees it keeps its KV: `free` puts it at the end of `_evictable` (the LRU
  list: least recently freed first, in the order of the call's block ids: the BlockManager frees a sequence tail
  first, so a chain loses its tail before its head), an unnamed one goes back on `_free`. `allocate` hands out
  never-named free blocks first and only then `_evict`s the least recently freed cached block, which forgets its
  name in both directions (its KV is about to be overwritten: a later match must not find it). `num_free` counts
  both kinds of unowned blocks. allocate is all or nothing (OutOfBlocksError, nothing changed); free refuses a
  double free and then changes nothing (BlockAllocator.free, via super(), checks everything before it changes
  anything).

Every block is in exactly one of three states, kept in the structures __init__ gives you (the graders read them):
free and unnamed (in `_free`, ref count 0), owned (ref count >= 1, named or not), or unowned but named (in
`_evictable`, ref count 0). `_block_of` (name -> block) and `_name_of` (block -> name) hold the names; `register`
(given) names a full, computed, owned block.

The graders compare with oracles written out in the grader: the names against SHA-256 computed there and against
their rules one by one on random token lists and block sizes (hypothesis); match and acquire on crafted caches and
through the engine's BlockManager (identical prefixes share blocks, one differing token stops the sharing from its
block on, a partial block is never shared); allocate / free / eviction on crafted sequences (which block is evicted,
and when) and on random ones against a model of the three states. While one task is graded, the other task's methods
are the grader's own, so the tasks can be done in any order. The real-model task puts your block_hashes (with your
hash_block) into the engine's BlockManager and your PrefixCachingAllocator into its paged cache
(LLM.from_model(..., enable_prefix_caching=True)): SmolLM2-135M serves chat requests that share a system prompt on a
pool small enough to evict, with exactly the greedy tokens of the engine without prefix caching, the prefix hits and
evictions of minillm's own cache, and every block back at the end. Calling minillm.cache.prefix_cache is rejected.
"""

from __future__ import annotations

import hashlib  # noqa: F401  (you will need these)
from array import array  # noqa: F401
from collections import OrderedDict
from collections.abc import Sequence

from minillm.cache.block_allocator import BlockAllocator, OutOfBlocksError  # noqa: F401  (the base class, given; the error)
from minillm.cache.prefix_cache import ROOT_HASH, PrefixCacheStats  # noqa: F401  (bytes(32), and the engine's counters)

# task 12.hash -------------------------------------------------------------------------------------------------


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a full block: SHA-256 over its parent's name and its token ids (int32 each).

    32 bytes: the digest of the parent's bytes followed by each id as 4 little-endian signed bytes. Deterministic
    across processes and machines (no salted hash()), and ids >= 256 must not collide with smaller ones. Example:
    hash_block(ROOT_HASH, [1, 2]) is the SHA-256 of 32 zero bytes then 01 00 00 00 02 00 00 00; [1, 2] and
    [1, 2 + 256] get different names, and the same tokens under another parent get another name.
    """
    raise NotImplementedError("task 12.hash: see the docstring; `minillm hint 12 hash` for hints")


def block_hashes(token_ids: Sequence[int], block_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """Chained names of the full blocks of token_ids (a partial last block has none). `known`: names already
    computed for its first blocks (a growing sequence extends its list instead of rehashing everything).

    One name per full block: len(token_ids) // block_size of them; block i's parent is name i - 1, block 0's is
    ROOT_HASH. The names in `known` are kept as they are (not recomputed) and the chain continues from the last one.
    Example: block_size 2, token_ids [5, 6, 7, 8, 9]: [n0, n1] with n0 = hash_block(ROOT_HASH, [5, 6]) and n1 =
    hash_block(n0, [7, 8]); token 9 has no name yet. With known = [n0], the same [n0, n1], hashing only [7, 8].
    """
    raise NotImplementedError("task 12.hash: see the docstring; `minillm hint 12 hash` for hints")


# tasks 12.match (match, acquire) and 12.lru (num_free, allocate, _evict, free) ----------------------------------


class PrefixCachingAllocator(BlockAllocator):
    """A BlockAllocator whose named blocks outlive their owners: findable by hash until LRU eviction reuses them.

    Every block is in exactly one of three states: free and unnamed (`_free`), owned (ref count >= 1, named or not),
    or unowned but named (`_evictable`, least recently freed first). num_free() counts both unowned kinds: a cached
    block is memory the pool can hand out at any time."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self._block_of: dict[bytes, int] = {}  # name -> block
        self._name_of: dict[int, bytes] = {}  # block -> name
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unowned named blocks, oldest first
        self.stats = PrefixCacheStats()

    def num_free(self) -> int:
        """Blocks nobody owns: the never-named ones in `_free` plus the cached ones in `_evictable` (a cached block
        is memory the pool can hand out at any time). Example: 10 blocks, 3 owned, 2 cached and unowned: 7."""
        raise NotImplementedError("task 12.lru: see the docstring; `minillm hint 12 lru` for hints")

    def num_used(self) -> int:
        return self.num_blocks - self.num_free()

    def num_cached(self) -> int:
        return len(self._block_of)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free()

    def allocate(self, n: int = 1) -> list[int]:
        """n blocks (ref count 1, unnamed): never-named free blocks first, then the least recently freed cached ones.

        All or nothing: n < 0 is a ValueError, n > num_free() an OutOfBlocksError, both before any change. Each
        cached block handed out is evicted (_evict: its name forgotten, stats.evictions + 1). Example: _free = [4],
        _evictable = [2 (freed first), 7]: allocate(2) gives [4, 2], block 2's name is gone (a later match no longer
        finds it), block 7 stays cached, stats.evictions is 1.
        """
        raise NotImplementedError("task 12.lru: see the docstring; `minillm hint 12 lru` for hints")

    def _evict(self) -> int:
        """Reuse the least recently freed cached block: its name is forgotten, its contents will be overwritten.

        Takes the oldest entry of `_evictable`, removes its name from both `_name_of` and `_block_of`, counts one
        eviction in `stats`, and returns the block (its ref count is the caller's to set). Example: _evictable [2, 7]
        -> returns 2; _evictable is [7]; neither dict mentions block 2 or its name.
        """
        raise NotImplementedError("task 12.lru: see the docstring; `minillm hint 12 lru` for hints")

    def free(self, block_ids: list[int]) -> None:
        """Drop one owner per block. A block left without owners keeps its KV if it is named (most recently freed
        last in the LRU order); an unnamed one goes back on the free list.

        BlockAllocator.free (reach it through super()) does the checks (unknown id, double free: ValueError, nothing
        changed) and the ref counts, and puts every block left without owners at the end of `_free`, in the call's
        order. Of those, each named one must then move to the end of `_evictable` instead, in the same order; the
        unnamed ones stay free. Example: blocks 3 (named) and 5 (unnamed), one owner each: free([3, 5]) leaves
        _evictable ending with 3, and 5 at the end of _free; num_free() grew by 2.
        """
        raise NotImplementedError("task 12.lru: see the docstring; `minillm hint 12 lru` for hints")

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`: stops at the first name not in the cache.

        Only looks: no ref count and no LRU position changes. Example: names a, b, c cached in blocks 4, 1, 9 and d
        not: match([a, b, d, c]) is [4, 1] (c comes after a miss: of no use); match([d, a]) is [].
        """
        raise NotImplementedError("task 12.match: see the docstring; `minillm hint 12 match` for hints")

    def acquire(self, block_ids: list[int]) -> None:
        """Become one more owner of cached blocks found by `match` (an unowned one leaves the LRU list).

        Every block must be named (else ValueError, nothing changed); each gains one owner, and one that had none
        leaves `_evictable`, so it can no longer be evicted. Example: block 4 cached and unowned, block 1 cached and
        owned once: acquire([4, 1]) gives ref counts 1 and 2, and 4 is no longer in _evictable; acquire([6]) with
        block 6 unnamed raises.
        """
        raise NotImplementedError("task 12.match: see the docstring; `minillm hint 12 match` for hints")

    def register(self, block: int, name: bytes) -> bool:
        """Name a full, fully computed, owned block. False (and nothing changes) if the block already has a name or
        another block already holds this prefix (two requests computed it at once: the first one stays cached)."""
        self._check_ids([block])
        if self._ref_counts[block] == 0:
            raise ValueError(f"block {block} is free; only an owned block with computed contents can be cached")
        if block in self._name_of or name in self._block_of:
            return False
        self._block_of[name], self._name_of[block] = block, name
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._name_of

    def reset(self) -> None:
        super().reset()
        self._block_of.clear()
        self._name_of.clear()
        self._evictable.clear()
        self.stats = PrefixCacheStats()

    def __repr__(self) -> str:
        return (f"PrefixCachingAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={len(self._free)}, cached={self.num_cached()}, evictable={len(self._evictable)})")
