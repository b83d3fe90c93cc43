"""A model cascade (lesson 13): the small model answers first, the large one only when it is unsure.

`Cascade(small, large, tokenizer, signal, threshold).generate(prompts)` (FrugalGPT-style) runs the small
model, greedy and one request at a time, scores its confidence in [0, 1] and escalates below the threshold: 0
is always-small, 1 always-large (the small model is not even run). `SIGNALS`: the chosen tokens' geometric
mean probability, the least likely one's probability, 1 - mean normalised entropy. Cost: seconds and
`analytic_flops`. `sweep` turns both models' answers on a prompt set into the whole quality/cost curve without
running either again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from minillm.gguf.vocabulary import check_same_vocabulary
from minillm.sampling import SamplingParams
from minillm.speculative.drafters import early_exit_model

SIGNALS = ("mean_logprob", "min_prob", "entropy")
STUDENT = "smollm2-135m-student"


# --------------------------------------------------------------------------------------- confidence (pure)


def token_entropy(logits: Tensor) -> Tensor:
    """logits (rows, vocab) -> each row's entropy / log(vocab), in [0, 1] (0: one-hot, 1: uniform)."""
    logp = logits.float().log_softmax(dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)  # exp underflows to 0 for hopeless tokens: 0 * finite = 0
    return (entropy / math.log(logits.shape[-1])).clamp(0.0, 1.0)


def _nonempty(values: Sequence[float], what: str) -> list[float]:
    values = [float(v) for v in values]
    if not values:
        raise ValueError(f"no {what}: a confidence needs at least one generated token")
    return values


def mean_logprob_confidence(logprobs: Sequence[float]) -> float:
    """exp(mean log-prob) of the chosen tokens."""
    return min(1.0, math.exp(sum(lp := _nonempty(logprobs, "log-probs")) / len(lp)))


def min_prob_confidence(logprobs: Sequence[float]) -> float:
    """The probability of the least likely chosen token."""
    return min(1.0, math.exp(min(_nonempty(logprobs, "log-probs"))))


def entropy_confidence(entropies: Sequence[float]) -> float:
    """1 - the mean normalised entropy of each step's distribution."""
    e = _nonempty(entropies, "entropies")
    return min(1.0, max(0.0, 1.0 - sum(e) / len(e)))


def check_signal(signal: str) -> str:
    if signal not in SIGNALS:
        raise ValueError(f"unknown confidence signal {signal!r}; choose one of {SIGNALS}")
    return signal


def check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be a number in [0, 1] (0: always small, 1: always large), got {threshold!r}")
    return float(threshold)


def escalates(confidence: float, threshold: float) -> bool:
    """Escalate when the small model's confidence is below the threshold; threshold 1 always escalates."""
    return threshold >= 1.0 or confidence < threshold


# ------------------------------------------------------------------------------------------------ answers


def analytic_flops(config, prompt_tokens: int, output_tokens: int) -> int:
    """Matmul FLOPs of one greedy request: 2 x params per token run (prompt + every output token but the last, which
    is sampled and never fed back), with the LM head counted only for the sampled rows. Attention's own FLOPs are
    left out (they are small next to the weights at these context lengths)."""
    head = config.vocab_size * config.dim
    body = config.n_params() - head - (0 if config.tie_embeddings else head)  # the embedding lookup is no matmul
    return 2 * (body * (prompt_tokens + output_tokens - 1) + head * output_tokens)


@dataclass
class Answer:
    """One model's greedy answer to one prompt, with what it cost."""

    token_ids: list[int]  # the stop token included, as the engine returns them
    text: str
    logprobs: list[float]  # of each chosen token
    entropies: list[float] | None  # normalised, per token (recorded for the small model)
    seconds: float
    flops: int
    prompt_tokens: int

    def confidence(self, signal: str) -> float:
        check_signal(signal)
        if signal == "entropy":
            if self.entropies is None:
                raise ValueError("this answer has no recorded entropies (only the small model's are recorded)")
            return entropy_confidence(self.entropies)
        return (mean_logprob_confidence if signal == "mean_logprob" else min_prob_confidence)(self.logprobs)


@dataclass
class CascadeResult:
    """What the cascade did for one request."""

    token_ids: list[int]
    text: str
    answered_by: str  # "small" | "large"
    confidence: float | None  # the small model's; None when threshold 1 skipped it
    small: Answer | None = field(repr=False)
    large: Answer | None = field(repr=False)

    @property
    def escalated(self) -> bool:
        return self.answered_by == "large"

    @property
    def seconds(self) -> float:
        return sum(a.seconds for a in (self.small, self.large) if a is not None)

    @property
    def flops(self) -> int:
        return sum(a.flops for a in (self.small, self.large) if a is not None)


