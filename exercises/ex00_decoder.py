"""Exercise 00: the pieces of one decoder step (lesson 00, "anatomy of inference").

Fill in each function, then grade your work:

    minillm grade 00

Every function keeps the signature and docstring of minillm's own version; the graders compare yours with
independent references (torch's own RMSNorm and attention, a loop over complex numbers for RoPE, sampling
frequencies for the sampler). Calling those library ops (or minillm) inside your answer is rejected.

The last task, task_00_real_model, runs SmolLM2-135M on your pieces (minillm.course.ladder.use_exercises): your
rms_norm and apply_rope inside every block, your naive_attention as its attention backend, your sampler in
minillm.chat. The chat prompt's logits must stay within 1e-3 of minillm's (one piece at a time, so the failure names
the piece) and the model must answer "The capital of France is Paris." This exercise stands on nothing earlier:
it is the ladder's first rung.
"""

from __future__ import annotations

import torch
from torch import Tensor

# task 00.rmsnorm --------------------------------------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, normalised in float32, returned in x's dtype."""
    raise NotImplementedError(
        "task 00.rmsnorm: upcast x to float32, divide by sqrt(mean of squares over the last dim + eps), "
        "cast back to x.dtype, multiply by weight"
    )


# task 00.rope -----------------------------------------------------------------------------------------------

def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (batch, heads, seq, head_dim); cos/sin (batch, 1, seq, head_dim). The 'rotate half' pairing (HF layout)."""
    raise NotImplementedError(
        "task 00.rope: split the last dim into halves x1, x2; dim i pairs with dim i + head_dim/2; "
        "x * cos + cat(-x2, x1) * sin, computed in float32, returned in x's dtype"
    )


# task 00.attention ------------------------------------------------------------------------------------------

def causal_mask(q_len: int, kv_len: int, device=None) -> Tensor:
    """Bool (q_len, kv_len), True where query i may attend key j (bottom-right aligned)."""
    raise NotImplementedError(
        "task 00.attention: query i is position i + (kv_len - q_len); it may see keys j <= that position"
    )


def repeat_kv(x: Tensor, group: int) -> Tensor:
    """(b, h_kv, s, d) -> (b, h_kv * group, s, d): KV head g serves query heads g*group ... g*group+group-1."""
    raise NotImplementedError(
        "task 00.attention: repeat each KV head `group` times next to itself (h0 h0 h0 h1 h1 h1, not h0 h1 h0 h1)"
    )


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    raise NotImplementedError(
        "task 00.attention: check_shapes(q, k, v); repeat_kv to n_heads; scores = q k^T / sqrt(head_dim) in "
        "float32; mask with causal_mask (-inf where not allowed); softmax over keys; @ v; return q's dtype"
    )


# task 00.sampler --------------------------------------------------------------------------------------------

def logits_to_probs(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0
                    ) -> Tensor:
    """logits (batch, vocab) -> the distribution a token is drawn from (batch, vocab), float32.

    Order matters and matches the common convention: temperature scales, top-k keeps the k largest, top-p keeps the
    smallest set of most likely tokens whose probability reaches p (always at least one). Temperature 0 (greedy) is
    the one-hot distribution of the argmax.
    """
    raise NotImplementedError(
        "task 00.sampler: temperature 0 -> one-hot of the argmax; else divide by temperature, set logits outside the "
        "top k to -inf, sort and keep the shortest prefix whose probability reaches top_p, softmax"
    )


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """probs (batch, vocab) -> one token id per row (batch,), drawn with `generator` (seeded requests)."""
    raise NotImplementedError("task 00.sampler: one draw per row from probs, with the generator")


def sample_from_logits(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
                       generator: torch.Generator | None = None) -> Tensor:
    """logits (batch, vocab) -> token ids (batch,): the argmax when greedy, else a draw from logits_to_probs."""
    raise NotImplementedError(
        "task 00.sampler: temperature 0 -> argmax (no draw, no generator use); else sample(logits_to_probs(...))"
    )
