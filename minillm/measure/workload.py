"""Serving workloads (lesson 05, `minillm bench batching`): requests for an engine, and the loop feeding them.

A workload is a list of requests with a prompt (real English text from CPython's pydoc topics, cut to a drawn
token length), an output length (requests run with ignore_eos so they generate exactly that many tokens) and
an arrival time (all at t=0, or a Poisson process). Output lengths in real chat traffic are long-tailed: most
answers are short, a few very long. That tail is what makes static batching idle: a batch lasts as long as its
longest answer (`occupancy_timeline`). What a run achieved: minillm.measure.metrics.summarize.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from minillm.sampling import SamplingParams

DISTRIBUTIONS = ("uniform", "lognormal", "pareto")


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0  # seconds after the start of the run

    def params(self) -> SamplingParams:
        """Greedy, exactly max_tokens tokens (ignore_eos): the length the workload drew."""
        return SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)


def draw_length(rng: random.Random, dist: str, lo: int, hi: int) -> int:
    """One integer in [lo, hi]: uniform, or long-tailed (lognormal / Pareto) clipped to the range."""
    if dist == "uniform":
        return rng.randint(lo, hi)
    if dist == "lognormal":  # median a quarter of the way up (in log space), sigma 1: a few long answers
        x = rng.lognormvariate(math.log(lo) + 0.25 * math.log(hi / lo), 1.0)
    elif dist == "pareto":  # P(X > x) = (lo / x)^1.2: heavy tail
        x = lo * rng.paretovariate(1.2)
    else:
        raise ValueError(f"unknown length distribution {dist!r}; choose one of {DISTRIBUTIONS}")
    return int(min(hi, max(lo, round(x))))


_CORPUS: list[int] | None = None


def corpus_ids(tokenizer, n_chars: int = 200_000) -> list[int]:
    """Token ids of real English text shipped with CPython (pydoc_data.topics), tokenized once."""
    global _CORPUS
    if _CORPUS is None:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))[:n_chars]
        _CORPUS = tokenizer.encode(text)
    return _CORPUS


def make_workload(tokenizer, n_requests: int, prompt_len: tuple[int, int] = (16, 128),
                  output_len: tuple[int, int] = (8, 256), output_dist: str = "lognormal",
                  prompt_dist: str = "uniform", arrival: str = "all", rate: float | None = None,
                  seed: int = 0) -> list[Request]:
    """`n_requests` requests; arrival "all" (everything at t=0) or "poisson" (`rate` requests/s on average)."""
    if arrival not in ("all", "poisson"):
        raise ValueError(f"arrival must be 'all' or 'poisson', got {arrival!r}")
    if arrival == "poisson" and not (rate and rate > 0):
        raise ValueError("poisson arrivals need rate > 0 (requests per second)")
    rng = random.Random(seed)
    corpus = corpus_ids(tokenizer)
    requests, t = [], 0.0
    for _ in range(n_requests):
        n_prompt = draw_length(rng, prompt_dist, *prompt_len)
        start = rng.randrange(len(corpus) - n_prompt)
        if arrival == "poisson":
            t += rng.expovariate(rate)
        requests.append(Request(corpus[start:start + n_prompt], draw_length(rng, output_dist, *output_len), t))
    return requests


def serve(llm, requests: list[Request]) -> tuple[list, float]:
    """Feed `requests` to an LLM engine at their arrival times; returns (outputs in request order, wall seconds)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    ids: dict[int, str] = {}
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(order) or llm.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(order) and requests[order[nxt]].arrival_time <= now:
            r = requests[order[nxt]]
            ids[order[nxt]] = llm.add_request(r.prompt_ids, r.params(), arrival_time=t0 + r.arrival_time)
            nxt += 1
        if llm.has_unfinished():
            llm.step()
        elif nxt < len(order):
            time.sleep(max(0.0, requests[order[nxt]].arrival_time - (time.perf_counter() - t0)))
    wall = time.perf_counter() - t0
    return [llm.pop_output(ids[i]) for i in range(len(requests))], wall


def occupancy_timeline(step_log: list[dict]) -> tuple[list[float], list[float]]:
    """(step start times relative to the first step, occupancy per step) from an engine's step_log;
    occupancy is running sequences / max batch: the idle slots of static batching."""
    if not step_log:
        return [], []
    t0 = step_log[0]["t_start"]
    return [s["t_start"] - t0 for s in step_log], [s["occupancy"] for s in step_log]