def check_pair(small, large, tokenizer=None, small_tokenizer=None) -> None:
    """Refuse a pair whose answers cannot be compared token for token: another vocabulary, tokenizer or device."""
    check_same_vocabulary(small, large, ("small model", "large one"), "a cascade compares token ids, so "
                          "both models must share one tokenizer (a distilled student keeps its teacher's)",
                          tokenizer, small_tokenizer)
    if small.device != large.device:
        raise ValueError(f"the small model is on {small.device}, the large one on {large.device}: put both on one")


def load_small(target, name: str = STUDENT, exit_layers: int = 16) -> tuple[object, str]:
    """The distilled student of lesson 09 when it has been saved on this machine, else the early-exit stand-in.
    Returns (model, description): say which one the numbers belong to."""
    from minillm.gguf.loader import load_from_file as load_model

    try:
        model, _ = load_model(name, dtype=str(target.dtype).removeprefix("torch."), device=str(target.device))
        return model, f"{name} (distilled student, {model.config.n_layers} blocks)"
    except (ValueError, FileNotFoundError) as e:
        return early_exit_model(target, exit_layers), (
            f"stand-in: the target's first {exit_layers} blocks + its head, untrained ({name} is not saved here: {e})")


# ------------------------------------------------------------------------------------------------ the cascade


class Cascade:
    """Cascade(small, large, tokenizer, signal="mean_logprob", threshold=0.5); generate(prompts, params) answers
    each prompt with the small model, and again with the large one when its confidence < threshold."""

    def __init__(self, small, large, tokenizer=None, signal: str = "mean_logprob", threshold: float = 0.5,
                 small_tokenizer=None, kv_cache_bytes: int = 64 << 20):
        from minillm.engine import LLM

        check_pair(small, large, tokenizer, small_tokenizer)
        self.signal, self.threshold = check_signal(signal), check_threshold(threshold)
        self.small, self.large, self.tokenizer = small, large, tokenizer
        # one request at a time: per-request seconds, and each forward's sampled row belongs to that request
        self.engines = {name: LLM.from_model(m, tokenizer, kv_cache_bytes=kv_cache_bytes, max_num_seqs=1)
                        for name, m in (("small", small), ("large", large))}

    def answer(self, which: str, prompts: list, params: SamplingParams | None = None) -> list[Answer]:
        """Every prompt (text or token ids) answered by one model alone ("small" or "large"), timed one by one."""
        if which not in self.engines:
            raise ValueError(f"which must be 'small' or 'large', got {which!r}")
        params = _greedy_with_logprobs(params)
        return [self._answer(which, prompt, params) for prompt in _prompt_list(prompts)]

    def generate(self, prompts: list, params: SamplingParams | None = None) -> list[CascadeResult]:
        """Answer each prompt (text or token ids, greedy; default max_tokens 32), one at a time, in input order."""
        params = _greedy_with_logprobs(params)
        results = []
        for prompt in _prompt_list(prompts):
            small = confidence = None
            if self.threshold < 1.0:  # at threshold 1 nothing the small model says keeps its answer
                small = self._answer("small", prompt, params)
                confidence = small.confidence(self.signal)
            escalate = small is None or escalates(confidence, self.threshold)
            large = self._answer("large", prompt, params) if escalate else None
            chosen = large if large is not None else small
            results.append(CascadeResult(chosen.token_ids, chosen.text, "large" if large else "small", confidence,
                                         small, large))
        return results

    def _answer(self, which: str, prompt, params: SamplingParams) -> Answer:
        engine = self.engines[which]
        entropies: list[float] = []
        hook = None
        # the engine reports only the chosen token's log-prob: the entropy comes from a hook, no extra forward
        if which == "small":  # see each step's sampled logits rows (one row per step: one request at a time)
            hook = engine.model.register_forward_hook(
                lambda module, args, logits: entropies.extend(token_entropy(logits[0]).tolist()))
        try:
            t0 = time.perf_counter()
            (out,) = engine.generate([prompt], params)
            seconds = time.perf_counter() - t0
        finally:
            if hook is not None:
                hook.remove()
        if which == "small" and len(entropies) != len(out.token_ids):
            raise RuntimeError(f"recorded {len(entropies)} distributions for {len(out.token_ids)} tokens: the small "
                               "model ran forwards that were not this request's")
        return Answer(list(out.token_ids), out.text, list(out.logprobs or []), entropies if hook else None, seconds,
                      analytic_flops(engine.model.config, out.prompt_tokens, len(out.token_ids)), out.prompt_tokens)


