"""Turning logits into the next token: greedy, temperature, top-k, top-p (nucleus), with seeds.

Two steps: `logits_to_probs` (the distribution after temperature, top-k, top-p) and `sample` (a draw from it), so
speculative decoding can compare the draft's and the target's distributions (lesson 10). `sample_from_logits` puts
them together (lesson 00's exercise); `sample_batch` applies per-request settings to an engine step (lesson 05).
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
    logprobs: bool = False  # also return each token's log-probability (RequestOutput.logprobs)

    def __post_init__(self) -> None:
        validate_sampling(self.max_tokens, self.temperature, self.top_k, self.top_p, self.seed)
        self.stop_ids = set(self.stop_ids)


def validate_sampling(max_tokens: int, temperature: float, top_k: int | None, top_p: float,
                      seed: int | None = None) -> None:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None (off) or an integer >= 1, got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
        raise ValueError(f"seed must be None or an integer in [0, 2**64), got {seed!r}")


def logits_to_probs(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0
                    ) -> Tensor:
    """logits (batch, vocab) -> the distribution a token is drawn from (batch, vocab), float32.

    Order matters and matches the common convention: temperature scales, top-k keeps the k largest, top-p keeps the
    smallest set of most likely tokens whose probability reaches p (always at least one). Temperature 0 (greedy) is
    the one-hot distribution of the argmax. Speculative decoding compares these distributions (lesson 10).
    """
    if temperature == 0:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
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
    return logits.softmax(dim=-1)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """probs (batch, vocab) -> one token id per row (batch,), drawn with `generator` (seeded requests)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_from_logits(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
                       generator: torch.Generator | None = None) -> Tensor:
    """logits (batch, vocab) -> token ids (batch,): the argmax when greedy, else a draw from logits_to_probs."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample(logits_to_probs(logits, temperature, top_k, top_p), generator)


def sample_batch(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
                 ) -> tuple[list[int], list[float] | None]:
    """One token per row, each row with its own settings and generator; all greedy rows share one argmax.

    Returns the token ids and, when any row asks for logprobs, the log-probability of each chosen token under the
    model's own distribution (the raw logits, before temperature/top-k/top-p), else None. One host sync per step:
    the scheduler needs the ids as ints."""
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature != 0:
            tokens[i] = sample(logits_to_probs(logits[i:i + 1], p.temperature, p.top_k, p.top_p), gen)[0]
    logprobs = None
    if any(p.logprobs for p in params):
        logprobs = logits.float().log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0].tolist()
    return tokens.tolist(), logprobs
