"""The contiguous KV cache: keep past keys and values so a decode step computes one token, not the prefix.

`KVCache` preallocates `max_len` slots per sequence up front: simple, and exactly the over-reservation paged
attention removes (lesson 04). `kv_bytes_per_token` is 2 (K and V) x layers x kv_heads x head_dim x bytes per
value; `Int8KVCache` stores int8 with a scale per token and head (lesson 07). Lesson 01; exercise 01
implements `append_kv` and `decode_attention` (the written-out reference; the model calls its attention
backend).
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.attention import AttentionFn
from minillm.config import ModelConfig


class CacheFullError(RuntimeError):
    """Raised instead of silently wrapping or truncating when a sequence outgrows its cache."""


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype | int = torch.float16) -> int:
    """Bytes of K and V that one token occupies across all layers."""
    itemsize = dtype if isinstance(dtype, int) else torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize


def kv_bytes(cfg: ModelConfig, n_tokens: int, batch: int = 1, dtype: torch.dtype | int = torch.float16) -> int:
    """Bytes of KV cache for `batch` sequences of `n_tokens` tokens each."""
    return kv_bytes_per_token(cfg, dtype) * n_tokens * batch


def max_tokens_in_budget(cfg: ModelConfig, budget_bytes: int, dtype: torch.dtype | int = torch.float16) -> int:
    """How many cached tokens fit in `budget_bytes` of KV memory: batch x context must stay below this.

    E.g. with 2 GiB for the cache, SmolLM2-135M in fp16 (23,040 B/token) holds 93,206 tokens: a batch of 45 at
    2,048 tokens each; Llama-2-7B (524,288 B/token) holds 4,096 tokens: one sequence at its full context.
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return int(budget_bytes) // kv_bytes_per_token(cfg, dtype)


def append_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, start: int) -> int:
    """Write k, v (batch, n_kv_heads, new, head_dim) into one layer's buffers (batch, n_kv_heads, max_len, head_dim)
    at positions start .. start + new - 1; return the new filled length (start + new). If that is past the buffer's
    capacity, raise CacheFullError naming the capacity and write nothing: never wrap around or truncate."""
    end = start + k.shape[2]
    capacity = k_cache.shape[2]
    if end > capacity:
        raise CacheFullError(
            f"KV cache capacity is {capacity} tokens; writing positions {start}..{end - 1} would overflow. "
            f"Allocate the cache with a larger max_len (prompt + max_new_tokens)."
        )
    k_cache[:, :, start:end] = k
    v_cache[:, :, start:end] = v
    return end


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, n_filled: int) -> Tensor:
    """One decode step: q (batch, n_heads, 1, head_dim) attends over the first `n_filled` cached positions of
    k_cache/v_cache (batch, n_kv_heads, max_len, head_dim). Returns (batch, n_heads, 1, head_dim) in q's dtype.

    The newest token is the last query, so it may see every filled key: no causal mask. Slots from n_filled on
    were never written (zeros, or another request's keys): reading them would corrupt the softmax.
    """
    b, n_heads, q_len, d = q.shape
    n_kv_heads = k_cache.shape[1]
    if q_len != 1:
        raise ValueError(f"decode_attention takes one new token per sequence, got q_len={q_len}")
    group = n_heads // n_kv_heads
    k = k_cache[:, :, :n_filled].float()  # (b, n_kv_heads, n_filled, d): the filled prefix only
    v = v_cache[:, :, :n_filled].float()
    qg = q.float().reshape(b, n_kv_heads, group, d)  # query head h = g * group + j reads KV head g
    scores = torch.einsum("bgjd,bgnd->bgjn", qg, k) * d**-0.5  # (b, n_kv_heads, group, n_filled)
    out = torch.einsum("bgjn,bgnd->bgjd", scores.softmax(dim=-1), v)  # (b, n_kv_heads, group, d)
    return out.reshape(b, n_heads, 1, d).to(q.dtype)


