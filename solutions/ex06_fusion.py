"""Exercise 06 (reference solutions): RMSNorm with the residual add fused in, and the static KV cache that lets a
decode step compile once.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from minillm.attention import AttentionFn  # given: the attention backend's type (the static cache may ignore it)
from minillm.kv_cache import CacheFullError  # given: the error a full cache raises

SAME_AS = {
    "add_rms_norm": "minillm.compile.fusion",
    "StaticKVCache": "minillm.compile.torch_compile",
}

# task 06.add_norm -------------------------------------------------------------------------------------------


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next sublayer's input in one function, so
    the sum is formed once and normalised where it is formed (a compiler then fuses add, square, mean, rsqrt and
    scale into one kernel that reads x and residual once). The same arithmetic as rms_norm, op for op."""
    h = x + residual
    hf = h.float()  # the statistics in float32, as rms_norm: a float16 square overflows above ~256
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * weight, h


# task 06.static_cache ---------------------------------------------------------------------------------------


class StaticKVCache:
    """A contiguous cache with fixed shapes for compiled decoding: (n_layers, batch, n_kv_heads, max_len, head_dim).

    Positions are tensors end to end (no Python int derived from data), so `begin_forward` and `attend` trace into
    the graph: write k/v at `positions`, attend over all max_len slots with a mask of the keys at or before each
    query. `seq_len` is the host's count, advanced outside the compiled region by whoever drives the loop."""

    def __init__(self, cfg, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", n_layers: int | None = None):
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {max_len} is past the model's context window ({cfg.max_seq_len})")
        shape = (n_layers or cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch_size, self.max_len, self.seq_len = batch_size, max_len, 0
        self._positions: Tensor | None = None
        self._mask: Tensor | None = None

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int) -> StaticKVCache:
        return cls(model.config, batch_size, max_len, model.dtype, model.device, n_layers=len(model.layers))

    def begin_forward(self, batch: int, n_new: int, positions: Tensor | None = None) -> Tensor:
        if positions is None:  # eager use (prefill): place after what is cached, on the host
            if self.seq_len + n_new > self.max_len:
                raise CacheFullError(f"StaticKVCache holds {self.max_len} tokens; {self.seq_len} + {n_new} do not fit")
            positions = torch.arange(self.seq_len, self.seq_len + n_new, device=self.k.device)
            self.seq_len += n_new
        positions = positions.reshape(-1)[-n_new:]  # (n_new,): every row of the batch is at the same positions
        self._positions = positions
        # (n_new, max_len): query at position p sees the slots 0..p
        self._mask = torch.arange(self.max_len, device=positions.device)[None, :] <= positions[:, None]
        return positions

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionFn) -> Tensor:
        """q (b, n_heads, n_new, d), k/v (b, n_kv_heads, n_new, d); attends over the whole buffer, masked."""
        k_all, v_all = self.k[layer_id], self.v[layer_id]
        k_all.index_copy_(2, self._positions, k.to(k_all.dtype))
        v_all.index_copy_(2, self._positions, v.to(v_all.dtype))
        b, n_heads, n_new, d = q.shape
        group = n_heads // k_all.shape[1]
        if n_new == 1:  # decode: the query heads of a group become rows, so each KV head is read once (sdpa_attention)
            out = F.scaled_dot_product_attention(q.reshape(b, k_all.shape[1], group, d), k_all, v_all,
                                                 attn_mask=self._mask)
            return out.reshape(b, n_heads, 1, d)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=self._mask, enable_gqa=group > 1)

    def truncate(self, n_tokens: int) -> None:
        """Forget positions from n_tokens on: the mask hides them until they are written again."""
        if not 0 <= n_tokens <= self.seq_len:
            raise ValueError(f"can truncate to 0..{self.seq_len} tokens, got {n_tokens}")
        self.seq_len = n_tokens
