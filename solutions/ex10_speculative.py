"""Exercise 10 (reference solutions): greedy verification, the exact rejection-sampling rule and n-gram prompt
lookup of speculative decoding.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

# given: sample(probs, generator) -> one token id per row of a (rows, vocab) probability tensor (torch.multinomial,
# drawing from `generator`)
from minillm.sampling import sample

SAME_AS = {
    "verify_greedy": "minillm.speculative.decoding",
    "rejection_sample": "minillm.speculative.decoding",
    "propose_ngram": "minillm.speculative.drafters",
}

# task 10.greedy ----------------------------------------------------------------------------------------------


def verify_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """target_argmax[i] is the target's choice after draft[:i] (len(draft) + 1 of them). Returns the accepted
    drafts followed by the target's own token: the first correction, or the bonus token when all pass."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return draft[:n] + [target_argmax[n]]


# task 10.rejection -------------------------------------------------------------------------------------------


def rejection_sample(p: Tensor, q: Tensor | None, draft: list[int],
                     generator: torch.Generator | None = None) -> list[int]:
    """The exact rule. p (k + 1, vocab): the target's distributions at the k draft positions and after them;
    q (k, vocab): the drafter's distributions the drafts were drawn from, or None for one-hot guesses.
    Returns the accepted drafts and one token from the target (residual draw, or bonus)."""
    k = len(draft)
    if p.shape[0] != k + 1 or (q is not None and q.shape[0] != k):
        raise ValueError(f"{k} drafts need p of {k + 1} rows and q of {k}, got {tuple(p.shape)}, "
                         f"{None if q is None else tuple(q.shape)}")
    rows, tokens = torch.arange(k, device=p.device), torch.tensor(draft, dtype=torch.long, device=p.device)
    p_x = p[rows, tokens]
    q_x = q[rows, tokens] if q is not None else torch.ones_like(p_x)
    u = torch.rand(k, generator=generator, device=p.device)
    accepted = (u * q_x < p_x).tolist()  # u < p/q without dividing by a zero q
    n = accepted.index(False) if False in accepted else k
    if n == k:
        return draft + [int(sample(p[k:k + 1], generator)[0])]
    if q is not None:
        residual = (p[n] - q[n]).clamp_min(0)
    else:
        residual = p[n].clone()
        residual[draft[n]] = 0
    if float(residual.sum()) <= 0:  # p == q up to rounding: no mass left to correct, p itself is the answer
        residual = p[n]
    return draft[:n] + [int(sample((residual / residual.sum())[None], generator)[0])]


# task 10.ngram -----------------------------------------------------------------------------------------------


def propose_ngram(ids: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that continue `ids`, found in `ids` itself: take its last n tokens (n from max_n down to
    min_n: a longer match is better evidence), find their most recent earlier occurrence that has a token after it,
    and return the (at most k) tokens that followed it. [] when no suffix of length >= min_n occurred before."""
    last = ids[-1] if ids else None
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        pattern = ids[-n:]
        for i in range(len(ids) - n - 1, -1, -1):  # most recent first; the occurrence at the very end is excluded
            if ids[i + n - 1] == last and ids[i:i + n] == pattern:
                return ids[i + n:i + n + k]
    return []
