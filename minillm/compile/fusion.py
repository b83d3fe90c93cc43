"""Operator fusion: fewer, larger ops per decode step, as transformations of a loaded model (lesson 06).

A batch-1 decode step is a long chain of small ops, each paying a dispatch (a kernel launch on a GPU) whatever
its size. `fuse_qkv` (q/k/v projections -> one matmul, split with the GQA sizes), `fuse_gate_up` (SwiGLU's
gate and up -> one) and `fuse_norms` (the residual add folded into RMSNorm, `add_rms_norm`; RoPE on q and k in
one call) remove ops without changing the math; `fuse` applies all three, in place. Fused weights are the old
ones concatenated (moved, not kept twice) and the logits match the unfused model's. `count_ops` counts what a
forward dispatches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from minillm.compress.quant import QuantizedLinear
from minillm.model import MLP, Attention, Block, apply_rope


def fuse_qkv_weights(wq: Tensor, wk: Tensor, wv: Tensor) -> Tensor:
    """(n_heads*hd, dim), (n_kv_heads*hd, dim) x2 -> (n_heads*hd + 2*n_kv_heads*hd, dim): q rows, then k, then v."""
    return torch.cat([wq, wk, wv], dim=0)


def split_qkv(qkv: Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The fused projection's output (..., (n_heads + 2*n_kv_heads) * head_dim) -> q, k, v, in the weights' order."""
    return qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next sublayer's input in one function, so
    the sum is formed once and normalised where it is formed (a compiler then fuses add, square, mean, rsqrt and
    scale into one kernel that reads x and residual once). The same arithmetic as rms_norm, op for op."""
    h = x + residual
    hf = h.float()  # the statistics in float32, as rms_norm: a float16 square overflows above ~256
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * weight, h


class FusedQKVAttention(Attention):
    """Attention whose q/k/v come from one matmul; RoPE rotates q and k together."""

    def __init__(self, attn: Attention):
        nn.Module.__init__(self)  # not Attention.__init__: the weights come from `attn`, nothing new is allocated
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.wo = attn.wo
        if isinstance(attn.wq, QuantizedLinear):  # a 4/8-bit model (lesson 07): the same rows, kept in their format
            self.wqkv = type(attn.wq).cat_rows([attn.wq, attn.wk, attn.wv])
            return
        w = fuse_qkv_weights(attn.wq.weight, attn.wk.weight, attn.wv.weight)
        self.wqkv = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        self.wqkv.weight = nn.Parameter(w, requires_grad=attn.wq.weight.requires_grad)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return split_qkv(self.wqkv(x), self.n_heads, self.n_kv_heads, self.head_dim)

    def forward(self, x, cos, sin, attn, layer_id, kv_cache):
        q, k, v = (rearrange(t, "b s (h d) -> b h s d", d=self.head_dim) for t in self.project_qkv(x))
        qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)  # one rotation for the n_heads + n_kv_heads heads
        q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
        out = attn(q, k, v, causal=True) if kv_cache is None else kv_cache.attend(layer_id, q, k, v, attn)
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))


class FusedGateUpMLP(MLP):
    """SwiGLU with gate and up in one matmul: (dim) -> (2 * ffn_dim), chunked."""

    def __init__(self, mlp: MLP):
        nn.Module.__init__(self)
        self.down = mlp.down
        if isinstance(mlp.gate, QuantizedLinear):
            self.gate_up_proj = type(mlp.gate).cat_rows([mlp.gate, mlp.up])
            return
        w = torch.cat([mlp.gate.weight, mlp.up.weight], dim=0)
        self.gate_up_proj = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        self.gate_up_proj.weight = nn.Parameter(w, requires_grad=mlp.gate.weight.requires_grad)

    def gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return gate, up

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x)
        return self.down(F.silu(gate) * up)


class FusedNormBlock(Block):
    """A block whose second RMSNorm takes the attention output and the residual together (add_rms_norm)."""

    def __init__(self, block: Block):
        nn.Module.__init__(self)
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = block.attn_norm, block.attn, block.mlp_norm, block.mlp

    def forward(self, x, cos, sin, attn, layer_id, kv_cache):
        h, x = add_rms_norm(self.attn(self.attn_norm(x), cos, sin, attn, layer_id, kv_cache), x,
                            self.mlp_norm.weight, self.mlp_norm.eps)
        return x + self.mlp(h)


def fuse_qkv(model: nn.Module) -> nn.Module:
    for block in model.layers:
        if not isinstance(block.attn, FusedQKVAttention):
            block.attn = FusedQKVAttention(block.attn)
    return model


def fuse_gate_up(model: nn.Module) -> nn.Module:
    for block in model.layers:
        if not isinstance(block.mlp, FusedGateUpMLP):
            block.mlp = FusedGateUpMLP(block.mlp)
    return model


def fuse_norms(model: nn.Module) -> nn.Module:
    model.layers = nn.ModuleList(b if isinstance(b, FusedNormBlock) else FusedNormBlock(b) for b in model.layers)
    return model


def fuse(model: nn.Module) -> nn.Module:
    """All three fusions (what `load_model(..., fuse=True)` and lesson 06's "fused" step apply)."""
    return fuse_norms(fuse_gate_up(fuse_qkv(model)))


def count_dispatched(fn, *args, **kwargs) -> int:
    """How many aten ops fn(*args, **kwargs) dispatches, under inference_mode: exact, the same on every machine."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.n += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Counter():
        fn(*args, **kwargs)
    return Counter.n


def count_ops(model: nn.Module, input_ids: Tensor, kv_cache=None, positions: Tensor | None = None) -> int:
    """How many aten ops one forward dispatches (the per-step overhead fusion and compilation remove)."""
    return count_dispatched(model, input_ids, positions=positions, kv_cache=kv_cache, last_only=True)
