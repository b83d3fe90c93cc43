"""A Llama-style decoder in plain torch, readable top to bottom (lesson 00 dissects it).

    tokens -> embedding -> n_layers x [RMSNorm -> attention (RoPE, GQA) -> + ; RMSNorm -> SwiGLU MLP -> +]
           -> RMSNorm -> LM head (tied to the embedding) -> logits

The one seam later lessons plug into is in `Attention.forward`: after projecting and rotating q/k/v it either runs
plain causal attention over the tokens it was given, or hands q/k/v to a KV cache object, which stores the new keys and
values wherever it keeps them (a contiguous buffer, lesson 01; paged blocks, lesson 04) and returns the attention
output over everything cached. Which attention kernel runs is a name (`model.attn_backend`, see attention.py).
The model never knows about requests, batches or schedules.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .attention import AttentionFn, get_attention
from .config import ModelConfig


class KVCacheLike(Protocol):
    """What the model needs from a KV cache (minillm.kv_cache.KVCache and minillm.paged.PagedKVCache provide it)."""

    seq_len: int  # tokens already cached; the default position of the next token

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionFn) -> Tensor:
        """Store k, v (batch, n_kv_heads, new, head_dim); return attention of q over all cached keys."""
        ...

    def advance(self, n_tokens: int) -> None: ...


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, normalised in float32, returned in x's dtype."""
    # normalise in float32: bf16's 8-bit mantissa loses the mean of squares for large activations
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (max_len, head_dim): position p rotates dims (i, i + head_dim/2) by p * theta^(-2i/d)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # (max_len, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (batch, heads, seq, head_dim); cos/sin (batch, 1, seq, head_dim). The 'rotate half' pairing (HF layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads, self.head_dim = layer, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn, kv_cache: KVCacheLike | None) -> Tensor:
        q = rearrange(self.wq(x), "b s (h d) -> b h s d", d=self.head_dim)
        k = rearrange(self.wk(x), "b s (h d) -> b h s d", d=self.head_dim)
        v = rearrange(self.wv(x), "b s (h d) -> b h s d", d=self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is None:
            out = attn(q, k, v, causal=True)  # recompute over the whole sequence: the no-cache baseline
        else:
            out = kv_cache.attend(self.layer, q, k, v, attn)
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn, kv_cache):
        x = x + self.attn(self.attn_norm(x), cos, sin, attn, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: str = "sdpa"):
        super().__init__()
        self.config = cfg
        self.attn_backend = attn_backend
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, kv_cache: KVCacheLike | None = None,
                last_only: bool = False, logits_at: Tensor | None = None) -> Tensor:
        """input_ids (batch, seq) -> logits (batch, seq, vocab), or (batch, 1, vocab) with last_only, or
        (batch, len(logits_at), vocab) with logits_at (indices along seq: the engine's last token of each sequence).

        positions (seq,) or (batch, seq) default to the tokens following what `kv_cache` already holds.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        if positions is None:
            start = kv_cache.seq_len if kv_cache is not None else 0
            positions = torch.arange(start, start + s, device=input_ids.device)
        if int(positions.max()) >= self.config.max_seq_len:
            raise ValueError(f"position {int(positions.max())} is past the context window ({self.config.max_seq_len})")
        positions = positions.expand(b, s)
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]  # (b, 1, s, head_dim)
        attn = get_attention(self.attn_backend)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(s)
        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:  # packed batches (engine): only each sequence's last row needs the LM head
            x = x[:, logits_at]
        return self.lm_head(self.norm(x))
