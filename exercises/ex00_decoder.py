"""Exercise 00: the pieces of one decoder step (lesson 00, "anatomy of inference").

Fill in each function, then grade your work:

    minillm grade 00

Every function keeps the signature of minillm's own version; its docstring states the contract (inputs, outputs,
what must hold, a worked example), and `minillm hint 00 <task>` climbs from a nudge to the recipe in words, one level
per call (--level 1, 2, 3). The graders compare yours with
independent references (torch's own RMSNorm and attention, a loop over complex numbers for RoPE, sampling
frequencies for the sampler). Calling those library ops (or minillm) inside your answer is rejected.

The last task, task_00_real_model, runs SmolLM2-135M on your pieces (minillm.course.seams.use_exercises): your
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
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, normalised in float32, returned in x's dtype.

    x (..., dim) in any float dtype; weight (dim,); eps > 0 guards a row of zeros and sits inside the square root.
    The mean of squares is taken over the last dim only, in float32 (a float16 square overflows above ~256); the
    result has x's shape and dtype. Example: x = [3., 4.], weight = [1., 2.], eps = 0: mean(x^2) = 12.5, its root
    3.5355, so the result is [0.8485, 2.2627].
    """
    raise NotImplementedError("task 00.rmsnorm: see the docstring; `minillm hint 00 rmsnorm` for hints")


# task 00.rope -----------------------------------------------------------------------------------------------

def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (batch, heads, seq, head_dim); cos/sin (batch, 1, seq, head_dim). The 'rotate half' pairing (HF layout).

    Each pair of dims (i, i + head_dim/2) is a 2-D vector (a, b) rotated by its angle t: (a cos t - b sin t,
    b cos t + a sin t). cos/sin already hold cos t / sin t for every dim, the angle of pair i repeated in both halves.
    Computed in float32, returned in x's dtype and shape. Example: head_dim 2, x = [1., 0.], angle 90 degrees
    (cos = [0, 0], sin = [1, 1]) gives [0., 1.]; x = [0., 1.] gives [-1., 0.].
    """
    raise NotImplementedError("task 00.rope: see the docstring; `minillm hint 00 rope` for hints")


# task 00.attention ------------------------------------------------------------------------------------------

def causal_mask(q_len: int, kv_len: int, device=None) -> Tensor:
    """Bool (q_len, kv_len), True where query i may attend key j (bottom-right aligned).

    The queries are the last q_len of kv_len positions, so query i sits at position i + kv_len - q_len and sees
    every key at or before it. Example: q_len 2, kv_len 4 gives [[T, T, T, F], [T, T, T, T]]; q_len 1 (a decode
    step) sees every key.
    """
    raise NotImplementedError("task 00.attention: see the docstring; `minillm hint 00 attention` for hints")


def repeat_kv(x: Tensor, group: int) -> Tensor:
    """(b, h_kv, s, d) -> (b, h_kv * group, s, d): KV head g serves query heads g*group ... g*group+group-1.

    Copies are adjacent: with 2 KV heads and group 3 the output heads are h0 h0 h0 h1 h1 h1 (not h0 h1 h0 h1 h0 h1).
    group 1 returns x unchanged.
    """
    raise NotImplementedError("task 00.attention: see the docstring; `minillm hint 00 attention` for hints")


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """softmax(q k^T / sqrt(head_dim)) v, with the causal mask when asked, built whole (the O(N^2) reference).

    q (batch, n_heads, q_len, head_dim); k, v (batch, n_kv_heads, kv_len, head_dim), n_kv_heads dividing n_heads and
    q_len <= kv_len (the given check_shapes validates these); query head h reads KV head h // (n_heads / n_kv_heads).
    Returns (batch, n_heads, q_len, head_dim) in q's dtype; scores and softmax in float32, and scores in the
    hundreds must not overflow. Example: one head, one query, keys with scores [0, 0] and values [[1.], [3.]] give
    [[2.]]; with q_len = kv_len = 2 and causal, the first query sees only the first key.
    """
    raise NotImplementedError("task 00.attention: see the docstring; `minillm hint 00 attention` for hints")


# task 00.sampler --------------------------------------------------------------------------------------------

def logits_to_probs(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0
                    ) -> Tensor:
    """logits (batch, vocab) -> the distribution a token is drawn from (batch, vocab), float32.

    Order matters and matches the common convention: temperature scales, top-k keeps the k largest, top-p keeps the
    smallest set of most likely tokens whose probability reaches p (always at least one). Temperature 0 (greedy) is
    the one-hot distribution of the argmax, and a tiny one (even 1e-300, which is 0 in float32) tends to it: never NaN.

    top_k None (or >= vocab) and top_p 1.0 disable those filters; rows are independent; the result sums to 1 per
    row with zeros where filtered. Example: logits [2, 1, 0, -1] at temperature 1 are probabilities [.644, .237,
    .087, .032]; top_k 2 keeps [.731, .269, 0, 0]; top_p 0.7 keeps the first two too (.644 alone is short of .7,
    .644 + .237 reaches it); top_p 0.6 keeps only the first.
    """
    raise NotImplementedError("task 00.sampler: see the docstring; `minillm hint 00 sampler` for hints")


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """probs (batch, vocab) -> one token id per row (batch,), drawn with `generator` (seeded requests).

    Token j of row b comes out with probability probs[b, j]; every random number comes from `generator`, so the
    same seed gives the same tokens. Example: probs [[0, 1, 0]] always gives tensor([1]).
    """
    raise NotImplementedError("task 00.sampler: see the docstring; `minillm hint 00 sampler` for hints")


def sample_from_logits(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
                       generator: torch.Generator | None = None) -> Tensor:
    """logits (batch, vocab) -> token ids (batch,): the argmax when greedy, else a draw from logits_to_probs.

    Greedy (temperature 0) draws nothing: the generator's state is left untouched. Otherwise one draw per row from
    the filtered distribution, with `generator`. Example: logits [[0., 5., 1.]] at temperature 0 give tensor([1]).
    """
    raise NotImplementedError("task 00.sampler: see the docstring; `minillm hint 00 sampler` for hints")
