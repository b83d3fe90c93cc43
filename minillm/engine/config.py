"""EngineConfig: the serving engine's knobs in one place (lesson 05; the paged pool of lesson 04).

LLM(...) and LLM.from_model(...) take these as keywords and gather them here; the engine reads only this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.cache.block_allocator import blocks_needed
from minillm.cache.kv_pool import KVCacheSpec
from minillm.speculative.decoding import SpeculativeConfig

DEFAULT_KV_CACHE_BYTES = 256 << 20
KV_DTYPES = {None: None, "int8": torch.int8, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """num_blocks x block_size token slots of KV (or as many blocks as kv_cache_bytes holds, no more than
    max_num_seqs full contexts); a step runs at most max_num_seqs sequences and max_num_batched_tokens tokens.
    kv_cache_dtype="int8" stores the KV blocks in int8 with a scale per token and head (lesson 07);
    enable_prefix_caching reuses the KV blocks of prompt prefixes seen before (lesson 12);
    speculative=SpeculativeConfig(...) drafts and verifies several tokens per decode step (lesson 10)."""

    num_blocks: int | None = None
    kv_cache_bytes: int | None = None  # None (and no num_blocks): DEFAULT_KV_CACHE_BYTES
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    kv_cache_dtype: str | None = None  # None: the model's dtype
    enable_prefix_caching: bool = False
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be None (the model's dtype) or one of "
                             f"{list(KV_DTYPES)[1:]}, got {self.kv_cache_dtype!r}")
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be a SpeculativeConfig, got "
                            f"{type(self.speculative).__name__}")

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """What the pool stores (None: the model's dtype). A float kv dtype is storage only: attention
        computes in the model's dtype."""
        return KV_DTYPES[self.kv_cache_dtype]

    def pool_blocks(self, model) -> int:
        """The pool's size in blocks: num_blocks, or what the byte budget holds for this model."""
        num_blocks = self.num_blocks
        if num_blocks is None:  # size the pool by a byte budget, no bigger than max_num_seqs full contexts
            cfg = model.config
            budget = DEFAULT_KV_CACHE_BYTES if self.kv_cache_bytes is None else self.kv_cache_bytes
            per_block = KVCacheSpec(len(model.layers), cfg.n_kv_heads, cfg.head_dim, 1, self.block_size,
                                    model.dtype, self.kv_dtype).bytes_per_block()
            num_blocks = min(budget // per_block, self.max_num_seqs * blocks_needed(cfg.max_seq_len,
                                                                                      self.block_size))
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block of {self.block_size} tokens: raise "
                             f"kv_cache_bytes/num_blocks")
        return int(num_blocks)
