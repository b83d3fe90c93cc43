"""Attention backends behind one signature, selectable by name.

Every backend computes softmax(q k^T / sqrt(d)) v with the same conventions:
  q: (batch, n_heads, q_len, head_dim)      k, v: (batch, n_kv_heads, kv_len, head_dim)
  n_kv_heads divides n_heads (GQA): query head h reads KV head h // (n_heads // n_kv_heads).
  causal=True aligns the mask bottom-right: the q_len queries are the *last* q_len positions of the kv_len keys,
  so query i may see keys j <= i + (kv_len - q_len). That one rule covers prefill (q_len == kv_len), decode
  (q_len == 1 sees everything) and chunked prefill over a cache.

`naive` is the reference (it materialises the q_len x kv_len score matrix, lesson 03 measures that cost), `sdpa`
is torch's fused kernel and serves as the outside oracle. `flash` and `triton` are added by lesson 03's modules and
looked up lazily, so this file never imports them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

AttentionFn = Callable[..., Tensor]

# name -> "module:function", imported on first use so optional backends (triton) cost nothing until asked for
_BACKENDS: dict[str, str] = {
    "naive": "minillm.attention:naive_attention",
    "sdpa": "minillm.attention:sdpa_attention",
    "flash": "minillm.flash:flash_attention",
    "triton": "minillm_kernels.flash_attn:triton_attention",
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_attention(name: str) -> AttentionFn:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {backend_names()}")
    module, fn = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), fn)


def check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise a clear error for inputs no backend can take."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"expected 4-d (batch, heads, seq, head_dim) tensors, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"batch/head_dim mismatch between q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"n_kv_heads={k.shape[1]} must divide n_heads={q.shape[1]}")
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"q_len {q.shape[2]} > kv_len {k.shape[2]}: queries must be the last kv positions")


def causal_mask(q_len: int, kv_len: int, device=None) -> Tensor:
    """Bool (q_len, kv_len), True where query i may attend key j (bottom-right aligned)."""
    i = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= i


def repeat_kv(x: Tensor, group: int) -> Tensor:
    """(b, h_kv, s, d) -> (b, h_kv * group, s, d): KV head g serves query heads g*group ... g*group+group-1."""
    if group == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, group, s, d).reshape(b, h * group, s, d)


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    check_shapes(q, k, v)
    group = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # (b, h, q_len, kv_len): the O(N^2)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    check_shapes(q, k, v)
    q_len, kv_len = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if q_len == 1 and gqa:
        # decode with GQA: fold each group of query heads into the query-length dim, (b, h, 1, d) -> (b, h_kv, group,
        # d), so each KV head is read once for its whole group (exact: one query sees every key). torch's enable_gqa
        # path on CPU costs as much as MHA here (lesson 02 measures it)
        b, h, _, d = q.shape
        out = F.scaled_dot_product_attention(q.reshape(b, k.shape[1], h // k.shape[1], d), k, v)
        return out.reshape(b, h, 1, d)
    if not causal or q_len == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # torch's is_causal aligns top-left; a chunk of queries over a longer cache needs the explicit mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q_len, kv_len, q.device), enable_gqa=gqa)
