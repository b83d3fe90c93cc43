"""Attention backends behind one signature, in one registry, selectable by name (lesson 03).

Every backend computes softmax(q k^T / sqrt(d)) v on (batch, heads, len, head_dim) tensors, with GQA and a
causal mask aligned bottom-right (the contract is spelt out above `AttentionFn`). "dense" backends take
contiguous k/v: `naive` materialises the score matrix (the reference), `sdpa` is torch's fused kernel (the
default and the oracle), `flash` and `triton` tile it; "paged_decode" backends read a paged cache's blocks
(lesson 04). `register_attention`, `get_attention`; optional backends are "module:function" strings imported
on first use, and a model resolves its backend once (`Transformer.set_attention`), never per forward.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# The contract every backend keeps:
#   q (batch, n_heads, q_len, head_dim); k, v (batch, n_kv_heads, kv_len, head_dim); n_kv_heads divides
#   n_heads (GQA) and query head h reads KV head h // (n_heads // n_kv_heads).
#   causal=True aligns the mask bottom-right: the q_len queries are the *last* q_len of the kv_len positions,
#   so query i sees keys j <= i + (kv_len - q_len). One rule for prefill (q_len == kv_len), decode
#   (q_len == 1) and a prompt chunk over a cache.
#   return_lse=True (only where Backend.supports_lse) also returns each query row's log-sum-exp,
#   (batch, n_heads, q_len) float32: what merging attention over split key sets needs (split-KV decode,
#   ring attention; flash.merge_partials).
#   "paged_decode" backends: fn(q, k_pool_layer, v_pool_layer, block_tables, context_lens), one query per
#   sequence.
AttentionFn = Callable[..., Tensor]


@dataclass
class Backend:
    name: str
    target: str | AttentionFn  # the function, or "module:function" to import on first use
    kind: str = "dense"  # "dense" | "paged_decode"
    supports_lse: bool = False
    doc: str = ""

    def resolve(self) -> AttentionFn:
        if isinstance(self.target, str):
            module, fn = self.target.split(":")
            self.target = getattr(importlib.import_module(module), fn)
        return self.target


_REGISTRY: dict[str, Backend] = {}


def register_attention(name: str, target: str | AttentionFn, kind: str = "dense", supports_lse: bool = False,
                       doc: str = "") -> None:
    """Add (or replace) a backend. Later lessons register theirs; a name is unique across kinds."""
    if kind not in ("dense", "paged_decode"):
        raise ValueError(f"kind must be 'dense' or 'paged_decode', got {kind!r}")
    _REGISTRY[name] = Backend(name, target, kind, supports_lse, doc)


def backend_names(kind: str = "dense") -> list[str]:
    return sorted(n for n, b in _REGISTRY.items() if b.kind == kind)


def get_backend(name: str, kind: str = "dense") -> Backend:
    backend = _REGISTRY.get(name)
    if backend is None or backend.kind != kind:
        raise ValueError(f"unknown {kind} attention backend {name!r}; choose one of {backend_names(kind)}")
    return backend


def get_attention(name: str, kind: str = "dense") -> AttentionFn:
    """The function registered as `name` (imported now if it was registered lazily)."""
    return get_backend(name, kind).resolve()


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


# Which runs where: generate() uses the model's dense backend (default sdpa) over the contiguous cache. The
# engine's prompt chunks use it too, over each sequence's gathered context; its decode rows use the paged
# cache's "auto" choice (not a registry entry): gathered_decode_attention on a CPU, "triton_paged" on a GPU.
register_attention("naive", naive_attention, doc="reference: materialises the score matrix (lesson 03)")
register_attention("sdpa", sdpa_attention, doc="torch's fused scaled_dot_product_attention (the default)")
register_attention("flash", "minillm.attention.flash:flash_attention", supports_lse=True,
                   doc="tiled online-softmax in torch (lesson 03)")
register_attention("triton", "minillm_kernels.flash_attn:triton_attention", doc="Triton flash kernel (lesson 03)")
register_attention("torch", "minillm.cache.paged_attention:paged_attention", kind="paged_decode",
                   doc="readable reference gather (lesson 04)")
register_attention("triton_paged", "minillm_kernels.paged_decode:triton_paged_decode", kind="paged_decode",
                   doc="Triton paged decode kernel (GPU)")
