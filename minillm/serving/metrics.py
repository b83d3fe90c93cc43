"""/metrics (lesson 12): what the server did, in Prometheus' text format, with sums that add up.

Counters since start (requests, requests finished by reason, prompt and generated tokens, prefix-cache queries and
hits), gauges now (running, waiting, KV blocks) and histograms (time to first token, time per output token) as
_bucket/_sum/_count. A request with n choices is n requests, as in vLLM (n child requests), and each one accepted
ends with exactly one finish_reason (stop, length, abort, error), so once none runs requests_total is their sum.
"""

from __future__ import annotations

import bisect
import math
import threading

FINISH_REASONS = ("stop", "length", "abort", "error")
# upper bounds in seconds, CPU-sized: a first token is a prefill (tens of ms to seconds), an output token a step
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    """Prometheus' histogram: how many observations were <= each bound (cumulative, the last one +Inf), their sum
    and count."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value: `le` is inclusive
        self.sum += value

    def samples(self) -> list[tuple[str, float]]:
        """(name suffix and labels, value): the _bucket lines, _sum, _count."""
        out, total = [], 0
        for bound, count in zip([*map(repr, self.bounds), "+Inf"], self.counts):
            total += count
            out.append((f'_bucket{{le="{bound}"}}', total))
        return out + [("_sum", self.sum), ("_count", total)]


def _number(value: float) -> str:
    """A sample's value: integers whole (a counter past 10**6 must not print as 1e+06), others as repr."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class ServerMetrics:
    """The counters and histograms. The event loop counts requests in and out (accepted, finished); the engine
    thread counts what the engine did (retired: tokens, latencies); one lock, so a scrape sees whole updates."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = self.prompt_tokens = self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft, self.tpot = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)

    def accepted(self, n: int, prompt_tokens: int) -> None:
        """A request's n choices entered the engine; its prompt counts once (as usage counts it)."""
        with self.lock:
            self.requests += n
            self.prompt_tokens += prompt_tokens

    def ended(self, finishes: list[str | None], failed: bool) -> None:
        """A response ended, its choices' finish_reasons as the client got them: None (the client left, the server
        shut down, or the engine failed first) is an abort, or an error when the engine failed."""
        with self.lock:
            for f in finishes:
                self.finished[f if f in ("stop", "length") else "error" if failed else "abort"] += 1

    def retired(self, out) -> None:
        """Engine thread: a sequence left the engine (RequestOutput): its tokens, its first-token and per-token
        times. Tokens count as generated even when nobody read them (the client left, or a stop string had
        ended the choice while its next token was being sampled): compute spent, as vLLM counts it."""
        ttft, tpot = out.metrics.get("ttft", math.nan), out.metrics.get("tpot", math.nan)
        with self.lock:
            self.generation_tokens += len(out.token_ids)
            if not math.isnan(ttft):
                self.ttft.observe(ttft)
            if not math.isnan(tpot):
                self.tpot.observe(tpot)

    def render(self, llm) -> str:
        """The Prometheus text of the counters, and of `llm`'s gauges now."""
        lines = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP minillm_{name} {help_}", f"# TYPE minillm_{name} {kind}"])
            lines.extend(f"minillm_{name}{labels} {_number(value)}" for labels, value in samples)

        with self.lock:
            metric("requests_total", "counter", "requests accepted by the engine (a request with n choices is n)",
                   [("", self.requests)])
            metric("requests_finished_total", "counter", "requests ended, by the finish_reason the client got",
                   [(f'{{finish_reason="{k}"}}', v) for k, v in self.finished.items()])
            metric("prompt_tokens_total", "counter", "prompt tokens of accepted requests (once per prompt, whatever n)",
                   [("", self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "tokens the engine generated", [("", self.generation_tokens)])
            metric("time_to_first_token_seconds", "histogram", "request arrival to its first token",
                   self.ttft.samples())
            metric("time_per_output_token_seconds", "histogram", "mean time per token after the first, per request",
                   self.tpot.samples())
        metric("requests_running", "gauge", "requests in the running batch", [("", len(llm.scheduler.running))])
        metric("requests_waiting", "gauge", "requests waiting for a slot", [("", len(llm.scheduler.waiting))])
        used = llm.block_manager.num_blocks - llm.num_free_blocks()
        metric("kv_blocks_used", "gauge", "KV-cache blocks holding a running sequence's tokens", [("", used)])
        metric("kv_blocks_total", "gauge", "KV-cache blocks in the pool", [("", llm.block_manager.num_blocks)])
        if (cache := llm.prefix_cache_stats) is not None:
            metric("prefix_cache_queries_total", "counter", "prompt tokens looked up in the prefix cache",
                   [("", cache.query_tokens)])
            metric("prefix_cache_hits_total", "counter", "prompt tokens found in the prefix cache",
                   [("", cache.hit_tokens)])
            metric("prefix_cache_hit_rate", "gauge", "prefix_cache_hits_total / prefix_cache_queries_total",
                   [("", cache.hit_rate)])
        return "\n".join(lines) + "\n"
