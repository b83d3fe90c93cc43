"""Turning logits into the next token: greedy, temperature, top-k, top-p (nucleus), with seeds.

Lesson 00's exercise asks for `sample_from_logits`; the engine (lesson 05) applies it per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    """Per-request decoding settings. temperature == 0 means greedy (argmax)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: set[int] = field(default_factory=set)  # added to the tokenizer's end-of-turn id
    ignore_eos: bool = False  # benchmarks generate exactly max_tokens

    def __post_init__(self) -> None:
        validate_sampling(self.max_tokens, self.temperature, self.top_k, self.top_p)
        self.stop_ids = set(self.stop_ids)


def validate_sampling(max_tokens: int, temperature: float, top_k: int | None, top_p: float) -> None:
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None (off) or an integer >= 1, got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")


def sample_from_logits(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
                       generator: torch.Generator | None = None) -> Tensor:
    """logits (batch, vocab) -> token ids (batch,).

    Order matters and matches the common convention: temperature scales, top-k keeps the k largest, top-p keeps the
    smallest set of most likely tokens whose probability reaches p (always at least one), then we draw.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token if the tokens before it already reach top_p; the first token always survives
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
