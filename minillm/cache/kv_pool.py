"""KV block storage: what a paged cache keeps its keys and values in, independent of who decides which block is whose.

Per layer a (num_blocks, block_size, n_kv_heads, head_dim) tensor for K and one for V, addressed by *slot*
(block_id * block_size + offset). The pool can store another dtype than attention computes in (`kv_dtype`): int8
with a float16 scale per token and head halves (vs bf16) the bytes decode reads per cached token (lesson 07). Moving
a request's blocks into another pool (disaggregation, lesson 13) is kv_transfer.py's pack/unpack over these tensors.
Which blocks are free is BlockAllocator's business (block_allocator.py); which block holds which token, the block
tables' (paged.py, engine/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from minillm.kv_cache import quantize_kv_int8


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of a block pool. `dtype` is what attention computes in; `kv_dtype` what the pool stores."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype | None = None  # None: same as dtype; torch.int8: quantized with a scale per token and head

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def quantized(self) -> bool:
        return not self.storage_dtype.is_floating_point

    def bytes_per_block(self) -> int:
        per_slot = self.n_kv_heads * self.head_dim * torch.empty((), dtype=self.storage_dtype).element_size()
        if self.quantized:
            per_slot += self.n_kv_heads * 2  # one float16 scale per token and head
        return 2 * self.n_layers * self.block_size * per_slot


class KVBlockPool:
    """K and V storage for every layer: (n_layers, num_blocks, block_size, n_kv_heads, head_dim), read by slot."""

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu"):
        if spec.quantized and spec.storage_dtype != torch.int8:
            raise ValueError(f"kv_dtype must be a float dtype or torch.int8, got {spec.kv_dtype}")
        shape = (spec.n_layers, spec.num_blocks, spec.block_size, spec.n_kv_heads, spec.head_dim)
        self.spec = spec
        self.k = torch.zeros(shape, dtype=spec.storage_dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.storage_dtype, device=device)
        self.k_scale = self.v_scale = None
        if spec.quantized:
            self.k_scale = torch.ones(shape[:-1], dtype=torch.float16, device=device)  # (..., n_kv_heads)
            self.v_scale = torch.ones(shape[:-1], dtype=torch.float16, device=device)

    def write(self, layer_id: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """k, v (n, n_kv_heads, head_dim) into pool slots (n,) of one layer (slot = block * block_size + offset)."""
        for pool, scale, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            flat = pool[layer_id].view(-1, *pool.shape[-2:])  # (num_blocks * block_size, n_kv_heads, head_dim)
            if scale is None:
                flat.index_copy_(0, slots, x.to(flat.dtype))
            else:
                q, s = quantize_kv_int8(x)
                flat.index_copy_(0, slots, q)
                scale[layer_id].view(-1, scale.shape[-1]).index_copy_(0, slots, s)

    def read(self, layer_id: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values at `slots` (any shape S) -> two (*S, n_kv_heads, head_dim) tensors in the compute dtype."""
        out = []
        for pool, scale in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x = pool[layer_id].view(-1, *pool.shape[-2:]).index_select(0, slots.flatten())
            if scale is not None:
                s = scale[layer_id].view(-1, scale.shape[-1]).index_select(0, slots.flatten())  # (n, n_kv_heads)
                x = x.float() * s.float()[..., None]
            out.append(x.to(self.spec.dtype).view(*slots.shape, *pool.shape[-2:]))
        return out[0], out[1]