def _prompt_list(prompts) -> list:
    if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
        raise TypeError("pass a list of prompts (strings or lists of token ids), e.g. [prompt]")
    return list(prompts)


def _greedy_with_logprobs(params: SamplingParams | None) -> SamplingParams:
    params = SamplingParams(max_tokens=32) if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.temperature != 0:
        raise ValueError("the cascade compares greedy answers: use temperature 0")
    return SamplingParams(**{**params.__dict__, "logprobs": True})  # the caller's params stay as they were


# ------------------------------------------------------------------------------------- quality and the sweep


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share (the index of their first divergence)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@torch.inference_mode()
def answer_kl(small, large, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """Mean over the large model's answer of KL(p_large || p_small) per next token, both teacher-forced on it."""
    if not prompt_ids or not answer_ids:
        raise ValueError("answer_kl needs a non-empty prompt and answer")
    ids = torch.tensor([list(prompt_ids) + list(answer_ids)[:-1]], device=large.device)
    rows = torch.arange(len(prompt_ids) - 1, ids.shape[1], device=large.device)  # the rows predicting the answer
    p_log = large(ids, logits_at=rows)[0].float().log_softmax(-1)
    q_log = small(ids, logits_at=rows)[0].float().log_softmax(-1)
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


@dataclass
class Outcome:
    """One request with both answers known: everything the sweep needs, no model."""

    confidence: float  # the small model's, under one signal
    exact: bool  # the small greedy answer equals the large one
    prefix: float  # common prefix / the longer answer's length (1.0 iff exact)
    small_seconds: float
    large_seconds: float
    small_flops: float
    large_flops: float
    kl: float = float("nan")  # KL(large || small) on the large answer, when measured


def outcomes(small: list[Answer], large: list[Answer], signal: str, kls: list[float] | None = None) -> list[Outcome]:
    check_signal(signal)
    if len(small) != len(large):
        raise ValueError(f"{len(small)} small answers for {len(large)} large ones: answer the same prompts")
    kls = [float("nan")] * len(small) if kls is None else kls
    return [Outcome(s.confidence(signal), s.token_ids == b.token_ids,
                    common_prefix(s.token_ids, b.token_ids) / max(len(s.token_ids), len(b.token_ids), 1),
                    s.seconds, b.seconds, s.flops, b.flops, kl) for s, b, kl in zip(small, large, kls)]


def default_thresholds(confidences: Sequence[float]) -> list[float]:
    """0, every distinct confidence (the points where a request changes side), a tenth grid, and 1."""
    return sorted({0.0, 1.0, *(i / 10 for i in range(11)), *(float(c) for c in confidences)})


def sweep(results: list[Outcome], thresholds: Sequence[float] | None = None) -> list[dict]:
    """The cascade's quality and mean cost at each threshold, picking per request from answers computed once.
    An escalated request returns the large answer: it agrees with the large model by definition, and pays the small
    model's cost too unless the threshold is 1 (then the small model is never run)."""
    if not results:
        raise ValueError("sweep needs at least one request")
    thresholds = default_thresholds([r.confidence for r in results]) if thresholds is None else thresholds
    n = len(results)
    large_s = sum(r.large_seconds for r in results) / n
    large_f = sum(r.large_flops for r in results) / n
    curve = []
    for t in map(check_threshold, thresholds):
        esc = [escalates(r.confidence, t) for r in results]
        small_ran = t < 1.0
        seconds = sum(small_ran * r.small_seconds + e * r.large_seconds for r, e in zip(results, esc)) / n
        flops = sum(small_ran * r.small_flops + e * r.large_flops for r, e in zip(results, esc)) / n
        curve.append({
            "threshold": t, "escalation_rate": sum(esc) / n,
            "agreement": sum(e or r.exact for r, e in zip(results, esc)) / n,
            "prefix_agreement": sum(1.0 if e else r.prefix for r, e in zip(results, esc)) / n,
            "kl": sum(0.0 if e else r.kl for r, e in zip(results, esc)) / n,
            "seconds": seconds, "flops": flops,
            "seconds_ratio": seconds / large_s if large_s > 0 else float("nan"),
            "flops_ratio": flops / large_f if large_f > 0 else float("nan"),
        })
    return curve


__all__ = ["SIGNALS", "Answer", "Cascade", "CascadeResult", "Outcome", "analytic_flops", "answer_kl", "check_pair",
           "common_prefix", "default_thresholds", "entropy_confidence", "escalates",
           "load_small", "mean_logprob_confidence", "min_prob_confidence", "outcomes", "sweep", "token_entropy"]
