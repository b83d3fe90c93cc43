"""The paged KV cache and what stands on its blocks: allocator and block table, pool, paged attention, prefix
cache, KV transfer (lessons 04, 12, 13)."""
