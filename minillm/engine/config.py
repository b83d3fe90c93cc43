"""EngineConfig: the serving engine's knobs in one place (lesson 05; the paged pool of lesson 04).

LLM(...) and LLM.from_model(...) take these as keywords and gather them here; the engine reads only this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.cache.block_allocator import blocks_needed
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
            cfg = model.config.with_(n_layers=len(model.layers))  # the layers this model holds are the ones cached
            budget = DEFAULT_KV_CACHE_BYTES if self.kv_cache_bytes is None else self.kv_cache_bytes
            try:
                fits = kv_blocks_for_budget(cfg, budget, 0, self.block_size, self.kv_cache_dtype, model.dtype)
            except ValueError:
                fits = 0  # refused below, in the words of this knob
            num_blocks = min(fits, self.max_num_seqs * blocks_needed(cfg.max_seq_len, self.block_size))
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block of {self.block_size} tokens: raise "
                             f"kv_cache_bytes/num_blocks")
        return int(num_blocks)


def kv_blocks_for_budget(model_config, memory_budget_bytes: int, weight_bytes: int, block_size: int = 16,
                         kv_cache_dtype: str | None = None, model_dtype: torch.dtype = torch.float32) -> int:
    """How many KV blocks of `block_size` tokens fit in what `memory_budget_bytes` leaves after `weight_bytes` of
    weights (lesson 14: a device's memory holds the weights and the KV pool, nothing is free).

    The layout is the engine pool's (cache/kv_pool.py, whose KVCacheSpec.bytes_per_block states it from the pool's
    side): K and V, in every layer, a (n_kv_heads, head_dim) slice per token, stored in kv_cache_dtype (None: the
    model's dtype); int8 adds a float16 scale per token and head. Only whole blocks can be allocated, so the count
    rounds down. Raises ValueError, saying what to change, when the weights alone exceed the budget or what is left
    holds no block."""
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be None (the model's dtype) or one of {list(KV_DTYPES)[1:]}, got "
                         f"{kv_cache_dtype!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    storage = KV_DTYPES[kv_cache_dtype] or model_dtype
    per_token_head = model_config.head_dim * torch.empty((), dtype=storage).element_size()
    if not storage.is_floating_point:
        per_token_head += 2  # its float16 scale: int8 codes mean nothing without it
    per_block = 2 * model_config.n_layers * block_size * model_config.n_kv_heads * per_token_head  # K and V
    left = memory_budget_bytes - weight_bytes
    if left < 0:
        raise ValueError(f"the weights ({weight_bytes:,} bytes) exceed the memory budget ({memory_budget_bytes:,}): "
                         f"load smaller weights (weights='q4' or 'int8') or raise the budget")
    if left < per_block:
        raise ValueError(f"the {left:,} bytes the budget leaves after the weights hold no KV block of {block_size} "
                         f"tokens ({per_block:,} bytes): store the KV in int8 (kv_cache_dtype='int8'), load smaller "
                         f"weights, use smaller blocks or raise the budget")
    return left // per_block
