"""Routing a mixed workload to a specialist (lesson 13): the small model takes its own job, the large one the rest.

Lesson 13's cascade runs a general student on every request and escalates when unsure: it agrees too rarely to pay.
A specialist (recipes/specialist.py) agrees on its narrow job, so the router asks *is this its job?*, before or
early in generation (ROUTES): "prompt", a classifier over the prompt (`DomainClassifier`, no model runs); "early",
the specialist's least likely of its first k tokens (an escalation wastes k tokens); "both". `policy_cost` turns
per-request measurements into any policy's agreement and seconds without running a model again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minillm.cluster.cascade import _greedy_with_logprobs, _prompt_list, check_pair, check_threshold
from minillm.sampling import SamplingParams

ROUTES = ("prompt", "early", "both")


def _tokens(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass one, or token ids")
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return [int(t) for t in prompt]


class DomainClassifier:
    """p(in the specialist's domain | prompt tokens): logistic regression over hashed token unigrams and bigrams.
    Deterministic: full-batch gradient descent in float64 from zeros, a fixed number of steps."""

    def __init__(self, buckets: int = 4096):
        if not isinstance(buckets, int) or buckets < 16:
            raise ValueError(f"buckets must be an int >= 16, got {buckets!r}")
        self.buckets = buckets
        self.weight = torch.zeros(buckets, dtype=torch.float64)
        self.bias = 0.0
        self.fitted = False

    def features(self, ids: Sequence[int]) -> torch.Tensor:
        """Presence (0/1) of each hashed unigram and bigram: a word's count does not say more about the job."""
        x = torch.zeros(self.buckets, dtype=torch.float64)
        ids = [int(t) for t in ids]
        # a fixed multiplicative hash (Python's hash() of tuples is salted per process for str, stable for ints,
        # but an explicit one reads the same in any language)
        keys = [t * 2654435761 % self.buckets for t in ids]
        keys += [(a * 2654435761 + b * 40503 + 97) % self.buckets for a, b in zip(ids, ids[1:])]
        x[keys] = 1.0
        return x

    def fit(self, positive: list[Sequence[int]], negative: list[Sequence[int]], steps: int = 400, lr: float = 2.0,
            l2: float = 1e-3) -> DomainClassifier:
        """Fit on token-id prompts: `positive` the domain's, `negative` everything else (classes weighted equally)."""
        if not positive or not negative:
            raise ValueError(f"fit needs prompts of both kinds: got {len(positive)} in-domain, {len(negative)} other")
        x = torch.stack([self.features(p) for p in list(positive) + list(negative)])
        y = torch.cat([torch.ones(len(positive)), torch.zeros(len(negative))]).double()
        w_row = torch.where(y > 0, 0.5 / len(positive), 0.5 / len(negative)).double()
        w, b = torch.zeros(self.buckets, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for _ in range(steps):
            err = (torch.sigmoid(x @ w + b) - y) * w_row  # gradient of the weighted log-loss
            w -= lr * (x.T @ err + l2 * w)
            b -= lr * err.sum()
        self.weight, self.bias, self.fitted = w, float(b), True
        return self

    def score(self, ids: Sequence[int]) -> float:
        if not self.fitted:
            raise RuntimeError("this DomainClassifier is not fitted: call fit(in_domain_prompts, other_prompts)")
        return float(torch.sigmoid(self.features(ids) @ self.weight + self.bias))


def early_confidence(logprobs: Sequence[float], k: int) -> float:
    """The least likely of the first k chosen tokens' probabilities (fewer if the answer ended sooner)."""
    if not logprobs:
        raise ValueError("no log-probs: early confidence needs at least one generated token")
    return min(1.0, math.exp(min(float(x) for x in list(logprobs)[:k])))


@dataclass
class RoutedAnswer:
    """What the routed cascade did for one request."""

    token_ids: list[int]
    text: str
    answered_by: str  # "small" | "large"
    prompt_score: float | None  # the classifier's p(in-domain), when the route used it
    early: float | None  # the specialist's early confidence, when it started
    small_tokens: int  # tokens the specialist generated (wasted when the large model answered)
    seconds: float


class RoutedCascade:
    """RoutedCascade(small, large, tokenizer, route, classifier, prompt_threshold, early_threshold, k).generate(
    prompts) answers each prompt (text or token ids, greedy) with the model its route picks."""

    def __init__(self, small, large, tokenizer=None, route: str = "both", classifier: DomainClassifier | None = None,
                 prompt_threshold: float = 0.5, early_threshold: float = 0.5, k: int = 4,
                 kv_cache_bytes: int = 64 << 20):
        from minillm.engine import LLM

        check_pair(small, large, tokenizer)
        if route not in ROUTES:
            raise ValueError(f"unknown route {route!r}; choose one of {ROUTES}")
        if route in ("prompt", "both") and (classifier is None or not classifier.fitted):
            raise ValueError(f"route {route!r} needs a fitted DomainClassifier (classifier=...)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k (tokens before the early decision) must be an int >= 1, got {k!r}")
        self.route, self.classifier, self.k = route, classifier, k
        self.prompt_threshold, self.early_threshold = check_threshold(prompt_threshold), check_threshold(
            early_threshold)
        self.tokenizer = tokenizer
        self.engines = {name: LLM.from_model(m, tokenizer, kv_cache_bytes=kv_cache_bytes, max_num_seqs=1)
                        for name, m in (("small", small), ("large", large))}

    def generate(self, prompts: list, params: SamplingParams | None = None) -> list[RoutedAnswer]:
        params = _greedy_with_logprobs(params)
        return [self._one(_tokens(p, self.tokenizer), params) for p in _prompt_list(prompts)]

    def _one(self, ids: list[int], params: SamplingParams) -> RoutedAnswer:
        t0 = time.perf_counter()
        score = None
        if self.route in ("prompt", "both"):
            score = self.classifier.score(ids)
            if score < self.prompt_threshold:
                return self._large(ids, params, t0, score, None, 0)
            if self.route == "prompt":
                (out,) = self.engines["small"].generate([ids], params)
                return RoutedAnswer(list(out.token_ids), out.text, "small", score, None, len(out.token_ids),
                                    time.perf_counter() - t0)
        tokens, logprobs, text = [], [], []
        events = self.engines["small"].stream([ids], params)
        try:  # stream the specialist; stop it at the k-th token if it is unsure (closing the stream aborts it)
            for ev in events:
                if ev.token_id is not None:
                    tokens.append(ev.token_id)
                    logprobs.append(ev.logprob)
                    text.append(ev.text)
                if len(tokens) == self.k or (ev.finished and len(tokens) < self.k):
                    if early_confidence(logprobs, self.k) < self.early_threshold or self.early_threshold >= 1.0:
                        events.close()
                        return self._large(ids, params, t0, score, early_confidence(logprobs, self.k), len(tokens))
                if ev.finished:
                    break
        finally:
            events.close()
        return RoutedAnswer(tokens, "".join(text), "small", score, early_confidence(logprobs, self.k), len(tokens),
                            time.perf_counter() - t0)

    def _large(self, ids, params, t0, score, early, small_tokens) -> RoutedAnswer:
        (out,) = self.engines["large"].generate([ids], params)
        return RoutedAnswer(list(out.token_ids), out.text, "large", score, early, small_tokens,
                            time.perf_counter() - t0)


# ------------------------------------------------------------------------------- the policies, from measurements


@dataclass
class Measured:
    """One request, both models run to the end once: everything a policy's cost and agreement need."""

    in_domain: bool
    prompt_score: float
    early: float  # early_confidence of the specialist's answer at the chosen k
    agree: bool  # the specialist's answer agrees with the large model's
    small_s: float  # the specialist's whole answer
    small_k_s: float  # the specialist up to its k-th token (what an early escalation wasted)
    large_s: float


def policy_cost(rows: Sequence[Measured], route: str, prompt_threshold: float = 0.5,
                early_threshold: float = 0.5) -> dict:
    """Agreement with always-large, mean seconds and the specialist's share for one policy over measured requests.
    An escalated request returns the large answer (agrees by definition) and pays what the specialist spent first."""
    if route not in (*ROUTES, "always_large", "always_small", "oracle"):
        raise ValueError(f"unknown route {route!r}")
    if not rows:
        raise ValueError("policy_cost needs at least one measured request")
    agree = seconds = small_served = 0.0
    for r in rows:
        to_small, spent = True, 0.0
        if route == "always_large":
            to_small = False
        elif route == "oracle":  # the best any router could do: the specialist takes exactly what it gets right
            to_small = r.agree
        elif route in ("prompt", "both") and r.prompt_score < prompt_threshold:
            to_small = False
        if to_small and route in ("early", "both") and (r.early < early_threshold or early_threshold >= 1.0):
            to_small, spent = False, r.small_k_s
        agree += r.agree if to_small else 1.0
        seconds += r.small_s if to_small else spent + r.large_s
        small_served += to_small
    n = len(rows)
    always_large = sum(r.large_s for r in rows) / n
    return {"route": route, "agreement": agree / n, "seconds": seconds / n, "cost_ratio": seconds / n / always_large,
            "small_share": small_served / n}


def mixed(in_domain: Sequence[Measured], other: Sequence[Measured], share: float, n: int = 1000) -> list[Measured]:
    """A workload of n requests with `share` of them in-domain, drawn in proportion from the measured ones (each
    measured request repeated as evenly as the counts allow): the what-if curve over the in-domain share."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share!r}")
    n_in = round(share * n)
    pick = lambda rows, m: [rows[i % len(rows)] for i in range(m)] if rows and m else []
    if (n_in and not in_domain) or (n - n_in and not other):
        raise ValueError("a share needs measured requests of that kind")
    return pick(list(in_domain), n_in) + pick(list(other), n - n_in)


__all__ = ["ROUTES", "DomainClassifier", "Measured", "RoutedAnswer", "RoutedCascade", "early_confidence", "mixed",
           "policy_cost"]