class KVCache:
    """Per layer a (batch, n_kv_heads, max_len, head_dim) buffer for K and one for V; all sequences in the batch
    share one length (the same prompt length, or left-aligned equal-length prompts).

    Driven by the model (minillm.model.KVCacheLike): `begin_forward` places the forward's tokens (after what is
    cached, unless positions say otherwise), `attend` writes each layer's k/v there and attends over the filled
    prefix. `truncate(n)` forgets everything from position n on (speculative decoding's rollback, lesson 10)."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", n_layers: int | None = None, kv_dtype: torch.dtype | None = None):
        if max_len < 1 or batch_size < 1:
            raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {max_len} is past the model's context window ({cfg.max_seq_len})")
        if kv_dtype not in (None, dtype, self.storage_kind):
            raise ValueError(f"kv_dtype must be None (same as dtype) or torch.int8 (Int8KVCache), got {kv_dtype}")
        shape = (n_layers or cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.dtype = dtype
        self.k = torch.zeros(shape, dtype=self.storage_kind or dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.storage_kind or dtype, device=device)
        self.batch_size, self.max_len = batch_size, max_len
        self.seq_len = 0  # positions [0, seq_len) hold valid keys/values
        self.start = 0  # first position the current forward writes (set by begin_forward)

    storage_kind: torch.dtype | None = None  # None: keys/values stored in the model's dtype

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int, kv_dtype: torch.dtype | None = None) -> KVCache:
        # one cache layer per block the model has now (a pruned model has fewer than its config said)
        return cls(model.config, batch_size, max_len, model.dtype, model.device, n_layers=len(model.layers),
                   kv_dtype=kv_dtype)

    def nbytes(self) -> int:
        """Bytes reserved, used or not: the number lesson 04 compares against the paged cache."""
        return self.k.numel() * self.k.element_size() * 2

    def begin_forward(self, batch: int, n_new: int, positions: Tensor | None = None) -> Tensor:
        """Place n_new tokens per row at seq_len .. seq_len + n_new - 1; explicit positions must be exactly those
        (this cache has one length for every row). Raises CacheFullError, writing nothing, past capacity."""
        if batch != self.batch_size:
            raise ValueError(f"this cache holds {self.batch_size} sequences, got a batch of {batch}")
        start = self.seq_len
        if positions is not None and not torch.compiler.is_compiling():
            pos = positions.expand(batch, n_new)
            start = int(pos[0, 0])
            if start > self.seq_len or not torch.equal(pos, torch.arange(start, start + n_new, device=pos.device)
                                                       .expand(batch, n_new)):
                raise ValueError(f"KVCache holds {self.seq_len} tokens per row: the next positions must be consecutive"
                                 f" from at most {self.seq_len}, the same in every row (truncate() to go back)")
        if start + n_new > self.max_len:
            raise CacheFullError(
                f"KV cache capacity is {self.max_len} tokens; writing positions {start}..{start + n_new - 1} would "
                f"overflow. Allocate the cache with a larger max_len (prompt + max_new_tokens).")
        self.start, self.seq_len = start, start + n_new
        return torch.arange(start, start + n_new, device=self.k.device)

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionFn) -> Tensor:
        """Write k, v (batch, n_kv_heads, new, head_dim) at this forward's positions; attend q over the prefix."""
        end = append_kv(self.k[layer_id], self.v[layer_id], k, v, self.start)
        # read only the filled prefix: slots past `end` hold zeros (or a previous request's data), never valid keys
        return attn(q, self.k[layer_id, :, :, :end], self.v[layer_id, :, :, :end], causal=True)

    def truncate(self, n_tokens: int) -> None:
        """Keep positions [0, n_tokens); the next forward writes from n_tokens on (rejected draft tokens vanish)."""
        if not 0 <= n_tokens <= self.seq_len:
            raise ValueError(f"can truncate to 0..{self.seq_len} tokens, got {n_tokens}")
        self.seq_len = n_tokens

    def reset(self) -> None:
        self.seq_len = 0


def quantize_kv_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per token and head: x (..., head_dim) ~= q * s[..., None], s = max|x| / 127 in float16.

    A scale per head and token keeps one large key from flattening its neighbours; float16 (not float32) is what
    lets an int8 cache hold 1.94x (not 1.88x) the tokens of a bf16 one (lesson 07). The floor keeps s a normal
    float16 (a near-zero vector then uses fewer than 127 levels; its error stays below 3e-5)."""
    s = (x.float().abs().amax(dim=-1) / 127).clamp(min=2 ** -14).half()
    return (x.float() / s.float()[..., None]).round().clamp(-127, 127).to(torch.int8), s


class Int8KVCache(KVCache):
    """KVCache storing keys and values in int8 with a float16 scale per token and head (lesson 07): half the bytes
    of bf16 per token; attention reads them back dequantized in the model's dtype."""

    storage_kind = torch.int8

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", n_layers: int | None = None, kv_dtype: torch.dtype | None = None):
        super().__init__(cfg, batch_size, max_len, dtype, device, n_layers, kv_dtype)
        self.k_scale = torch.ones(self.k.shape[:-1], dtype=torch.float16, device=device)
        self.v_scale = torch.ones(self.v.shape[:-1], dtype=torch.float16, device=device)

    def nbytes(self) -> int:
        return super().nbytes() + 2 * self.k_scale.numel() * 2

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionFn) -> Tensor:
        start, end = self.start, self.start + k.shape[2]
        cached = []
        for store, scale, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            store[layer_id, :, :, start:end], scale[layer_id, :, :, start:end] = quantize_kv_int8(x)
            cached.append((store[layer_id, :, :, :end].float() * scale[layer_id, :, :, :end, None].float()).to(q.dtype))
        return attn(q, cached[0], cached[1], causal=True)
