"""A Llama-style decoder in plain torch, readable top to bottom; lesson 00 dissects it.

    tokens -> embedding -> n_layers x [RMSNorm -> attention (RoPE, GQA) -> + ; RMSNorm -> SwiGLU MLP -> +]
           -> RMSNorm -> LM head (tied to the embedding) -> logits

`forward` = `embed_tokens` -> `run_layers` (any slice of the blocks) -> `logits`, stages later lessons call
one by one. `Attention.forward` is the KV-cache seam (`KVCacheLike`, lessons 01, 04); the attention kernel is
a registry name (`set_attention`); weight rewrites use `replace_linears`. No requests or batches here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from minillm.attention import AttentionFn, get_attention
from minillm.config import ModelConfig


class KVCacheLike(Protocol):
    """What the model needs from a KV cache (KVCache in kv_cache.py, PagedKVCache / PagedSequenceCache in paged.py)."""

    def begin_forward(self, batch: int, n_new: int, positions: Tensor | None) -> Tensor:
        """Called once per forward before layer 0: where the n_new tokens of each of `batch` rows go. Returns the
        positions (batch, n_new) to use (a self-managed cache may fill in positions=None from its own length)."""

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionFn) -> Tensor:
        """Store k, v (batch, n_kv_heads, new, head_dim) for layer `layer_id`; return q's attention over the cache."""


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, normalised in float32, returned in x's dtype."""
    # normalise in float32: bf16's 8-bit mantissa loses the mean of squares for large activations
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def head_logits(h: Tensor, weight: Tensor) -> Tensor:
    """h (..., dim) @ weight.T: the LM head (vocab, dim), with the few-row case computed as weight @ h.T on the CPU.

    Why: a speculative verify step has 2-16 rows, and torch's CPU sgemm takes x @ W.T with 2-3 rows on a path 2-3.5x
    slower than one row for SmolLM2's 49k x 576 head (1 thread: 15 ms at 1 row, 34 ms at 2, 53 ms at 3), while
    W @ x.T streams the head once for any row count (~12 ms). Lesson 10 measures the verify cost this cuts."""
    n = h.numel() // h.shape[-1]
    if 1 < n <= 16 and h.device.type == "cpu":
        return (weight @ h.reshape(n, -1).t()).t().reshape(*h.shape[:-1], weight.shape[0])
    return F.linear(h, weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (max_len, head_dim): position p rotates dims (i, i + head_dim/2) by p * theta^(-2i/d).
    Angles in float64 (float32 ones are off by up to 5e-4 rad by position 8,192), in numpy: torch's float64 cos/sin
    paged in ~6.5 MiB of its library that nothing else runs (lesson 14's edge process counts every MiB)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(max_len, dtype=np.float64), inv_freq)  # (max_len, head_dim/2)
    angles = np.concatenate([angles, angles], axis=-1)
    device = torch.get_default_device()
    return (torch.from_numpy(np.cos(angles).astype(np.float32)).to(device),
            torch.from_numpy(np.sin(angles).astype(np.float32)).to(device))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (batch, heads, seq, head_dim); cos/sin (batch, 1, seq, head_dim). The 'rotate half' pairing (HF layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (b, s, dim) -> q (b, s, n_heads * head_dim), k, v (b, s, n_kv_heads * head_dim). The one place the three
        projections run, so fusing them into one matmul (lesson 06) replaces this method, not forward."""
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn, layer_id: int,
                kv_cache: KVCacheLike | None) -> Tensor:
        q, k, v = (rearrange(t, "b s (h d) -> b h s d", d=self.head_dim) for t in self.project_qkv(x))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is None:
            out = attn(q, k, v, causal=True)  # recompute over the whole sequence: the no-cache baseline
        else:
            out = kv_cache.attend(layer_id, q, k, v, attn)
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The two input projections, in one place so they can be fused (lesson 06)."""
        return self.gate(x), self.up(x)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn, layer_id, kv_cache):
        x = x + self.attn(self.attn_norm(x), cos, sin, attn, layer_id, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_backend: str = "sdpa"):
        super().__init__()
        self.config = cfg
        self.set_attention(attn_backend)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # on the meta device (a loader fills the weights next) they are computed on the CPU: math on meta tensors
        # imports torch._dynamo (~2 s) on first use; _apply recomputes them after any move
        with torch.device("cpu" if torch.get_default_device().type == "meta" else torch.get_default_device()):
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # lesson 06's last rung (minillm.compile.native.enable_native): every block in one C++ call, when it can
        self.native_step = None

    # ------------------------------------------------------------------------------------------------ properties

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def attn_backend(self) -> str:
        return self._attn_name

    @attn_backend.setter
    def attn_backend(self, name: str) -> None:
        self.set_attention(name)

    def set_attention(self, name: str) -> None:
        """Choose the dense attention backend by name; resolved here, once, not on every forward."""
        self._attn = get_attention(name)
        self._attn_name = name

    def limit_context(self, max_len: int) -> None:
        """Serve contexts of at most max_len tokens (below the model's window): the RoPE tables and the position
        checks stop there, as llama.cpp's n_ctx (load_model(max_context=...))."""
        if max_len < self.config.max_seq_len:
            self.config = dataclasses.replace(self.config, max_seq_len=max_len)
            self.rope_cos, self.rope_sin = self.rope_cos[:max_len].clone(), self.rope_sin[:max_len].clone()
            if self.native_step is not None:  # it points into the old tables
                self.native_step = self.native_step.rebuilt(self)

    def _apply(self, fn, recurse=True):
        # .to(dtype) casts every floating buffer; the RoPE tables must stay float32 (bf16 angles put logits off by
        # up to 0.75) and to_empty() leaves them uninitialised: recompute them after any move or cast, in one place
        super()._apply(fn, recurse)
        if self.rope_cos.device.type != "meta":
            cfg = self.config
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
        if getattr(self, "native_step", None) is not None:  # it points into the old tensors
            self.native_step = self.native_step.rebuilt(self)
        return self

    # ---------------------------------------------------------------------------------------------------- stages

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """input_ids (batch, seq) -> hidden states (batch, seq, dim)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        return self.embed(input_ids)

    def run_layers(self, h: Tensor, positions: Tensor, kv_cache: KVCacheLike | None = None,
                   layers: slice = slice(None), hidden_states: list[Tensor] | None = None) -> Tensor:
        """Run blocks self.layers[layers] over h (batch, seq, dim) at positions (batch, seq).

        Block i of self.layers uses cache layer i: a slice keeps its original indices (a pipeline stage writes its
        own layers of a shared cache). `hidden_states`, if given, receives the output of every block run."""
        if self.native_step is not None and layers == slice(None) and hidden_states is None:
            out = self.native_step(h, positions, kv_cache)  # None: a case it leaves to the eager blocks below
            if out is not None:
                return out
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]  # (b, 1, s, head_dim)
        for layer_id in range(len(self.layers))[layers]:
            h = self.layers[layer_id](h, cos, sin, self._attn, layer_id, kv_cache)
            if hidden_states is not None:
                hidden_states.append(h)
        return h

    def logits(self, h: Tensor, rows: Tensor | None = None) -> Tensor:
        """Final norm + LM head on h (batch, seq, dim), or only on h[:, rows] (the rows that will be sampled)."""
        if rows is not None:
            h = h[:, rows]
        h = self.norm(h)
        if type(self.lm_head) is nn.Linear and self.lm_head.bias is None:
            if self.native_step is not None and (out := self.native_step.head(h, self.lm_head.weight)) is not None:
                return out
            return head_logits(h, self.lm_head.weight)
        return self.lm_head(h)

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, kv_cache: KVCacheLike | None = None,
                last_only: bool = False, logits_at: Tensor | None = None,
                hidden_states: list[Tensor] | None = None) -> Tensor:
        """input_ids (batch, seq) -> logits (batch, seq, vocab), or (batch, 1, vocab) with last_only, or
        (batch, len(logits_at), vocab) with logits_at (indices along seq: the engine's last token of each sequence).

        positions (seq,) or (batch, seq): where the tokens sit. Without a cache they default to 0..seq-1; with one,
        the cache fills them in if it manages its own length (KVCache, PagedSequenceCache) and checks them.
        """
        h = self.embed_tokens(input_ids)
        b, s = input_ids.shape
        if kv_cache is not None:
            positions = kv_cache.begin_forward(b, s, positions)
        elif positions is None:
            if s > self.config.max_seq_len:
                raise ValueError(f"{s} tokens are past the context window ({self.config.max_seq_len})")
            positions = torch.arange(s, device=input_ids.device)
        elif not torch.compiler.is_compiling() and int(positions.max()) >= self.config.max_seq_len:
            raise ValueError(f"position {int(positions.max())} is past the context window ({self.config.max_seq_len})")
        h = self.run_layers(h, positions.expand(b, s), kv_cache, hidden_states=hidden_states)
        return self.logits(h, slice(-1, None) if last_only else logits_at)


# ------------------------------------------------------------------------------------------------ transformations


def replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module | None]) -> list[str]:
    """Swap nn.Linear submodules in place: `make(name, linear)` returns the replacement, or None to keep it.

    The hook every weight transformation uses (regrouping heads, quantizing, pruning, sharding). The tied LM head
    is skipped: it shares its weight with the embedding. Returns the names replaced."""
    tied = getattr(model, "lm_head", None) if getattr(getattr(model, "config", None), "tie_embeddings", False) else None
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and child is not tied:
                new = make(full, child)
                if new is not None and new is not child:
                    setattr(module, child_name, new)
                    replaced.append(full)
    return replaced


def model_bytes(model: nn.Module) -> int:
    """Bytes of the weights a forward reads: parameters and persistent buffers (a quantized layer keeps int8 weights
    and scales as buffers), each storage counted once (a tied LM head is the embedding). The RoPE tables are
    non-persistent lookup tables, not weights: left out."""
    seen, total = set(), 0
    persistent = {n for n, _ in model.named_buffers()} - {
        f"{m}.{b}".lstrip(".") for m, mod in model.named_modules() for b in mod._non_persistent_buffers_set}
    tensors = [p for p in model.parameters()] + [b for n, b in model.named_buffers() if n in persistent]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
