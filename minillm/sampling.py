"""Turning logits into the next token: penalties, greedy, temperature, top-k, top-p (nucleus), with seeds.

Two steps: `logits_to_probs` (the distribution after temperature, top-k, top-p) and `sample` (a draw from it), so
speculative decoding can compare the draft's and the target's distributions (lesson 10). `sample_from_logits` puts
them together (lesson 00's exercise); `sample_batch` applies per-request settings to an engine step (lesson 05):
first what depends on the request's history (`adjust_logits`: repetition/frequency/presence penalties, min_tokens),
then the distribution. Log-probabilities reported back (`token_logprobs`) are those of the raw logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs (and vLLM's default max_logprobs)


@dataclass
class SamplingParams:
    """Per-request decoding settings. temperature == 0 means greedy (argmax).

    Penalties (OpenAI's and vLLM's rules, applied to the logits before temperature/top-k/top-p, greedy included):
    presence_penalty and frequency_penalty in [-2, 2] subtract `frequency * count + presence * (count > 0)` from the
    logit of each token already generated; repetition_penalty > 0 (1 = off; CTRL's rule) divides the positive logits
    of every token in the prompt or the output and multiplies the negative ones. min_tokens: the stop tokens are
    masked until that many tokens are generated. n > 1 asks the engine for n samples of the prompt (`LLM.generate`
    returns them in a row): sample i is seeded with seed + i, so they are reproducible and differ (`for_sample`).
    logprobs: each generated token's log-probability, top_logprobs (0..20) the most likely alternatives too
    (RequestOutput.logprobs / .top_logprobs), both from the raw logits (see `token_logprobs`).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: set[int] = field(default_factory=set)  # added to the tokenizer's end-of-turn id
    ignore_eos: bool = False  # benchmarks generate exactly max_tokens
    logprobs: bool = False  # also return each token's log-probability (RequestOutput.logprobs)
    top_logprobs: int = 0  # and this many most likely alternatives per token (needs logprobs=True)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    n: int = 1

    def __post_init__(self) -> None:
        self.stop_ids = set(self.stop_ids)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (the engine calls it again: fields are mutable)."""
        validate_sampling(self.max_tokens, self.temperature, self.top_k, self.top_p, self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n (samples of the prompt) must be an integer >= 1, got {self.n!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def for_sample(self, i: int) -> SamplingParams:
        """The params of sample i of n: n=1 and seed + i (mod 2**64), so n seeded samples are reproducible and
        differ; unseeded samples draw from the global generator."""
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % 2**64)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_sampling(max_tokens: int, temperature: float, top_k: int | None, top_p: float,
                      seed: int | None = None) -> None:
    if not _is_int(max_tokens) or max_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None (off) or an integer >= 1, got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):
        raise ValueError(f"seed must be None or an integer in [0, 2**64), got {seed!r}")


def apply_penalties(logits: Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int],
                    presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0) -> Tensor:
    """One row of logits (vocab,) -> a penalised float32 copy, in vLLM's order. Repetition (CTRL, Keskar et al.
    2019): each token seen in the prompt or the output has its logit divided by `repetition` if positive, multiplied
    if negative (both push it down when > 1). Then OpenAI's: `frequency * count + presence * (count > 0)` is
    subtracted, count being how often the token occurs in the output (the prompt does not count)."""
    out = logits.float().clone()
    if repetition != 1:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=out.device)
        if len(seen):
            x = out[seen].double()  # a penalty near 0 or huge would overflow float32 (inf, then NaN in softmax)
            big = torch.finfo(torch.float32).max
            out[seen] = torch.where(x > 0, x / repetition, x * repetition).clamp(-big, big).float()
    if output_ids and (frequency or presence):
        counts = torch.bincount(torch.tensor(list(output_ids), device=out.device), minlength=out.shape[-1]).float()
        out -= frequency * counts + presence * (counts > 0).float()
    return out


def adjust_logits(logits: Tensor, params: SamplingParams, history) -> Tensor:
    """One row (vocab,) -> what sampling sees, given `history` (anything with prompt_ids, output_ids and stop_ids:
    an engine Sequence): the penalties, and the stop tokens masked while fewer than min_tokens are generated."""
    out = apply_penalties(logits, history.prompt_ids, history.output_ids, params.presence_penalty,
                          params.frequency_penalty, params.repetition_penalty)
    if len(history.output_ids) < params.min_tokens and history.stop_ids:
        out[torch.tensor(sorted(history.stop_ids), dtype=torch.long, device=out.device)] = float("-inf")
    return out


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


def argmax_rows(logits: Tensor) -> Tensor:
    """logits (..., vocab) -> each row's argmax (the first on a tie; a NaN counts as the largest), as
    logits.argmax(-1). A float32 CPU tensor goes through numpy: torch 2.13's CPU argmax is ~8x slower over
    SmolLM2's 49,152 logits (51 vs 6 us a row, 377 vs 58 for 16 rows, 2-core EPYC), a per-step cost of every
    greedy decode."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not torch.compiler.is_compiling():
        return torch.as_tensor(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def sample_from_logits(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float = 1.0,
                       generator: torch.Generator | None = None) -> Tensor:
    """logits (batch, vocab) -> token ids (batch,): the argmax when greedy, else a draw from logits_to_probs."""
    if temperature == 0:
        return argmax_rows(logits)
    return sample(logits_to_probs(logits, temperature, top_k, top_p), generator)


def token_logprobs(logits: Tensor, tokens: Sequence[int], num_top: int = 0
                   ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """logits (n, vocab), one row per token -> each token's log-probability and the num_top most likely tokens of
    its row as [(id, logprob)], most likely first.

    From the raw logits (log_softmax of the model's output, before penalties, temperature, top-k/top-p), as vLLM
    reports them by default (logprobs_mode "raw_logprobs"): the model's own distribution, whatever the request's
    sampling settings; a sampled token can be one the settings made likely but the model did not."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, torch.tensor(list(tokens), dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    if num_top <= 0:
        return chosen, [[] for _ in chosen]
    values, ids = lp.topk(num_top, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def sample_batch(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 histories: Sequence | None = None) -> tuple[list[int], list[float] | None]:
    """One token per row, each row with its own settings and generator; all greedy rows share one argmax.

    `histories[i]` (prompt_ids, output_ids, stop_ids: the engine passes its Sequences) is needed by the rows with
    penalties or min_tokens, whose logits go through adjust_logits first. Returns the token ids and, when any row
    asks for logprobs, the log-probability of each chosen token under the raw logits (token_logprobs), else None.
    One host sync per step: the scheduler needs the ids as ints."""
    raw = logits
    edited = [i for i, p in enumerate(params) if p.has_penalties or p.min_tokens]
    if edited:
        if histories is None:
            raise ValueError("penalties and min_tokens need each row's history (prompt, output and stop ids)")
        logits = logits.float().clone()
        for i in edited:
            logits[i] = adjust_logits(logits[i], params[i], histories[i])
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:
        tokens[greedy] = argmax_rows(logits if len(greedy) == len(params) else logits[greedy])
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature != 0:
            tokens[i] = sample(logits_to_probs(logits[i:i + 1], p.temperature, p.top_k, p.top_p), gen)[0]
    ids = tokens.tolist()
    logprobs = token_logprobs(raw, ids)[0] if any(p.logprobs for p in params) else None
    return ids, logprobs
