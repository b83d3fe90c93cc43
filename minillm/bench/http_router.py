"""Benchmark "http-router" (lesson 13): two `minillm serve` processes behind sglang-router, cache_aware vs
round-robin, on the shared-prefix chat workload (cluster/http_router.py: the fleet, the workload, the measurement).

ReplicaPool's routing question (bench disagg, part routing) asked over HTTP with a router users already run: the
servers' prefix-cache hit rate from their /metrics, the client's time to first token, and whether both policies
give the same greedy answers. Needs `pip install sglang-router`; skipped with a note without it, and in quick mode
(it starts four servers and two routers, a few minutes; tests/test_http_router.py is its slow test).
"""

from __future__ import annotations

import importlib.util

from minillm.measure.harness import BenchResult


def run(quick: bool = False, threads: int = 1) -> BenchResult:
    settings = {"quick": quick, "threads": threads, "device": "cpu"}
    if quick or importlib.util.find_spec("sglang_router") is None:
        why = ("quick mode: the fleet runs in the full benchmark only" if quick else
               "sglang-router is not installed (pip install sglang-router)")
        return BenchResult(name="http-router", rows=[], ratios={}, settings=settings, notes=[f"skipped: {why}"],
                           quick=quick)
    from minillm.cluster.http_router import measure

    out = measure(threads=threads)
    rows = {r["policy"]: r for r in out["rows"]}
    rr, ca = rows["round_robin"], rows["cache_aware"]
    ratios = {"cache_aware_vs_round_robin_hit_rate": ca["prefix_hit_rate"] / max(rr["prefix_hit_rate"], 1e-9),
              "round_robin_vs_cache_aware_ttft_p50": rr["ttft_p50_s"] / ca["ttft_p50_s"],
              "same_text_as_round_robin": ca["same_text_as_first"]}
    notes = [f"{out['settings']['requests']} chats in {out['settings']['groups']} groups sharing a system prompt, "
             f"Poisson arrivals at {out['settings']['rate']} req/s, a fresh fleet (empty caches) per policy",
             "cache_aware sends a chat that matches no worker's tree to the worker with the fewest requests in "
             "flight; it rebalances only past 64 requests of load gap, which two servers at this rate never reach"]
    return BenchResult(name="http-router", rows=out["rows"], ratios=ratios,
                       targets={"cache_aware_vs_round_robin_hit_rate": (">=", 1.0)},
                       settings={**settings, **out["settings"]}, notes=notes, quick=quick)
