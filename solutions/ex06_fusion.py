"""Exercise 06 (reference solutions): fused q/k/v weights and their split, and RMSNorm with the residual folded in.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.model import rms_norm  # given: exercise 00's RMSNorm

SAME_AS = {
    "fuse_qkv_weights": "minillm.compile.fusion",
    "split_qkv": "minillm.compile.fusion",
    "add_rms_norm": "minillm.compile.fusion",
}

# task 06.qkv ------------------------------------------------------------------------------------------------


def fuse_qkv_weights(wq: Tensor, wk: Tensor, wv: Tensor) -> Tensor:
    """(n_heads*hd, dim), (n_kv_heads*hd, dim) x2 -> (n_heads*hd + 2*n_kv_heads*hd, dim): q rows, then k, then v."""
    return torch.cat([wq, wk, wv], dim=0)


def split_qkv(qkv: Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The fused projection's output (..., (n_heads + 2*n_kv_heads) * head_dim) -> q, k, v, in the weights' order."""
    return qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)


# task 06.add_norm -------------------------------------------------------------------------------------------


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next sublayer's input in one function, so
    the sum is formed once (a compiler then fuses add, square, mean, rsqrt and scale into one kernel)."""
    h = x + residual
    return rms_norm(h, weight, eps), h
