"""Exercise 06: operator fusion (lesson 06, "fewer, larger ops per decode step").

Fuse SmolLM2's three attention input projections into one matmul and split its output back, and fold the residual
add into the RMSNorm that follows it. Fill in the three functions, then grade your work:

    minillm grade 06

The graders compare with the unfused computation (the separate q/k/v Linears; add then rms_norm), on MHA, GQA and
MQA shapes, in float32 and bfloat16, and finish by fusing the real model with your functions: its logits and greedy
tokens must equal the unfused model's. Calling minillm.compile.fusion inside your answers is rejected. Stands on
exercise 00 (`rms_norm`, given here from minillm).
"""

from __future__ import annotations

import torch  # noqa: F401  (you will need it)
from torch import Tensor

from minillm.model import rms_norm  # noqa: F401  given: exercise 00's RMSNorm

# task 06.qkv ------------------------------------------------------------------------------------------------


def fuse_qkv_weights(wq: Tensor, wk: Tensor, wv: Tensor) -> Tensor:
    """(n_heads*hd, dim), (n_kv_heads*hd, dim) x2 -> (n_heads*hd + 2*n_kv_heads*hd, dim): q rows, then k, then v."""
    raise NotImplementedError("task 06.qkv: one weight whose rows are the q rows, then the k rows, then the v rows")


def split_qkv(qkv: Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The fused projection's output (..., (n_heads + 2*n_kv_heads) * head_dim) -> q, k, v, in the weights' order."""
    raise NotImplementedError("task 06.qkv: three slices of the last dim, sized for q's heads and the KV heads")


# task 06.add_norm -------------------------------------------------------------------------------------------


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next sublayer's input in one function, so
    the sum is formed once (a compiler then fuses add, square, mean, rsqrt and scale into one kernel)."""
    raise NotImplementedError("task 06.add_norm: return the normalised sum and the sum itself")
