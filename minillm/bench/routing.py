"""Part "routing" of `minillm bench disagg` (lesson 13): three policies over 2 replicas, shared prefixes.

SmolLM2-135M, float32, greedy, fixed lengths (ignore_eos). Requests come from several groups, each with its
own long system prompt, interleaved, arriving as a Poisson stream; a ReplicaPool of two replicas with prefix
caching serves them behind round-robin, least-outstanding-tokens and prefix-affinity routing
(cluster/router.py), the same requests for each. Round-robin makes every replica cache every group's prompt;
affinity computes each once in the fleet. Per policy: TTFT p50/p99/mean, throughput, prefix hit rate,
evictions, load imbalance; outputs compared.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

from minillm.measure.metrics import percentiles, timer
from minillm.measure.workload import corpus_ids

POLICIES = ("round_robin", "least_tokens", "prefix_affinity")


def group_prompts(tok, n_groups: int, per_group: int, system_tokens: int, seed: int = 0
                  ) -> tuple[list[list[int]], list[int], int]:
    """n_groups x per_group chat prompts, interleaved in a seeded random order; each group has its own system prompt
    of about `system_tokens` tokens. Returns (prompts, group of each prompt, tokens of the shortest system turn)."""
    from pydoc_data.topics import topics

    text = corpus_ids(tok)
    names = sorted(topics)
    order = [g for g in range(n_groups) for _ in range(per_group)]
    random.Random(seed).shuffle(order)
    systems = [f"Reference text {g + 1}:\n\n" + tok.decode(text[g * system_tokens:(g + 1) * system_tokens])
               + "\n\nAnswer questions about Python using the reference text." for g in range(n_groups)]
    prompts = [tok.encode_chat([{"role": "system", "content": systems[g]},
                                {"role": "user", "content": f"What does it say about {names[(7 * k) % len(names)]}?"}])
               for k, g in enumerate(order)]
    n_shared = min(len(tok.encode_chat([{"role": "system", "content": s}], add_generation_prompt=False))
                   for s in systems)
    return prompts, order, n_shared


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def measure(quick: bool = False, threads: int = 1) -> dict:
    """Run the three policies; returns {"rows", "ratios", "targets", "notes", "series", "settings"}."""
    from minillm.cache.block_allocator import blocks_needed
    from minillm.cluster.replicas import ReplicaPool
    from minillm.sampling import SamplingParams
    from minillm.gguf.tokenizer import Tokenizer
    from minillm.gguf.weights import gguf_path, read_gguf_metadata

    torch.set_num_threads(threads)
    n_groups, per_group, system_tokens, max_tokens, rate, max_seqs, budget = (
        (4, 2, 64, 3, 4.0, 4, 256) if quick else (4, 6, 320, 16, 0.4, 4, 512))
    n_replicas, block_size = 2, 16
    tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(gguf_path()))
    prompts, groups, n_shared = group_prompts(tok, n_groups, per_group, system_tokens)
    arrivals = poisson_arrivals(len(prompts), rate)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    # running requests + the system prompts of half the groups (what one replica holds under affinity)
    per_request = blocks_needed(max(map(len, prompts)) + max_tokens, block_size)
    num_blocks = max_seqs * per_request + math.ceil(n_groups / n_replicas) * (n_shared // block_size)
    engine = {"num_blocks": num_blocks, "block_size": block_size, "max_num_seqs": max_seqs,
              "max_num_batched_tokens": budget}
    rows, outputs, series = [], {}, {"arrival_s": arrivals, "group": groups, "ttft_s": {}, "replica": {}}
    with timer() as startup:
        pool = ReplicaPool("smollm2-135m", n_replicas, "round_robin", engine, threads=threads, timeout=600)
    startup_s = startup.seconds
    with pool:
        pool.generate([p[-40:] for p in prompts[:n_replicas]], SamplingParams(max_tokens=2))  # warm-up, each replica
        for policy in POLICIES:
            pool.reset(policy)  # every replica's engine rebuilt (empty cache), the router fresh: same start
            t0 = time.perf_counter()  # also the origin of the output throughput (to the last token)
            outs = pool.generate(prompts, params, arrival_times=arrivals)  # a failed request raises, named
            wall = time.perf_counter() - t0
            where = [o.metrics["replica"] for o in outs]
            stats = pool.stats()
            caches = [s["prefix_cache"] or {} for s in stats]
            query = sum(c.get("query_tokens", 0) for c in caches)
            hit = sum(c.get("hit_tokens", 0) for c in caches)
            ttft = [o.metrics["ttft"] for o in outs]
            per_replica = [where.count(r) for r in range(n_replicas)]
            prompt_tokens = [sum(len(o.prompt_token_ids) for o, w in zip(outs, where) if w == r)
                             for r in range(n_replicas)]
            last_token = max(o.metrics["arrival_time"] + o.token_times[-1] for o in outs)
            pct = percentiles(ttft, (50, 99))
            rows.append({"policy": policy, "ttft_p50_s": pct["p50"], "ttft_p99_s": pct["p99"],
                         "ttft_mean_s": statistics.fmean(ttft),
                         "tpot_mean_s": statistics.fmean(o.metrics["tpot"] for o in outs),
                         "output_tok_per_s": sum(len(o.token_ids) for o in outs) / (last_token - t0),
                         "prefix_hit_rate": hit / query if query else 0.0,
                         "requests_per_replica": per_replica,
                         "imbalance_requests": max(per_replica) / statistics.fmean(per_replica),
                         "imbalance_prompt_tokens": max(prompt_tokens) / statistics.fmean(prompt_tokens),
                         "groups_per_replica": [len({g for g, w in zip(groups, where) if w == r})
                                                for r in range(n_replicas)],
                         "evictions": sum(c.get("evictions", 0) for c in caches), "wall_s": wall})
            outputs[policy] = [o.token_ids for o in outs]
            series["ttft_s"][policy] = ttft
            series["replica"][policy] = where
    by = {r["policy"]: r for r in rows}
    rr, lot, pa = by["round_robin"], by["least_tokens"], by["prefix_affinity"]
    same = sum(outputs["round_robin"][k] == outputs["least_tokens"][k] == outputs["prefix_affinity"][k]
               for k in range(len(prompts)))
    ratios = {
        "affinity_minus_rr_hit_rate": pa["prefix_hit_rate"] - rr["prefix_hit_rate"],
        "rr_over_affinity_mean_ttft": rr["ttft_mean_s"] / pa["ttft_mean_s"],
        "lot_over_affinity_mean_ttft": lot["ttft_mean_s"] / pa["ttft_mean_s"],
        "rr_over_affinity_p99_ttft": rr["ttft_p99_s"] / pa["ttft_p99_s"],
        "affinity_over_rr_throughput": pa["output_tok_per_s"] / rr["output_tok_per_s"],
        "outputs_equal_across_policies": same / len(prompts),
    }
    targets = {"affinity_minus_rr_hit_rate": (">", 0.0), "rr_over_affinity_mean_ttft": (">", 1.0),
               "outputs_equal_across_policies": (">=", 1.0)}
    lens = sorted(map(len, prompts))
    notes = [
        (f"{len(prompts)} chat requests in {n_groups} groups of {per_group} (own system turn of >= {n_shared} tokens "
         f"each; prompts {lens[0]}-{lens[-1]} tokens), seeded random interleaving, Poisson arrivals at {rate} req/s; "
         f"{max_tokens} output tokens each; {n_replicas} replicas x {threads} thread(s), float32, CPU; per replica "
         f"{num_blocks} KV blocks of {block_size} (running requests + ~{math.ceil(n_groups / n_replicas)} system "
         f"prompts), max_num_seqs {max_seqs}, budget {budget} tokens per step; pool startup {startup_s:.1f} s."),
        ("prefix-cache evictions per policy: " + ", ".join(f"{r['policy']} {r['evictions']}" for r in rows)
         + ("; none: the caches held every group, so the hit-rate gap is each group's first miss on each replica."
            if not any(r["evictions"] for r in rows) else ".")),
        (f"greedy outputs identical across the three policies for {same}/{len(prompts)} requests (a difference would "
         f"be batched rounding: the batches differ between policies)."),
        ("prefix affinity's fallback: the least loaded replica when nothing matches or when the matched replica owes "
         "> 1024 tokens more and > 1.5x the least loaded one's outstanding tokens (router defaults)."),
        ("TTFT is measured by the pool from each request's arrival to the receipt of its first token: queueing in the "
         "pool and the replica, prefill, one decode, and the pipe back. Other processes share this machine's 2 cores: "
         "absolute times are noisy, the policies ran back to back."),
    ]
    settings = {"quick": quick, "threads": threads, "replicas": n_replicas, "groups": n_groups,
                "per_group": per_group, "system_tokens": n_shared, "max_tokens": max_tokens, "rate": rate,
                "num_blocks": num_blocks, "block_size": block_size, "max_num_seqs": max_seqs, "budget": budget,
                "dtype": "float32", "device": "cpu"}
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes, "series": series,
            "settings": settings}


__all__ = ["POLICIES", "group_prompts", "measure", "poisson_arrivals"]
