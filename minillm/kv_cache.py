"""The contiguous KV cache: keep every past key and value so a decode step computes one token, not the whole prefix.

Without a cache, step t of generation re-runs the model over all t tokens: O(t) work per token, O(T^2) in total.
With it, step t projects only the new token, appends its key/value, and attends over the stored ones: O(1) matmul
work per token (attention still reads all t keys, but that is a small part at this model's sizes).

The price is memory. This cache preallocates, per sequence, room for `max_len` tokens up front: simple, and exactly
the over-reservation that paged attention (lesson 04) removes. `kv_bytes_per_token` is the formula lesson 00
introduces: 2 (K and V) x layers x kv_heads x head_dim x bytes per value.

Lesson 01 measures what the cache buys; exercise 01 implements `attend`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import AttentionFn
from .config import ModelConfig


class CacheFullError(RuntimeError):
    """Raised instead of silently wrapping or truncating when a sequence outgrows its cache."""


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype | int = torch.float16) -> int:
    """Bytes of K and V that one token occupies across all layers."""
    itemsize = dtype if isinstance(dtype, int) else torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize


def kv_bytes(cfg: ModelConfig, n_tokens: int, batch: int = 1, dtype: torch.dtype | int = torch.float16) -> int:
    """Bytes of KV cache for `batch` sequences of `n_tokens` tokens each."""
    return kv_bytes_per_token(cfg, dtype) * n_tokens * batch


class KVCache:
    """Per layer a (batch, n_kv_heads, max_len, head_dim) buffer for K and one for V; all sequences in the batch
    share one length (the same prompt length, or left-aligned equal-length prompts)."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if max_len < 1 or batch_size < 1:
            raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {max_len} is past the model's context window ({cfg.max_seq_len})")
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.seq_len = 0  # positions [0, seq_len) hold valid keys/values

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int) -> "KVCache":
        return cls(model.config, batch_size, max_len, model.dtype, model.device)

    def nbytes(self) -> int:
        """Bytes reserved, used or not: the number lesson 04 compares against the paged cache."""
        return self.k.numel() * self.k.element_size() * 2

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionFn) -> Tensor:
        """Write k, v (batch, n_kv_heads, new, head_dim) after the cached positions; attend q over all of them."""
        start, end = self.seq_len, self.seq_len + k.shape[2]
        if end > self.max_len:
            raise CacheFullError(
                f"KV cache capacity is {self.max_len} tokens; writing positions {start}..{end - 1} would overflow. "
                f"Allocate the cache with a larger max_len (prompt + max_new_tokens)."
            )
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        # read only the filled prefix: slots past `end` hold zeros (or a previous request's data), never valid keys
        return attn(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end], causal=True)

    def advance(self, n_tokens: int) -> None:
        self.seq_len += n_tokens

    def reset(self) -> None:
        self.seq_len = 0
