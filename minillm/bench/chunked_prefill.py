"""Benchmark "chunked-prefill" (lesson 12): the per-step token budget vs decode latency (Sarathi-Serve).

SmolLM2-135M, float32, greedy, fixed lengths (ignore_eos): a few short requests decode while long prompts
arrive. Each step runs the decodes first and fills the rest of its budget (max_num_batched_tokens) with
prefill chunks. The sweep runs every budget back to back on the same requests: a small budget bounds the
decodes' stalls (inter-token latency, ITL), paid for with more steps and a later first token for the long
prompts.
"""

from __future__ import annotations

import math

import torch

from minillm.measure.harness import BenchResult
from minillm.measure.metrics import percentiles
from minillm.measure.workload import Request, corpus_ids, serve


def mixed_workload(tok, n_decode: int, decode_len: int, n_long: int, long_len: int, gap_s: float,
                   first_s: float) -> list[Request]:
    """n_decode short prompts decoding decode_len tokens from t=0, and n_long prompts of long_len tokens (4 output
    tokens) arriving at first_s, first_s + gap_s, ..."""
    corpus = corpus_ids(tok)
    reqs = [Request(corpus[64 * i:64 * i + 32], decode_len, 0.0) for i in range(n_decode)]
    start = 10_000
    for j in range(n_long):
        reqs.append(Request(corpus[start + j * long_len:start + (j + 1) * long_len], 4, first_s + j * gap_s))
    return reqs


def run(quick: bool = False, dtype: str = "float32") -> BenchResult:
    from minillm.engine import LLM
    from minillm.api import load_model

    if quick:
        n_decode, decode_len, n_long, long_len, gap, first, budgets = 2, 12, 2, 160, 0.5, 0.2, (256, 32)
    else:
        n_decode, decode_len, n_long, long_len, gap, first = 4, 128, 3, 1024, 3.0, 1.0
        budgets = (2048, 512, 256, 128, 64)
    model, tok = load_model("smollm2-135m", dtype=dtype, device="cpu")
    reqs = mixed_workload(tok, n_decode, decode_len, n_long, long_len, gap, first)
    LLM.from_model(model, tok).generate([r.prompt_ids for r in reqs[:2]], [r.params() for r in reqs[:2]])  # warm-up

    rows, series = [], {"budget": [], "itl_p99_s": [], "long_ttft_mean_s": []}
    for budget in budgets:
        llm = LLM.from_model(model, tok, max_num_seqs=16, max_num_batched_tokens=budget)
        outs, wall = serve(llm, reqs)
        decodes, longs = outs[:n_decode], outs[n_decode:]
        itl = [g for o in decodes for g in o.metrics["itl"]]
        p = percentiles(itl, (50, 99))
        long_ttft = sum(o.metrics["ttft"] for o in longs) / len(longs)
        steps = llm.step_log
        rows.append({"budget": budget, "chunked": budget < long_len + n_decode,
                     "decode_itl_p50_s": p["p50"], "decode_itl_p99_s": p["p99"], "decode_itl_max_s": max(itl),
                     "decode_tpot_mean_s": sum(o.metrics["tpot"] for o in decodes) / n_decode,
                     "long_ttft_mean_s": long_ttft, "steps": len(steps),
                     "max_step_s": max(s["t_end"] - s["t_start"] for s in steps), "wall_s": wall,
                     "output_tok_per_s": sum(len(o.token_ids) for o in outs) / wall})
        series["budget"].append(budget)
        series["itl_p99_s"].append(p["p99"])
        series["long_ttft_mean_s"].append(long_ttft)

    unchunked = rows[0]
    chunked = [r for r in rows if r["chunked"]]
    best = min(chunked, key=lambda r: r["decode_itl_p99_s"])
    ratios = {
        "best_itl_p99_vs_unchunked": best["decode_itl_p99_s"] / unchunked["decode_itl_p99_s"],
        "its_long_ttft_vs_unchunked": best["long_ttft_mean_s"] / unchunked["long_ttft_mean_s"],
        "its_throughput_vs_unchunked": best["output_tok_per_s"] / unchunked["output_tok_per_s"],
    }
    targets = {"best_itl_p99_vs_unchunked": ("<=", 0.5)}
    notes = [
        (f"{n_decode} requests of 32 prompt tokens decode {decode_len} tokens each from t=0; {n_long} prompts of "
         f"{long_len} tokens (4 output tokens) arrive at t = {first} s + {gap} s apart; {dtype}; greedy; CPU."),
        (f"budget {unchunked['budget']} holds a whole long prompt plus the decodes: no chunking; the best chunked "
         f"budget for decode ITL p99 here was {best['budget']} tokens."),
        (f"ITL is measured per decoding request between consecutive tokens (engine timestamps): "
         f"{n_decode * (decode_len - 1)} gaps per budget; max_step_s is the longest engine step."),
        ("steps and wall time per budget (output tok/s = output tokens / wall): "
         + ", ".join(f"{r['budget']}: {r['steps']} steps, {r['wall_s']:.1f} s" for r in rows)),
    ]
    if math.isnan(ratios["best_itl_p99_vs_unchunked"]):
        notes.append("no ITL samples: decode_len must be >= 2")
    return BenchResult(name="chunked-prefill", rows=rows, ratios=ratios, targets=targets, series=series,
                       settings={"quick": quick, "dtype": dtype, "decodes": n_decode, "decode_len": decode_len,
                                 "long_prompts": n_long, "long_len": long_len, "budgets": list(budgets),
                                 "device": "cpu", "threads": torch.get_num_threads()},
                       notes=notes)
