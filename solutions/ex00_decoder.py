"""Exercise 00 (reference solutions): the pieces of a decoder step, as minillm implements them.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.attention import check_shapes  # input validation, given: not part of the task
from minillm.sampling import argmax_rows  # logits.argmax(-1), by numpy's faster one on the CPU: given

SAME_AS = {
    "rms_norm": "minillm.model",
    "apply_rope": "minillm.model",
    "causal_mask": "minillm.attention",
    "repeat_kv": "minillm.attention",
    "naive_attention": "minillm.attention",
    "logits_to_probs": "minillm.sampling",
    "sample": "minillm.sampling",
    "sample_from_logits": "minillm.sampling",
}


# task 00.rmsnorm --------------------------------------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, normalised in float32, returned in x's dtype."""
    # normalise in float32: bf16's 8-bit mantissa loses the mean of squares for large activations
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


# task 00.rope -----------------------------------------------------------------------------------------------

def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (batch, heads, seq, head_dim); cos/sin (batch, 1, seq, head_dim). The 'rotate half' pairing (HF layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


# task 00.attention ------------------------------------------------------------------------------------------

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


# task 00.sampler --------------------------------------------------------------------------------------------

def logits_to_probs(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0
                    ) -> Tensor:
    """logits (batch, vocab) -> the distribution a token is drawn from (batch, vocab), float32.

    Order matters and matches the common convention: temperature scales, top-k keeps the k largest, top-p keeps the
    smallest set of most likely tokens whose probability reaches p (always at least one). Temperature 0 (greedy) is
    the one-hot distribution of the argmax. Speculative decoding compares these distributions (lesson 10).
    """
    if temperature == 0:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    # shifted to <= 0 first and divided by at least float32's smallest normal: a temperature of 1e-300 is greedy's
    # limit (the others go to -inf), not inf - inf = NaN
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token if the tokens before it already reach top_p; the first token always survives
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[:, 0] = False  # also when top_p is below float32's range (5e-324 compares as 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """probs (batch, vocab) -> one token id per row (batch,), drawn with `generator` (seeded requests)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_from_logits(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
                       generator: torch.Generator | None = None) -> Tensor:
    """logits (batch, vocab) -> token ids (batch,): the argmax when greedy, else a draw from logits_to_probs."""
    if temperature == 0:
        return argmax_rows(logits)
    return sample(logits_to_probs(logits, temperature, top_k, top_p), generator)
